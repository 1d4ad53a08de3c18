#!/bin/sh
# Remove what scripts/install.sh put in place, after putting the host back.
#
#   ./scripts/uninstall.sh           revert host settings, stop tunerd, remove the venv,
#                                    links, unit, completion; keep /etc/tunerd, the state
#                                    dir and the log
#   ./scripts/uninstall.sh --purge   also remove /etc/tunerd, the state dir and the log
#   ./scripts/uninstall.sh --force   go on even if `tunerctl revert` fails
#
# Run it as root. Paths come from the install's record (PREFIX/share/tunerd/install.env),
# so the same environment variables as install.sh (PREFIX first) find a moved install.
# Host settings are put back with `tunerctl revert` while the daemon still runs; if it is
# not running, their originals stay in the state dir (kept even with --purge) so a later
# `tunerd` + `tunerctl revert` can still restore them.
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
if [ ! -f "$PREFIX/share/tunerd/install.env" ] && [ ! -f "$PREFIX/pyvenv.cfg" ]; then
    echo "uninstall.sh: no tunerd install in $PREFIX (set PREFIX to where it is)" >&2
    exit 1
fi

# 1. put the host back while the daemon can still do it
reverted=no
pid=$(daemon_pid)
if [ -n "$pid" ]; then
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
         "their originals stay in $STATE_DIR (start tunerd and run \`tunerctl revert\`)"
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
rm -rf "$RUNTIME_DIR"
rm -rf "$PREFIX"
echo "removed $PREFIX and $RUNTIME_DIR"

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
    echo "kept $ETC_DIR, $STATE_DIR and $LOG_FILE (--purge removes them)"
fi
echo "tunerd is uninstalled"
