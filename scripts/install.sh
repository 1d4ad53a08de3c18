#!/bin/sh
# Install tunerd, or upgrade it in place: a venv (default /opt/tunerd), tunerd and
# tunerctl on the PATH, the systemd unit, bash and zsh completion, the bundled policies
# into ETC_DIR/policies when it has none, then start the daemon.
#
#   ./scripts/install.sh              install or upgrade, and (re)start the daemon
#   ./scripts/install.sh --no-start   install or upgrade only
#
# Run it as root (a root shell needs no sudo). Run again after `git pull`: when what it
# installs changed (code, policies, unit: compared by hash, not only the version) it
# restarts the daemon and prints "tunerd OLD -> NEW"; state in STATE_DIR and RUNTIME_DIR
# is kept. With systemd as PID 1 the daemon is the tunerd.service unit; without it
# (containers) it runs in the background with its log in LOG_FILE, stopped through
# RUNTIME_DIR/tunerd.pid. scripts/uninstall.sh removes what this script put in place.
#
# Environment (every path can be moved, e.g. into a temporary tree):
#   PREFIX=/opt/tunerd          the venv            BIN_DIR=/usr/local/bin
#   ETC_DIR=/etc/tunerd         config + policies   UNIT_DIR=/etc/systemd/system
#   RUNTIME_DIR=/run/tunerd     STATE_DIR=/var/lib/tunerd   LOG_FILE=/var/log/tunerd.log
#   BASH_COMPLETION_DIR=/usr/share/bash-completion/completions
#   ZSH_COMPLETION_DIR=/usr/local/share/zsh/site-functions
#   PYTHON=/usr/bin/python3     INIT=auto|systemd|none (auto: systemd when it is PID 1)
#   TUNERD_ARGS="..."           extra tunerd flags (e.g. --metrics-listen 0.0.0.0:9464)
#   WHEEL=/path/tunerd-*.whl    install this wheel instead of this checkout's code
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/scripts/service-lib.sh"

start=yes
for arg in "$@"; do
    case $arg in
        --no-start) start=no ;;
        -h|--help) sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
    esac
done
require_root install.sh
load_layout
PYTHON=${PYTHON:-/usr/bin/python3}
WHEEL=${WHEEL:-}
if [ -n "$WHEEL" ]; then
    [ -f "$WHEEL" ] || { echo "install.sh: WHEEL='$WHEEL' is not a file" >&2; exit 2; }
    WHEEL=$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")
fi

# Debian/Ubuntu system Python refuses `pip install` outside a venv (PEP 668), and
# venv itself is a separate package there.
if [ ! -x "$PREFIX/bin/python" ]; then
    if ! "$PYTHON" -m venv --help >/dev/null 2>&1 || ! "$PYTHON" -c 'import ensurepip' 2>/dev/null
    then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv
    fi
fi

# What this install puts in place: the package sources, and the unit and daemon flags
# rendered for this layout. Any change in them means the daemon must restart.
daemon_args=$(daemon_flags)
unit_text=$(sed "s|^ExecStart=/opt/tunerd/bin/tunerd\$|ExecStart=$PREFIX/bin/tunerd${daemon_args:+ $daemon_args}|" \
    "$here/systemd/tunerd.service")
new_hash=$(
    cd "$here"
    { if [ -n "$WHEEL" ]; then sha256sum <"$WHEEL"; else
      find -L tunerd policies -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 \
        | LC_ALL=C sort -z | xargs -0 sha256sum
      sha256sum pyproject.toml; fi
      printf '%s\n%s\n' "$unit_text" "$daemon_args"; } | sha256sum | cut -d' ' -f1
)
old_version=$(installed_version)
old_hash=$(manifest_value SOURCE_HASH)

if [ -n "$old_version" ] && [ "$old_hash" = "$new_hash" ]; then
    changed=no
    echo "tunerd $old_version is already installed in $PREFIX (same code)"
else
    changed=yes
    if [ ! -x "$PREFIX/bin/python" ]; then
        "$PYTHON" -m venv "$PREFIX"
        "$PREFIX/bin/pip" install -q --upgrade pip
    fi
    if [ -n "$WHEEL" ]; then  # --force-reinstall: pip keeps an installed same version
        "$PREFIX/bin/pip" install -q "$WHEEL"
        "$PREFIX/bin/pip" install -q --no-deps --force-reinstall "$WHEEL"
    else
        "$PREFIX/bin/pip" install -q "$here"
    fi
fi
new_version=$(installed_version)
[ -n "$new_version" ] || { echo "install.sh: $PREFIX/bin/python cannot import tunerd" >&2; exit 1; }

# the directories this install creates, their missing parents too (install -d makes
# /usr/local/share/zsh for zsh's site-functions), and the ones an earlier install
# created: an uninstall removes them again once empty
created=$(manifest_value CREATED_DIRS)
for d in "$BIN_DIR" "$ETC_DIR" "$UNIT_DIR" "$BASH_COMPLETION_DIR" "$ZSH_COMPLETION_DIR"; do
    while [ ! -d "$d" ] && [ "$d" != / ] && [ "$d" != . ]; do
        created="$created $d"
        d=$(dirname "$d")
    done
done
created=$(printf '%s\n' $created | awk 'NF && !seen[$0]++' | tr '\n' ' ' | sed 's/ $//')
install -d -m 0755 "$BIN_DIR" "$ETC_DIR" "$ETC_DIR/policies" "$UNIT_DIR" \
    "$BASH_COMPLETION_DIR" "$ZSH_COMPLETION_DIR" "$PREFIX/share/tunerd"
