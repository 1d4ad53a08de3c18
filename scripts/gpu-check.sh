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
# pip --no-index from .whl/ only, its runtime dependencies resolved from pyproject.toml
# (a dependency missing from .whl/ stops the install, naming it). Nothing is needed on
# the machine but python3: no pip, no ensurepip (pip runs from its carried wheel).
# torch is NOT carried: the venv gets a .pth file
# naming python3's own site-packages, so the image's torch (and its CUDA, cuDNN and
# NCCL libraries) is the one imported, the same as `python3 -c 'import torch'` there.
# That works whether python3 is a system python or itself a venv (--system-site-packages
# alone would skip a venv's packages). Without torch the training step is skipped.
# Exit: bench/gpu_check.py's (0: no step failed).
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=.whl
VENV=${GPU_CHECK_VENV:-/tmp/tunerd-gpu-check-venv}
# runtime dependencies (pyproject.toml, and theirs), the build backend (setuptools >= 70
# builds wheels itself: no `wheel`) and pip itself:
# pure Python, one set of wheels fits every CPython >= 3.10 on any platform. tomli and
# typing_extensions are what python 3.10 needs besides. tests/test_gpu_check.py checks
# that these cover pyproject.toml's dependencies.
RUNTIME_WHEELS="click>=8.1 nvidia-ml-py>=12.535 pyudev>=0.24 prometheus_client>=0.17
rich>=13 markdown-it-py mdurl pygments inotify_simple>=1.3 typing_extensions
setuptools>=77 pip"
# ... and the ones with compiled code: stable-ABI (abi3) wheels, one per machine kind
# tomli (python 3.10 only) in its pure-Python wheel, not this machine's compiled one
PURE_WHEELS="tomli>=2.0"
PLATFORM_WHEELS="psutil>=5.9"
PLATFORMS="x86_64 aarch64"

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2086
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --dest "$WHEELS" $RUNTIME_WHEELS
    # shellcheck disable=SC2086
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --implementation py \
        --python-version 3.10 --platform any --dest "$WHEELS" $PURE_WHEELS
    for arch in $PLATFORMS; do
        # shellcheck disable=SC2086
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
            --python-version 3.10 --platform "manylinux2014_$arch" \
            --platform "manylinux_2_28_$arch" --dest "$WHEELS" $PLATFORM_WHEELS
    done
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
# pyproject.toml's build backend requirement (setuptools>=N): read, not repeated here
build_backend() {
    sed -n 's/^requires = \[.*"\(setuptools[^"]*\)".*/\1/p' pyproject.toml
}
t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    # --without-pip: a python3 without ensurepip (Debian's without python3-venv) makes it too
    "$PYTHON" -m venv --without-pip "$VENV"
fi
# pip from its carried wheel (python runs a wheel's pip package as it is): no pip needed
# in python3, and the same pip everywhere
pip_whl=$(ls "$WHEELS"/pip-*.whl 2>/dev/null | tail -n 1)
[ -n "$pip_whl" ] || { echo "gpu-check: no pip wheel in $WHEELS/: run scripts/gpu-check.sh" \
    "--prepare again" >&2; exit 2; }
pip="$VENV/bin/python $pip_whl/pip"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
    > "$site/zz-gpu-check-image-site.pth"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/$WHEELS"
# the build backend pyproject.toml asks for, from .whl/: a bare `setuptools` would be
# satisfied by an older one that python3's own site-packages carries (the venv sees it
# through the .pth: setuptools 65 on Debian 12 and many GPU images), which rejects
# pyproject's PEP 639 `license = "Apache-2.0"`; the venv's own copy comes first
$pip install -q --no-compile "$(build_backend)"
# the project with its runtime dependencies as pyproject.toml names them, from .whl/ only
$pip install -q --no-compile --no-build-isolation .
echo "gpu-check: installed tunerd into $VENV in $(( $(date +%s) - t0 )) s" \
    "(torch from $("$VENV/bin/python" -c 'import torch, os; print(os.path.dirname(torch.__file__))' \
    2>/dev/null || echo 'nowhere: no torch in python3'))"
exec "$VENV/bin/python" bench/gpu_check.py "$@"
