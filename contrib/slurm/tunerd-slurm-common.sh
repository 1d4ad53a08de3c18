# Shared part of the tunerd Slurm scripts; sourced (". FILE") by
# tunerd-task-prolog.sh and tunerd-epilog.sh, never run by itself. They set
# TS_SELF (the prefix of every message) and TS_DIR (their directory) first.
#
# What it gives them:
# - the admin config (ts_init): KEY=VALUE lines read from tunerd-slurm.conf next to
#   the scripts if that file exists, else /etc/tunerd/slurm.conf. The file is parsed,
#   never executed, and ignored (with a warning) unless owned by root and writable by
#   root only. Keys (see slurm.conf.example):
#     TUNERCTL         the tunerctl command (default: the first of /usr/local/bin,
#                      /opt/tunerd/bin, /usr/bin that has it)
#     TUNERD_SOCKET    the control socket (default /run/tunerd/tunerd.sock)
#     TIMEOUT          seconds tunerctl waits for the daemon (default 1)
#     SYSLOG           yes | no: send messages to syslog with logger (default yes)
#     SYSLOG_SOCKET    syslog socket for logger (default: logger's own, /dev/log)
#     SYSLOG_FACILITY  syslog facility (default daemon)
#     USER_MESSAGES    TaskProlog lines in the job's output: all | problems | none
#                      (default problems)
# - a bounded tunerctl call (ts_tunerctl): `tunerctl --timeout TIMEOUT` inside
#   `timeout -k 0.1 TIMEOUT+0.4`, in an empty environment. The task prolog runs with
#   the job's environment, which the user controls: PATH, PYTHONPATH, TUNERD_SOCKET
#   or TUNERCTL_TIMEOUT from there must not decide what runs, where it connects or
#   how long a task start may wait.
# - messages (ts_log LEVEL TEXT): stderr, plus syslog with the tag tunerd-slurm.
#   Slurm 22.05 keeps neither TaskProlog nor Epilog stderr anywhere an admin looks,
#   so syslog is where they are read (journalctl -t tunerd-slurm).
#
# Worst case a script adds: TIMEOUT + 0.5 s for tunerctl plus 0.5 s for its one
# syslog line, 2 s with the defaults. (logger blocks when the syslog socket's
# queue is full, e.g. a wedged journald: its line is then lost, not the time.)

# the TS_* variables set here are read by the scripts that source this file
# shellcheck disable=SC2034

# slurmd runs the Epilog with no PATH; the task prolog gets the user's
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

TS_CONF=
TS_TUNERCTL=
TS_SOCKET=/run/tunerd/tunerd.sock
TS_TIMEOUT=1
TS_GUARD=1.4
TS_SYSLOG=yes
TS_SYSLOG_SOCKET=
TS_FACILITY=daemon
TS_USER_MESSAGES=problems
TS_CONF_NOTES=

ts_note() { TS_CONF_NOTES="${TS_CONF_NOTES:+$TS_CONF_NOTES; }$*"; }

ts_trim() {
    printf '%s' "$1" | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' \
        -e 's/^"\(.*\)"$/\1/' -e "s/^'\(.*\)'\$/\1/"
}

# ts_read_conf FILE: apply its known keys; unknown keys and bad values are noted
ts_read_conf() {
    _f=$1
    # ls -lnL, not stat -c: the same on GNU and busybox
    # shellcheck disable=SC2012,SC2046
    set -- $(ls -lndL "$_f" 2>/dev/null)
    case ${1:-} in
        -????-??-?*) ;;
        *) ts_note "$_f ignored: not a regular file writable by its owner only"; return ;;
    esac
    if [ "${3:-}" != 0 ]; then
        ts_note "$_f ignored: owned by uid ${3:-?}, not root"
        return
    fi
    _n=0
    while IFS= read -r _line || [ -n "$_line" ]; do
        _n=$((_n + 1))
        _line=$(ts_trim "${_line%%#*}")
        [ -n "$_line" ] || continue
        case $_line in
            *=*) ;;
            *) ts_note "$_f:$_n: not KEY=VALUE"; continue ;;
        esac
        _key=$(ts_trim "${_line%%=*}")
        _val=$(ts_trim "${_line#*=}")
        case $_key in
            TUNERCTL) TS_TUNERCTL=$_val ;;
            TUNERD_SOCKET) TS_SOCKET=$_val ;;
            TIMEOUT)
                if printf '%s' "$_val" | grep -Eq '^[0-9]+(\.[0-9]+)?$' \
                        && [ "$(echo "$_val" | awk '{print ($1 > 0)}')" = 1 ]; then
                    TS_TIMEOUT=$_val
                else
                    ts_note "$_f:$_n: TIMEOUT=$_val is not a positive number of seconds"
                fi ;;
            SYSLOG)
                case $_val in
                    yes|no) TS_SYSLOG=$_val ;;
                    *) ts_note "$_f:$_n: SYSLOG=$_val is not yes or no" ;;
                esac ;;
            SYSLOG_SOCKET) TS_SYSLOG_SOCKET=$_val ;;
            SYSLOG_FACILITY) TS_FACILITY=$_val ;;
            USER_MESSAGES)
                case $_val in
                    all|problems|none) TS_USER_MESSAGES=$_val ;;
                    *) ts_note "$_f:$_n: USER_MESSAGES=$_val is not all, problems or none" ;;
                esac ;;
            *) ts_note "$_f:$_n: unknown key $_key" ;;
        esac
    done < "$_f"
}