ln -sfn "$PREFIX/bin/tunerd" "$BIN_DIR/tunerd"
ln -sfn "$PREFIX/bin/tunerctl" "$BIN_DIR/tunerctl"
# The bundled policies into the policy dir on the first install (no *.toml there yet), so
# that the daemon does its main job out of the box: the torch-training rule binds ranks as
# they exec (00-base.toml), with the node-type policies that match this node. Files there
# are the operator's from then on: never overwritten; an upgrade whose bundled copy
# differs says so.
bundled=$("$PREFIX/bin/python" -I -c \
    'from tunerd.policy.loader import BUNDLED_DIR; print(BUNDLED_DIR)')
if ! ls "$ETC_DIR/policies"/*.toml >/dev/null 2>&1; then
    install -m 0644 "$bundled"/*.toml "$ETC_DIR/policies/"
    echo "installed the bundled policies into $ETC_DIR/policies:" \
        "$(cd "$bundled" && ls ./*.toml | sed 's|^\./||' | tr '\n' ' ' | sed 's/ $//')"
else
    for f in "$bundled"/*.toml; do
        n=$(basename "$f")
        if [ -f "$ETC_DIR/policies/$n" ] && ! cmp -s "$f" "$ETC_DIR/policies/$n"; then
            echo "note: $ETC_DIR/policies/$n differs from the bundled $n of $new_version" \
                 "(kept; compare with: diff $ETC_DIR/policies/$n $f)"
        fi
    done
fi
# A config file listing every key with its default, all commented out; never overwritten.
if [ ! -e "$ETC_DIR/tunerd.toml" ]; then
    "$PREFIX/bin/python" -I - "$ETC_DIR/tunerd.toml" <<'EOF'
import sys
from tunerd.daemon.config import describe_keys
lines = ["# tunerd configuration (`tunerd --help` explains each key). Every key is",
         "# optional; a command-line flag wins over its key. Defaults shown commented out.", ""]
for key, default, meaning in describe_keys():
    lines += [f"# {meaning}", f"# {key} = {default}", ""]
with open(sys.argv[1], "x") as f:
    f.write("\n".join(lines))
EOF
    chmod 0644 "$ETC_DIR/tunerd.toml"
fi
# The unit is rewritten, and systemd reloaded, only when its text changed: a
# `systemctl daemon-reload` on a GPU node can cut running containers off their GPUs
# (nvidia-container-toolkit #48), so an unchanged unit never causes one.
unit_changed=yes
if [ -f "$UNIT_DIR/tunerd.service" ] && [ ! -L "$UNIT_DIR/tunerd.service" ] \
        && printf '%s\n' "$unit_text" | cmp -s - "$UNIT_DIR/tunerd.service"; then
    unit_changed=no
else
    write_file "$UNIT_DIR/tunerd.service" 0644 "$unit_text"
fi
# click's completion scripts; the programs are looked up on the PATH when completing
write_file "$BASH_COMPLETION_DIR/tunerctl" 0644 \
    "$(_TUNERCTL_COMPLETE=bash_source "$PREFIX/bin/tunerctl")"
write_file "$ZSH_COMPLETION_DIR/_tunerctl" 0644 \
    "$(_TUNERCTL_COMPLETE=zsh_source "$PREFIX/bin/tunerctl")"
# What was installed where: read by uninstall.sh, by the next install.sh (the hash) and
# by tunerctl (which log file to point at when the daemon does not answer).
write_file "$PREFIX/share/tunerd/install.env" 0644 "$(
    for k in PREFIX BIN_DIR ETC_DIR UNIT_DIR BASH_COMPLETION_DIR ZSH_COMPLETION_DIR \
             RUNTIME_DIR STATE_DIR LOG_FILE TUNERD_ARGS; do
        eval "v=\$$k"
        printf "%s=%s\n" "$k" "$(shell_quote "$v")"
    done
    printf "INIT=%s\nDAEMON_FLAGS=%s\nVERSION=%s\nSOURCE_HASH=%s\nCREATED_DIRS=%s\n" \
        "$INIT_SETTING" "$(shell_quote "$daemon_args")" "$new_version" "$new_hash" \
        "$(shell_quote "$created")")"

if [ -z "$old_version" ]; then
    echo "installed tunerd $new_version in $PREFIX"
elif [ "$changed" = yes ] && [ "$old_version" = "$new_version" ]; then
    echo "tunerd $old_version -> $new_version: reinstalled (same version, the code changed)"
elif [ "$changed" = yes ]; then
    echo "tunerd $old_version -> $new_version"
fi

if [ "$start" = no ]; then
    pid=$(daemon_pid)
    if [ -n "$pid" ] && [ "$changed" = yes ]; then
        echo "note: tunerd (pid $pid) still runs the previous code; run install.sh without" \
             "--no-start (or restart it) to use $new_version"
    fi
    exit 0
fi

if [ "$INIT" = systemd ]; then
    if [ "$unit_changed" = yes ]; then
        systemctl daemon-reload
    fi
    systemctl enable tunerd >/dev/null 2>&1 || systemctl enable tunerd
    if [ "$changed" = yes ]; then
        systemctl restart tunerd  # starts it when it was not running
    else
        systemctl start tunerd
    fi
else
    pid=$(daemon_pid)
    if [ -n "$pid" ] && [ "$changed" = yes ]; then
        stop_daemon "$pid"
        pid=""
    fi
    if [ -n "$pid" ]; then
        echo "tunerd is already running (pid $pid)"
    else
        start_daemon
    fi
fi
wait_ready || exit 1
pid=$(daemon_pid)
if [ "$INIT" = systemd ]; then
    echo "tunerd $new_version runs as tunerd.service (pid $pid); log: journalctl -u tunerd"
else
    echo "tunerd $new_version runs without systemd (pid $pid); log: $LOG_FILE"
fi
ctl status || true
