#!/bin/sh
# Set up everything the test suite needs, then run it:  ./scripts/test.sh [pytest args]
# Installs Debian packages (iproute2, prometheus, numactl, ...), makes .venv with the
# project and its test extras, runs ruff, mypy and pytest. Run as root (a root shell
# needs no sudo): the tests bind real processes, create network namespaces and a test user.
set -eu
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
    echo "test.sh: must run as root (the tests bind real processes, create network" \
         "namespaces and a test user): run it from a root shell, or with sudo" >&2
    exit 4
fi
PYTHON=${PYTHON:-/usr/bin/python3}

need_pkgs=""
command -v ip >/dev/null 2>&1 || need_pkgs="$need_pkgs iproute2"
command -v prometheus >/dev/null 2>&1 || need_pkgs="$need_pkgs prometheus"
command -v promtool >/dev/null 2>&1 || need_pkgs="$need_pkgs prometheus"
command -v numactl >/dev/null 2>&1 || need_pkgs="$need_pkgs numactl"
command -v prlimit >/dev/null 2>&1 || need_pkgs="$need_pkgs util-linux"
command -v useradd >/dev/null 2>&1 || need_pkgs="$need_pkgs passwd"
command -v systemd-analyze >/dev/null 2>&1 || need_pkgs="$need_pkgs systemd"
command -v tmux >/dev/null 2>&1 || need_pkgs="$need_pkgs tmux"
command -v lspci >/dev/null 2>&1 || need_pkgs="$need_pkgs pciutils"
# a real single-node Slurm for tests/test_slurm_real.py (the tests start their own
# munged/slurmctld/slurmd; policy-rc.d below keeps the packaged services stopped)
command -v slurmd >/dev/null 2>&1 || need_pkgs="$need_pkgs slurm-wlm"
command -v munged >/dev/null 2>&1 || need_pkgs="$need_pkgs munge"
command -v logger >/dev/null 2>&1 || need_pkgs="$need_pkgs bsdutils"
# a real mpirun for tests/test_node_map.py (MPI local rank i placed near GPU i)
command -v mpirun >/dev/null 2>&1 || need_pkgs="$need_pkgs openmpi-bin"
# strace: tests/test_ledger_one_pidfd.py counts the daemon's pidfd_open and sched_setaffinity
command -v strace >/dev/null 2>&1 || need_pkgs="$need_pkgs strace"
# capsh: tests/test_nocap.py runs the daemon without CAP_SYS_RESOURCE
command -v capsh >/dev/null 2>&1 || need_pkgs="$need_pkgs libcap2-bin"
# kubectl: `kubectl kustomize deploy/kubernetes` in tests/test_kubernetes_deploy.py (where
# no package has it, the test renders the base with its own small renderer and says so)
command -v kubectl >/dev/null 2>&1 || { apt-cache show kubectl >/dev/null 2>&1 \
    && need_pkgs="$need_pkgs kubectl"; }
[ -e /usr/lib/x86_64-linux-gnu/libudev.so.1 ] || [ -e /lib/x86_64-linux-gnu/libudev.so.1 ] \
    || ldconfig -p | grep -q libudev.so.1 || need_pkgs="$need_pkgs libudev1"
"$PYTHON" -c 'import ensurepip' 2>/dev/null || need_pkgs="$need_pkgs python3-venv"
if [ -n "$need_pkgs" ]; then
    echo "installing:$need_pkgs"
    apt-get update -qq
    # the log goes to a new file of our own (mktemp: O_EXCL, 0600), never to a fixed
    # name in /tmp where another user could have put a symlink first
    apt_log=$(mktemp "${TMPDIR:-/tmp}/tunerd-apt.XXXXXX")
    made_rcd=
    cleanup() {
        if [ -n "$made_rcd" ]; then rm -f /usr/sbin/policy-rc.d; fi
        rm -f "$apt_log"
    }
    trap cleanup EXIT
    trap 'exit 129' HUP; trap 'exit 130' INT; trap 'exit 143' TERM  # run the EXIT trap
    # policy-rc.d: never start packaged services (prometheus) during the install. An
    # existing one is the admin's: it is used as it is and left in place.
    if [ ! -e /usr/sbin/policy-rc.d ] && [ ! -L /usr/sbin/policy-rc.d ]; then
        # noclobber: created only if still absent; marked ours only once written
        (set -C; printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d) && made_rcd=1
        if [ -n "$made_rcd" ]; then chmod +x /usr/sbin/policy-rc.d; fi
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need_pkgs \
        >"$apt_log" 2>&1 || { cat "$apt_log"; exit 1; }
    cleanup
    made_rcd=
    trap - EXIT HUP INT TERM
fi

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip
# compat: a .pth path entry, not an import hook that every python start would pay (~17 ms)
.venv/bin/pip install -q -e '.[test,plot]' --config-settings editable_mode=compat  # plot: bench --png
# torch is an optional extra: the daemon never imports it. The tests use a real one for
# `tunerctl doctor`, the training-side helpers and `tunerctl bench`'s built-in workload.
# 2.13.0 is the CPU build (a newer unpinned release would pull a multi-GB CUDA build).
.venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/pip install -q torch==2.13.0 numpy
# the real DeepSpeed and HF Accelerate launchers for tests/test_launchers_real.py (~7 s
# into a fresh venv). After torch: deepspeed is an sdist whose setup.py imports torch,
# so no build isolation (it would fetch another torch); DS_BUILD_OPS=0 builds no ops.
.venv/bin/python -c 'import importlib.util as u, sys
sys.exit(not (u.find_spec("deepspeed") and u.find_spec("accelerate")))' 2>/dev/null \
    || DS_BUILD_OPS=0 .venv/bin/pip install -q --no-build-isolation deepspeed==0.19.8 \
        accelerate==1.16.0
# the real Lightning and Ray Train launchers for tests/test_launchers_lightning_ray.py
# (~26 s into a fresh venv that has torch, ~560 MB; ray[train]: Ray Train imports pandas,
# pyarrow, fsspec and requests at import). Both are pure CPU wheels; lightning reuses torch.
.venv/bin/python -c 'import importlib.util as u, sys
sys.exit(not (u.find_spec("lightning") and u.find_spec("ray") and u.find_spec("pyarrow")))' \
    2>/dev/null \
    || .venv/bin/pip install -q lightning==2.6.6 'ray[train]==2.60.0'
# the GPU check's offline wheels (.whl/, git-ignored, ~5 MB, a few seconds): its test then
# installs and runs scripts/gpu-check.sh on a bare python3 from them, as on a GPU node
[ -d .whl ] || sh scripts/gpu-check.sh --prepare >/dev/null \
    || echo "test.sh: gpu-check --prepare failed: its offline install test is skipped" >&2

echo "== ruff"; .venv/bin/ruff check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"; .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
