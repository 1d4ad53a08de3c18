#!/bin/sh
# Install tunerd into a venv (default /opt/tunerd), put tunerd/tunerctl on the PATH,
# install the systemd unit, and start the daemon on the bundled default policy.
#   sudo ./scripts/install.sh            install and start
#   sudo ./scripts/install.sh --no-start install only
# Environment: PREFIX (venv, default /opt/tunerd), PYTHON (default /usr/bin/python3).
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${PREFIX:-/opt/tunerd}
PYTHON=${PYTHON:-/usr/bin/python3}
start=yes
[ "${1:-}" = "--no-start" ] && start=no

if [ "$(id -u)" != 0 ]; then
    echo "install.sh: run as root (sudo $0)" >&2
    exit 4
fi

# Debian/Ubuntu system Python refuses `pip install` outside a venv (PEP 668), and
# venv itself is a separate package there.
if ! "$PYTHON" -m venv --help >/dev/null 2>&1 || ! "$PYTHON" -c 'import ensurepip' 2>/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv
fi
"$PYTHON" -m venv "$PREFIX"
"$PREFIX/bin/pip" install -q --upgrade pip
"$PREFIX/bin/pip" install -q "$here"
ln -sf "$PREFIX/bin/tunerd" /usr/local/bin/tunerd
ln -sf "$PREFIX/bin/tunerctl" /usr/local/bin/tunerctl
install -d -m 0755 /etc/tunerd /etc/tunerd/policies
install -m 0644 "$here/systemd/tunerd.service" /etc/systemd/system/tunerd.service
# No policy in /etc/tunerd/policies yet: the daemon uses the bundled policies/default.toml.

[ "$start" = yes ] || exit 0
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    systemctl enable --now tunerd
else
    # No systemd as PID 1 (containers, CI): run it in the background, logs in /var/log.
    if [ -S /run/tunerd/tunerd.sock ] && tunerctl status >/dev/null 2>&1; then
        echo "tunerd is already running"
    else
        nohup "$PREFIX/bin/tunerd" >>/var/log/tunerd.log 2>&1 </dev/null &
        echo "started tunerd (pid $!) without systemd; logs in /var/log/tunerd.log"
    fi
fi
i=0
until tunerctl status >/dev/null 2>&1; do
    i=$((i + 1))
    if [ $i -gt 100 ]; then
        echo "install.sh: tunerd did not answer; see journalctl -u tunerd or /var/log/tunerd.log" >&2
        exit 1
    fi
    sleep 0.1
done
tunerctl status
