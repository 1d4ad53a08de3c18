#!/bin/sh
# Remove what scripts/install.sh put in place, after putting the host back.
#
#   ./scripts/uninstall.sh           unbind every bound process (as `tunerctl unbind`),
#                                    revert host settings, stop tunerd, remove the venv,
#                                    links, unit, completion, the runtime dir; keep
#                                    /etc/tunerd, the state dir and the log
#   ./scripts/uninstall.sh --purge   also remove /etc/tunerd, the state dir, the log and
#                                    the directories install.sh created; also after a
#                                    plain uninstall (its record is in the state dir)
#   ./scripts/uninstall.sh --force   go on even if `tunerctl revert` fails
#
# Run it as root. Paths come from the install's record (PREFIX/share/tunerd/install.env),
# so the same environment variables as install.sh (PREFIX first) find a moved install.
# Host settings are put back with `tunerctl revert` while the daemon still runs; if it is
# not running, their originals stay in the state dir (kept even with --purge) so a later
# `tunerd` + `tunerctl revert` can still restore them, and the runtime dir (the originals
# of bound processes) is kept for the same reason.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/scripts/service-lib.sh"

purge=no
force=no
for arg in "$@"; do
    case $arg in
        --purge) purge=yes ;;
        --force) force=yes ;;
        -h|--help) sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "uninstall.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
    esac
done
require_root uninstall.sh "it removes what install.sh put in /opt, /usr/local and /etc"
load_layout
record="$STATE_DIR/uninstalled.env"  # what a plain uninstall left, for a later --purge
if [ ! -f "$PREFIX/share/tunerd/install.env" ] && [ ! -f "$PREFIX/pyvenv.cfg" ]; then
    if [ "$purge" = yes ] && [ -f "$record" ] && [ ! -L "$record" ]; then
        # --purge after a plain uninstall: remove what it kept, as it recorded it
        # shellcheck disable=SC1090
        . "$record"
        rm -rf "$ETC_DIR" "$RUNTIME_DIR"
        rm -f "$LOG_FILE"
        echo "removed $ETC_DIR, $RUNTIME_DIR and $LOG_FILE"
        if [ "${REVERTED:-no}" = yes ]; then
            rm -rf "$STATE_DIR"
            echo "removed $STATE_DIR"
        else
            rm -f "$record"
            echo "kept $STATE_DIR: it holds the originals of host settings not reverted"
        fi
        # shellcheck disable=SC2086
        remove_empty_dirs ${CREATED_DIRS:-}
        echo "tunerd is purged"
        exit 0
    fi
    echo "uninstall.sh: no tunerd install in $PREFIX (set PREFIX to where it is)" >&2
    exit 1
fi
created_dirs=$(manifest_value CREATED_DIRS)

# 1. put bound processes and the host back while the daemon can still do it
reverted=no
unbound=no
pid=$(daemon_pid)
if [ -n "$pid" ]; then
    # every binding the daemon holds (bind, rules, run), restored as `tunerctl unbind` does
    pids=$(ctl --json jobs 2>/dev/null | "$PREFIX/bin/python" -I -c \
        'import json, sys; print(" ".join(str(j["pid"]) for j in json.load(sys.stdin)["jobs"]))' \
        2>/dev/null) || pids=""
    n=0
    failed=""
    for p in $pids; do
        if out=$(ctl unbind "$p" 2>&1); then
            n=$((n + 1))
        else
            failed="$failed pid $p: $(printf '%s' "$out" | tail -n 1);"
        fi
    done
    echo "restored $n bound process(es) as \`tunerctl unbind\` does"
    if [ -n "$failed" ]; then
        echo "note: could not restore:$failed" | sed 's/;$//'
    fi
    unbound=yes
    if ctl revert; then
        reverted=yes
    elif [ "$force" = yes ]; then
        echo "uninstall.sh: tunerctl revert failed; going on (--force)" >&2
    else
        echo "uninstall.sh: tunerctl revert failed (see above); nothing was removed." \
             "Fix it and run again, or use --force" >&2
        exit 1
    fi
else
    echo "note: tunerd is not running, so host settings it changed were not reverted;" \
         "their originals stay in $STATE_DIR (start tunerd and run \`tunerctl revert\`)," \
         "and bound processes keep their CPUs: $RUNTIME_DIR, which holds their originals," \
         "is kept"
fi

# 2. stop it
if [ "$INIT" = systemd ]; then
    systemctl disable --now tunerd 2>/dev/null || true
    [ -z "$pid" ] || echo "stopped tunerd.service (pid $pid)"
elif [ -n "$pid" ]; then
    stop_daemon "$pid"
fi

# 3. remove what install.sh put there
for link in "$BIN_DIR/tunerd" "$BIN_DIR/tunerctl"; do
    # only our own links: never a tunerd installed some other way
    case $(readlink "$link" 2>/dev/null || true) in
        "$PREFIX"/bin/*) rm -f "$link"; echo "removed $link" ;;
    esac
done
for f in "$UNIT_DIR/tunerd.service" "$BASH_COMPLETION_DIR/tunerctl" \
         "$ZSH_COMPLETION_DIR/_tunerctl"; do
    if [ -e "$f" ]; then rm -f "$f"; echo "removed $f"; fi
done
if [ "$INIT" = systemd ]; then systemctl daemon-reload || true; fi
rm -rf "$PREFIX"
if [ "$unbound" = yes ] || [ "$purge" = yes ] || [ "$force" = yes ]; then
    rm -rf "$RUNTIME_DIR"
    echo "removed $PREFIX and $RUNTIME_DIR"
else
    echo "removed $PREFIX"
fi

if [ "$purge" = yes ]; then
    rm -rf "$ETC_DIR"
    rm -f "$LOG_FILE"
    echo "removed $ETC_DIR and $LOG_FILE"
    if [ "$reverted" = yes ] || [ "$force" = yes ]; then
        rm -rf "$STATE_DIR"
        echo "removed $STATE_DIR"
    else
        echo "kept $STATE_DIR: it holds the originals of host settings not reverted"
    fi
else
    # what `uninstall.sh --purge` needs later, when the install's own record is gone
    if [ -d "$STATE_DIR" ] || mkdir -p -m 0700 "$STATE_DIR"; then
        write_file "$record" 0600 "$(
            for k in ETC_DIR RUNTIME_DIR STATE_DIR LOG_FILE; do
                eval "v=\$$k"
                printf "%s=%s\n" "$k" "$(shell_quote "$v")"
            done
            printf "REVERTED=%s\nCREATED_DIRS=%s\n" "$reverted" "$(shell_quote "$created_dirs")")"
    fi
    echo "kept $ETC_DIR, $STATE_DIR and $LOG_FILE (--purge removes them, also later)"
fi
# the directories install.sh created, once empty (ETC_DIR after --purge)
# shellcheck disable=SC2086
remove_empty_dirs $created_dirs
echo "tunerd is uninstalled"
