# Shared by install.sh and uninstall.sh (sourced, POSIX sh): where tunerd is installed,
# and how to find, stop and start its daemon with or without systemd.

require_root() {  # require_root SCRIPT [WHAT IT DOES]
    if [ "$(id -u)" != 0 ]; then
        echo "$1: must run as root (${2:-it installs into /opt, /usr/local and /etc}):" \
             "run it from a root shell, or with sudo" >&2
        exit 4
    fi
}

# shell_quote VALUE: VALUE in single quotes, safe to source back
shell_quote() {
    printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"
}

# manifest_value KEY: KEY from PREFIX/share/tunerd/install.env, written by install.sh
manifest_value() {
    _m="$PREFIX/share/tunerd/install.env"
    [ -f "$_m" ] || return 0
    (
        # shellcheck disable=SC1090
        . "$_m" 2>/dev/null || exit 0
        eval "printf '%s' \"\${$1:-}\""
    )
}

# load_layout: each path from the environment, else from the last install's manifest,
# else the default, so that an upgrade keeps the layout the first install chose.
load_layout() {
    PREFIX=${PREFIX:-/opt/tunerd}
    for _kv in BIN_DIR=/usr/local/bin ETC_DIR=/etc/tunerd UNIT_DIR=/etc/systemd/system \
               BASH_COMPLETION_DIR=/usr/share/bash-completion/completions \
               ZSH_COMPLETION_DIR=/usr/local/share/zsh/site-functions \
               RUNTIME_DIR=/run/tunerd STATE_DIR=/var/lib/tunerd LOG_FILE=/var/log/tunerd.log \
               INIT=auto TUNERD_ARGS=; do
        _k=${_kv%%=*}
        eval "_set=\${$_k+set}"
        if [ -z "$_set" ]; then  # set in the environment, even to "": that wins
            _v=$(manifest_value "$_k")
            [ -n "$_v" ] || _v=${_kv#*=}
            eval "$_k=\$_v"
        fi
    done
    INIT_SETTING=$INIT  # what the manifest records; INIT is resolved below
    for _k in PREFIX BIN_DIR ETC_DIR UNIT_DIR BASH_COMPLETION_DIR ZSH_COMPLETION_DIR \
              RUNTIME_DIR STATE_DIR LOG_FILE; do
        eval "_v=\$$_k"
        case $_v in
            /*) ;;
            *) echo "$_k must be an absolute path, got '$_v'" >&2; exit 2 ;;
        esac
        case $_v in
            *[[:space:]]*) echo "$_k must not contain spaces, got '$_v'" >&2; exit 2 ;;
        esac
        [ "$_v" != / ] || { echo "$_k must not be /" >&2; exit 2; }
    done
    case $INIT in
        auto) if [ -d /run/systemd/system ]; then INIT=systemd; else INIT=none; fi ;;
        systemd|none) ;;
        *) echo "INIT must be auto, systemd or none, got '$INIT'" >&2; exit 2 ;;
    esac
}

# daemon_flags: tunerd's flags for this layout (only the paths that are not its defaults)
daemon_flags() {
    _f=""
    if [ "$ETC_DIR" != /etc/tunerd ]; then
        _f="--config $ETC_DIR/tunerd.toml --policy-dir $ETC_DIR/policies"
    fi
    [ "$RUNTIME_DIR" = /run/tunerd ] || _f="$_f --runtime-dir $RUNTIME_DIR"
    [ "$STATE_DIR" = /var/lib/tunerd ] || _f="$_f --state-dir $STATE_DIR"
    [ -z "$TUNERD_ARGS" ] || _f="$_f $TUNERD_ARGS"
    printf '%s' "${_f# }"
}

installed_version() {
    [ -x "$PREFIX/bin/python" ] || return 0
    "$PREFIX/bin/python" -I -c 'import tunerd; print(tunerd.__version__)' 2>/dev/null || true
}

ctl() {
    "$PREFIX/bin/tunerctl" --socket "$RUNTIME_DIR/tunerd.sock" "$@"
}

# write_file PATH MODE CONTENT: replaced atomically (temp file in the same dir, rename)
write_file() {
    _tmp=$(mktemp "$(dirname "$1")/.$(basename "$1").XXXXXX")
    printf '%s\n' "$3" >"$_tmp"
    chmod "$2" "$_tmp"
    mv -f "$_tmp" "$1"
}

# is_tunerd PID: PID is alive and runs the tunerd daemon (not a recycled pid)
is_tunerd() {
    case $1 in ''|*[!0-9]*) return 1 ;; esac
    [ "$1" != "$$" ] && [ -r "/proc/$1/cmdline" ] || return 1
    # argv: [python, /PREFIX/bin/tunerd, ...] for the console script, or [tunerd, ...],
    # or [python, -m, tunerd.daemon.main, ...]
    tr '\0' '\n' <"/proc/$1/cmdline" 2>/dev/null | head -n 3 | {
        while IFS= read -r _a; do
            case $_a in
                tunerd|*/tunerd|tunerd.daemon.main) exit 0 ;;
            esac
        done
        exit 1
    }
}