# ts_init trusted|untrusted: read the config; "trusted" (the Epilog, whose
# environment slurmd builds) lets TUNERCTL and TUNERD_SOCKET from the
# environment override it, "untrusted" (the TaskProlog: the job's environment)
# ignores them.
ts_init() {
    # the task's rank identity is kept in TS_LOCALID and taken out of this script's own
    # environment, so that the tools it runs (sed, awk, logger, tunerctl ...) carry no
    # rank variable: a rule daemon never takes them for ranks of the job
    TS_LOCALID=${SLURM_LOCALID:-}
    unset SLURM_LOCALID LOCAL_RANK OMPI_COMM_WORLD_LOCAL_RANK MPI_LOCALRANKID
    if [ -e "$TS_DIR/tunerd-slurm.conf" ]; then
        TS_CONF=$TS_DIR/tunerd-slurm.conf
    elif [ -e /etc/tunerd/slurm.conf ]; then
        TS_CONF=/etc/tunerd/slurm.conf
    fi
    [ -z "$TS_CONF" ] || ts_read_conf "$TS_CONF"
    if [ "$1" = trusted ]; then
        [ -z "${TUNERCTL:-}" ] || TS_TUNERCTL=$TUNERCTL
        [ -z "${TUNERD_SOCKET:-}" ] || TS_SOCKET=$TUNERD_SOCKET
    fi
    if [ -z "$TS_TUNERCTL" ]; then
        for _c in /usr/local/bin/tunerctl /opt/tunerd/bin/tunerctl /usr/bin/tunerctl; do
            if [ -x "$_c" ]; then TS_TUNERCTL=$_c; break; fi
        done
    fi
    TS_GUARD=$(echo "$TS_TIMEOUT" | awk '{printf "%g", $1 + 0.4}')
}

# ts_log LEVEL TEXT: one line on stderr and, unless SYSLOG=no, in syslog; the
# first line also carries the config's problems (one logger call per line counts
# against the time budget, so they get no line of their own)
ts_log() {
    _msg="$TS_SELF: $2${TS_CONF_NOTES:+ [config: $TS_CONF_NOTES]}"
    TS_CONF_NOTES=
    printf '%s\n' "$_msg" >&2
    [ "$TS_SYSLOG" = yes ] || return 0
    # logger may block on a wedged syslog daemon: bound it too
    if [ -n "$TS_SYSLOG_SOCKET" ]; then
        timeout -k 0.1 0.4 logger -t tunerd-slurm -p "$TS_FACILITY.$1" \
            -u "$TS_SYSLOG_SOCKET" -- "$_msg" 2>/dev/null
    else
        timeout -k 0.1 0.4 logger -t tunerd-slurm -p "$TS_FACILITY.$1" -- "$_msg" 2>/dev/null
    fi
    return 0
}

# ts_tunerctl ARGS...: run tunerctl bounded in time; its output (stdout and
# stderr) is in TS_OUT, its exit status in TS_RC (124/137: killed by the guard)
ts_tunerctl() {
    if [ -z "$TS_TUNERCTL" ]; then
        TS_OUT="tunerctl not found (set TUNERCTL in ${TS_CONF:-/etc/tunerd/slurm.conf})"
        TS_RC=127
        return
    fi
    # TS_TUNERCTL may be a command with arguments ("/opt/venv/bin/python -m ..."):
    # split on spaces on purpose
    # shellcheck disable=SC2086
    TS_OUT=$(env -i PATH="$PATH" LC_ALL=C.UTF-8 \
        timeout -k 0.1 "$TS_GUARD" $TS_TUNERCTL --socket "$TS_SOCKET" \
        --timeout "$TS_TIMEOUT" "$@" 2>&1)
    TS_RC=$?
    case $TS_RC in
        124|137)
            TS_OUT="tunerctl did not finish within $TS_GUARD s and was stopped (daemon at $TS_SOCKET hung?)" ;;
    esac
}

# ts_oneline TEXT: the lines of TEXT joined with "; "
ts_oneline() { printf '%s' "$1" | awk 'NF { printf "%s%s", sep, $0; sep = "; " }'; }
