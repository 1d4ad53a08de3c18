#!/bin/sh
# Run tunerd's aarch64 code paths on an x86 machine, under qemu user emulation: an arm64
# Debian Python (an extracted root, no chroot, nothing registered in binfmt_misc), the
# recorded-topology tests (GB200 trays, GH200, DGX B200, ...) and the daemon replaying
# the GB200 tray in dry-run, queried by this machine's tunerctl.
#
#   PYTHON=.venv/bin/python scripts/arm64-check.sh   as root; PYTHON: one with pip and
#       tunerd's dependencies (tunerctl runs on it); WORK=/tmp/tunerd-arm64 is kept
#
# What it cannot run: anything that execs another aarch64 program (pytest's daemon
# fixtures start sys.executable; install.sh runs pip and venv), and the NUMA system
# calls (qemu-user answers set_mempolicy/mbind/migrate_pages with ENOSYS): their numbers
# are checked against the kernel headers instead (tests/test_syscalls.py). Instead of
# install.sh it checks that every dependency has an aarch64 wheel.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/tunerd-arm64}
ROOT=$WORK/root
[ "$(id -u)" = 0 ] || { echo "arm64-check.sh: run it as root (apt-get, mmdebstrap)" >&2; exit 4; }
command -v qemu-aarch64 >/dev/null && command -v mmdebstrap >/dev/null || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        qemu-user mmdebstrap >/dev/null; }
PY=${PYTHON:-python3}
mkdir -p "$WORK"
if [ ! -x "$ROOT/usr/bin/python3" ]; then
    # Debian's arm64 python3 with the dependencies Debian packages (extract: no scripts run)
    mmdebstrap --quiet --variant=extract --arch=arm64 \
        --include=python3,python3-click,python3-psutil,python3-pyudev,python3-rich,python3-prometheus-client,python3-pytest,python3-hypothesis,python3-tomli,libudev1,procps \
        "$(. /etc/os-release && echo "$VERSION_CODENAME")" "$ROOT"
fi
echo "== every dependency has an aarch64 wheel (what install.sh would pip install there)"
rm -rf "$WORK/wheels"
"$PY" -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
    --platform manylinux_2_28_aarch64 -d "$WORK/wheels" \
    "click>=8.1" "nvidia-ml-py>=12.535" "pyudev>=0.24" "psutil>=5.9" \
    "prometheus_client>=0.17" "rich>=13" "inotify_simple>=1.3" 2>&1 | grep -v "is ignored" || true
ls "$WORK/wheels"
mkdir -p "$WORK/site"  # the two pure-Python ones Debian does not package
for w in "$WORK"/wheels/inotify_simple-*.whl "$WORK"/wheels/nvidia_ml_py-*.whl; do
    "$PY" -m zipfile -e "$w" "$WORK/site/"
done
run() {
    PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$here:$WORK/site" \
        qemu-aarch64 -L "$ROOT" "$ROOT/usr/bin/python3" "$@"
}
echo "== the interpreter"
run -c 'import platform, sys; print(platform.machine(), sys.version.split()[0])'
echo "== the recorded-topology tests (aarch64)"
cd "$here"
run -m pytest -q -p no:cacheprovider tests/test_syscalls.py tests/test_aarch64.py \
    tests/test_grace_nodes.py tests/test_placement.py tests/test_topology_nvml.py \
    tests/test_topology_sysfs.py tests/test_iopath.py -k "not torchrun and not tunerctl_topology"
echo "== the daemon (aarch64) replaying the GB200 tray, dry run"
# qemu -L looks a path up in ROOT first and creates new files on the host path: the
# daemon's dirs live in ROOT and the same host path is a symlink to them
D=/tmp/tunerd-arm64-daemon
rm -rf "${ROOT:?}$D" "$D"
mkdir -p "$ROOT$D/run" "$ROOT$D/state" "$ROOT$D/policies"
chmod 700 "$ROOT$D"
ln -s "$ROOT$D" "$D"
cp policies/*.toml "$ROOT$D/policies/"
cp tests/fixtures/topologies/gb200-hbm-numa.json "$ROOT$D/"
# started directly (not through run(): $! must be qemu's own pid, to stop it below)
PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$here:$WORK/site" \
    qemu-aarch64 -L "$ROOT" "$ROOT/usr/bin/python3" -m tunerd.daemon.main \
    --policy-dir "$D/policies" --runtime-dir "$D/run" --state-dir "$D/state" \
    --metrics-listen off --dry-run --scope-pid $$ \
    --topology "$D/gb200-hbm-numa.json" >"$WORK/daemon.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; rm -f "$D"' EXIT
i=0
while [ ! -S "$D/run/tunerd.sock" ] && [ $i -lt 120 ]; do sleep 1; i=$((i + 1)); done
ctl() { PYTHONPATH="$here" "$PY" -m tunerd.cli.main --socket "$D/run/tunerd.sock" "$@"; }
rc=0
ctl status | head -2 || rc=1
ctl topology | grep -E '^NUMA node|^  GPU[0-3]  [0-9]' || rc=1
ctl policy show | grep -E 'governor|transparent_hugepage' || rc=1
kill "$pid"
wait "$pid" 2>/dev/null || true
pgrep -f "runtime-dir $D/run" >/dev/null && echo "arm64-check.sh: the daemon did not stop" >&2
exit $rc
