"""tunerd.diagnose.training_env: the known ways a binding is silently lost (pure checks), and the
one of them this machine's torch build really shows (pytorch#91989)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tunerd.diagnose.training_env import (
    check_environment,
    check_workers,
    intended_threads,
    parse_thread_count,
    uses_intel_openmp,
    uses_torch,
)

# lines as they appear in /proc/PID/maps of a process with the PyPI wheel / a conda build
MAPS_PYPI = ("7f1c2a000000-7f1c2a400000 r-xp 00000000 08:01 123 "
             "/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so\n"
             "7f1c29000000-7f1c29100000 r-xp 00000000 08:01 124 "
             "/venv/lib/python3.11/site-packages/torch/lib/libgomp-a34b3233.so.1\n")
MAPS_CONDA = ("7f1c2a000000-7f1c2a400000 r-xp 00000000 08:01 123 "
              "/opt/conda/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so\n"
              "7f1c29000000-7f1c29100000 r-xp 00000000 08:01 125 /opt/conda/lib/libiomp5.so\n")


def ids(findings: list) -> set[str]:
    return {f.id for f in findings}


def test_maps_tell_torch_and_the_openmp_runtime() -> None:
    assert uses_torch(MAPS_PYPI) and uses_torch(MAPS_CONDA)
    assert not uses_torch("7f00-7f01 r-xp 0 0:0 0 /usr/lib/libc.so.6\n")
    assert not uses_intel_openmp(MAPS_PYPI)
    assert uses_intel_openmp(MAPS_CONDA)
    assert uses_intel_openmp("7f00-7f01 r-xp 0 0:0 0 /opt/conda/lib/libomp.so\n")


def test_binding_variables_plus_torch_shrink_the_mask() -> None:
    f = check_environment({"OMP_PROC_BIND": "close"}, 8)
    assert ids(f) == {"omp-binding-shrinks-mask"}
    assert f[0].evidence == {"OMP_PROC_BIND": "close", "allowed_cpus": 8}
    assert "91989" in " ".join(f[0].docs) and "keep_affinity" in f[0].fix
    assert ids(check_environment({"OMP_PROC_BIND": "spread,close"}, 8)) == {
        "omp-binding-shrinks-mask"}
    assert ids(check_environment({"GOMP_CPU_AFFINITY": "0-7"}, 8)) == {
        "omp-binding-shrinks-mask"}
    # not binding, or no torch: nothing
    assert check_environment({"OMP_PROC_BIND": "false"}, 8) == []
    assert check_environment({"OMP_PROC_BIND": "close"}, 8, torch=False) == []


def test_kmp_affinity_counts_only_where_an_intel_runtime_reads_it() -> None:
    env = {"KMP_AFFINITY": "granularity=fine,compact,1,0"}
    assert ids(check_environment(env, 8, intel_openmp=None)) == {"omp-binding-shrinks-mask"}
    # GNU libgomp (PyPI wheels) ignores KMP_*
    assert check_environment(env, 8, intel_openmp=False) == []
    assert ids(check_environment(env, 8, intel_openmp=True)) == {
        "omp-binding-shrinks-mask", "intel-openmp-fork-reset"}
    for harmless in ("disabled", "none", "verbose,none", "granularity=fine,none"):
        assert check_environment({"KMP_AFFINITY": harmless}, 8, intel_openmp=None) == []


def test_more_threads_than_cpus_is_oversubscription() -> None:
    f = check_environment({"OMP_NUM_THREADS": "16"}, 4)
    assert ids(f) == {"omp-threads-oversubscribe"}
    assert "OMP_NUM_THREADS=16" in f[0].title and "82219" in f[0].docs[0]
    assert check_environment({"OMP_NUM_THREADS": "4"}, 4) == []
    assert ids(check_environment({"OMP_NUM_THREADS": "8,2"}, 4)) == {"omp-threads-oversubscribe"}
    assert ids(check_environment({"MKL_NUM_THREADS": "8"}, 4)) == {"omp-threads-oversubscribe"}
    assert check_environment({"OMP_NUM_THREADS": "many"}, 4) == []
    assert parse_thread_count("8, 2") == 8 and parse_thread_count("0") is None
    assert intended_threads({"MKL_NUM_THREADS": "3"}) == 3


def test_intel_openmp_without_kmp_disabled_loses_worker_binding() -> None:
    f = check_environment({}, 8, intel_openmp=True)
    assert ids(f) == {"intel-openmp-fork-reset"}
    assert "KMP_AFFINITY=disabled" in f[0].fix
    assert check_environment({"KMP_AFFINITY": "disabled"}, 8, intel_openmp=True) == []
    assert check_environment({}, 8, intel_openmp=False) == []


def test_workers_outside_the_parent_cpus_are_reported() -> None:
    assert check_workers({2, 3}, {101: {3}, 102: {2}}) == []
    f = check_workers({2, 3}, {101: {3}, 102: set(range(8))}, intel_openmp=True)
    assert ids(f) == {"worker-affinity-lost"}
    assert f[0].evidence == {"parent_cpus": [2, 3], "workers": {102: list(range(8))}}
    assert "28389" in " ".join(f[0].docs) and "Intel OpenMP" in f[0].why
    assert json.dumps(f[0].to_dict())  # doctor/advise show it as JSON


MASK_AFTER_IMPORT = """
import os, sys
sys.path.insert(0, {repo!r})
before = sorted(os.sched_getaffinity(0))
if sys.argv[1] == "keep":
    import tunerd.torch
    with tunerd.torch.keep_affinity():
        import torch
else:
    import torch
print(before, sorted(os.sched_getaffinity(0)))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_omp_proc_bind_really_shrinks_the_mask_and_keep_affinity_survives_it() -> None:
    """pytorch#91989 on this machine's torch (GNU OpenMP), and the helper's way around it."""
    code = MASK_AFTER_IMPORT.format(repo=str(REPO))
    env = {**os.environ, "OMP_PROC_BIND": "close"}
    # the two interpreters at once (each only reads and sets its own mask): one torch
    # import's time instead of two
    procs = {how: subprocess.Popen([sys.executable, "-c", code, how], env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for how in ("plain", "keep")}
    out = {how: p.communicate(timeout=120) for how, p in procs.items()}
    for how, p in procs.items():
        assert p.returncode == 0, (how, out[how])
    plain = out["plain"][0]
    before, after = (json.loads(part + "]") for part in plain.strip()[:-1].split("] "))
    assert len(before) >= 2 and after == before[:1], plain  # the finding is real here
    kept_out, kept_err = out["keep"]
    before, after = (json.loads(part + "]") for part in kept_out.strip()[:-1].split("] "))
    assert after == before, kept_out
    assert "pytorch#91989" in kept_err
