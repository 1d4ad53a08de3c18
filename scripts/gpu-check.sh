#!/bin/sh
# The tunerd GPU check: every GPU path on a real GPU node in one short run, offline.
#
#   scripts/gpu-check.sh --prepare      here, with network: download the wheels the
#                                       check installs from into .whl/ (git-ignored)
#   scripts/gpu-check.sh [ARGS]         on the GPU node: install, then run
#                                       bench/gpu_check.py ARGS (--quick, --no-bench,
#                                       --out DIR, --budget S); the report goes to
#                                       --out, $OUT when set, else a folder it names
#   scripts/gpu-check.sh --no-install [ARGS]   run with $PYTHON as it is (the suite)
#
# Install: a venv in $GPU_CHECK_VENV (default /tmp/tunerd-gpu-check-venv) made with
# the machine's own python3 ($PYTHON), the project installed from this folder with
# pip --no-index from .whl/ only. torch is NOT carried: the venv gets a .pth file
# naming python3's own site-packages, so the image's torch (and its CUDA, cuDNN and
# NCCL libraries) is the one imported, the same as `python3 -c 'import torch'` there.
# That works whether python3 is a system python or itself a venv (--system-site-packages
# alone would skip a venv's packages). Exit: bench/gpu_check.py's (0: no step failed).
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=.whl
VENV=${GPU_CHECK_VENV:-/tmp/tunerd-gpu-check-venv}
# runtime dependencies (pyproject.toml) and the build backend, all pure Python: one
# set of wheels fits every CPython >= 3.10 on any platform, about 5 MB in all
RUNTIME_WHEELS="click>=8.1 nvidia-ml-py>=12.535 pyudev>=0.24 prometheus_client>=0.17
rich>=13 markdown-it-py mdurl pygments setuptools>=77 wheel"

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2086
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --dest "$WHEELS" $RUNTIME_WHEELS
    ls -l "$WHEELS"
    du -sh "$WHEELS"
    echo "prepared: carry $WHEELS with the working tree (64 MiB limit)"
    exit 0
fi

if [ "${1:-}" = "--no-install" ]; then
    shift
    exec "$PYTHON" bench/gpu_check.py "$@"
fi

[ -d "$WHEELS" ] || { echo "gpu-check: no $WHEELS/ here: run scripts/gpu-check.sh --prepare" \
    "where there is network, and carry $WHEELS along" >&2; exit 2; }
t0=$(date +%s)
pip="$VENV/bin/python -m pip"
if [ ! -x "$VENV/bin/python" ]; then
    if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
        # no ensurepip in this python: a venv without pip, filled by python3's own pip
        rm -rf "$VENV"
        "$PYTHON" -m venv --without-pip "$VENV"
    fi
fi
"$VENV/bin/python" -m pip --version >/dev/null 2>&1 || pip="$PYTHON -m pip --python $VENV/bin/python"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
    > "$site/zz-gpu-check-image-site.pth"
export PIP_DISABLE_PIP_VERSION_CHECK=1
$pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl
$pip install -q --no-index --no-deps --no-build-isolation .
echo "gpu-check: installed tunerd into $VENV in $(( $(date +%s) - t0 )) s" \
    "(torch from $("$VENV/bin/python" -c 'import torch, os; print(os.path.dirname(torch.__file__))' \
    2>/dev/null || echo 'nowhere: no torch in python3')"
exec "$VENV/bin/python" bench/gpu_check.py "$@"