# daemon_pid: the running daemon's pid, or nothing. The pidfile RUNTIME_DIR/tunerd.pid
# (a decimal pid and a newline) first, then the daemon's own answer to `status`; a pid
# is used only if /proc says it is a tunerd process.
daemon_pid() {
    if [ "$INIT" = systemd ] && [ -d /run/systemd/system ]; then
        _p=$(systemctl show -p MainPID --value tunerd 2>/dev/null || true)
        if is_tunerd "$_p"; then echo "$_p"; fi
        return 0
    fi
    _pf="$RUNTIME_DIR/tunerd.pid"
    if [ -f "$_pf" ] && [ ! -L "$_pf" ]; then
        _p=$(head -c 32 "$_pf" | tr -d ' \n')
        if is_tunerd "$_p"; then echo "$_p"; return 0; fi
        echo "note: $_pf names pid '$_p', which is not a running tunerd; ignored" >&2
    fi
    [ -x "$PREFIX/bin/tunerctl" ] || return 0
    _p=$(ctl --json status 2>/dev/null | "$PREFIX/bin/python" -I -c \
         'import json, sys; print(json.load(sys.stdin)["pid"])' 2>/dev/null || true)
    if is_tunerd "$_p"; then echo "$_p"; fi
}

# stop_daemon PID: SIGTERM, then wait for it to exit (SIGKILL after 20 s: its state is
# durable, so a hard stop loses nothing)
stop_daemon() {
    kill -TERM "$1" 2>/dev/null || return 0
    _i=0
    while [ -d "/proc/$1" ] && is_tunerd "$1"; do
        _i=$((_i + 1))
        if [ $_i -gt 200 ]; then
            echo "tunerd (pid $1) did not stop within 20 s of SIGTERM; sending SIGKILL" >&2
            kill -KILL "$1" 2>/dev/null || true
            break
        fi
        sleep 0.1
    done
    echo "stopped tunerd (pid $1)"
}

# start_daemon: in the background, detached from this terminal, log to LOG_FILE:
# tunerd --log-file rotates it by size (10 MiB x 4 files at most) and keeps it 0600
# (it holds command lines); what is printed before logging starts goes there too
start_daemon() {
    mkdir -p "$(dirname "$LOG_FILE")"
    (umask 077; : >>"$LOG_FILE")
    chmod 0600 "$LOG_FILE"
    # shellcheck disable=SC2046 # the flags are words on purpose (paths have no spaces)
    if command -v setsid >/dev/null 2>&1; then
        setsid nohup "$PREFIX/bin/tunerd" $(daemon_flags) --log-file "$LOG_FILE" \
            >>"$LOG_FILE" 2>&1 </dev/null &
    else
        nohup "$PREFIX/bin/tunerd" $(daemon_flags) --log-file "$LOG_FILE" \
            >>"$LOG_FILE" 2>&1 </dev/null &
    fi
}

# wait_ready: until the daemon answers `status` (20 s at most; exit 1 = it answered
# with a problem to show, e.g. a rejected policy)
wait_ready() {
    _i=0
    until _rc=0; ctl status >/dev/null 2>&1 || _rc=$?; [ $_rc -le 1 ]; do
        _i=$((_i + 1))
        if [ $_i -gt 200 ]; then
            if [ "$INIT" = systemd ]; then
                echo "tunerd did not answer within 20 s; see systemctl status tunerd" \
                     "and journalctl -u tunerd" >&2
            else
                echo "tunerd did not answer within 20 s; the end of $LOG_FILE:" >&2
                tail -n 20 "$LOG_FILE" >&2 2>/dev/null || true
            fi
            return 1
        fi
        sleep 0.1
    done
}

# rmdir each of the directories "$@" that is empty, the deepest first (a parent install.sh
# created, /usr/local/share/zsh, after its site-functions), saying which
remove_empty_dirs() {
    for _empty_dir in $(printf '%s\n' "$@" | awk 'NF { print length($0), $0 }' |
                        sort -rn | cut -d' ' -f2-); do
        if [ -d "$_empty_dir" ] && rmdir "$_empty_dir" 2>/dev/null; then
            echo "removed $_empty_dir (empty)"
        fi
    done
}
