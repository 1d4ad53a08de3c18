"""Known ways a training process silently loses its CPU binding, as pure checks.

A process tunerd binds (or Slurm, or taskset) can lose that binding inside the
training script, without any error:

- ``KMP_AFFINITY``/``OMP_PROC_BIND``/``GOMP_CPU_AFFINITY`` plus ``import torch``:
  the OpenMP runtime binds the main thread to the first place of its list while
  torch loads, so the process mask shrinks to one CPU and every DataLoader worker
  forked later inherits that one CPU (pytorch#91989, same as #99625, #49971).
- ``OMP_NUM_THREADS`` (or ``MKL_NUM_THREADS``) larger than the CPUs the process
  was given: the intra-op pool oversubscribes them and every parallel op waits
  for threads that are not running (pytorch#82219).
- Intel OpenMP (libiomp5) resets a forked child's affinity on the child's first
  OpenMP call; NVIDIA's gpu_affinity notes advise ``KMP_AFFINITY=disabled`` so
  that DataLoader workers keep the binding.
- A mask set in a DataLoader ``worker_init_fn`` is undone by the first OpenMP
  call in the worker, such as ``torch.randperm`` in a sampler (pytorch#28389).

Everything here is a function of plain values (an environment mapping, CPU sets,
the text of /proc/PID/maps), so the daemon's ``doctor``/``advise`` can run it on
another process's /proc files and ``tunerd.torch`` on its own process. It never
imports torch and never reads the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from tunerd.diagnose.advise import Finding

__all__ = [
    "Finding",
    "check_environment",
    "check_workers",
    "intended_threads",
    "parse_thread_count",
    "uses_intel_openmp",
    "uses_torch",
]

ISSUE = "https://github.com/pytorch/pytorch/issues/"
NVIDIA_AFFINITY = ("https://github.com/NVIDIA/DeepLearningExamples (gpu_affinity.py: "
                   "Intel's OpenMP resets affinity after a fork; run with KMP_AFFINITY=disabled)")

# OMP_PROC_BIND values that bind threads (OpenMP 5.x spec, "OMP_PROC_BIND")
_BINDING_PROC_BIND = {"true", "close", "spread", "master", "primary"}
# KMP_AFFINITY types that bind (Intel OpenMP docs); "disabled" and "none" do not
_NON_BINDING_KMP = {"disabled", "none"}


def uses_torch(maps: str) -> bool:
    """Whether a process has torch loaded, from the text of its /proc/PID/maps."""
    return "libtorch_cpu.so" in maps or "libtorch.so" in maps


def uses_intel_openmp(maps: str) -> bool:
    """Whether a process has Intel's OpenMP runtime (or LLVM's libomp, which is built from
    the same sources and reads the same KMP_* variables) loaded, from /proc/PID/maps text.

    PyPI wheels of torch use GNU libgomp on Linux; conda/MKL builds bring libiomp5.
    """
    return "libiomp5" in maps or "/libomp.so" in maps


def parse_thread_count(value: str | None) -> int | None:
    """``OMP_NUM_THREADS``'s outer level: "8" -> 8, "8,2" -> 8; None if unset or bad."""
    if not value:
        return None
    head = value.split(",", 1)[0].strip()
    return int(head) if head.isdigit() and int(head) > 0 else None


def intended_threads(env: Mapping[str, str]) -> int | None:
    """The intra-op thread count the environment asks for (OMP first, then MKL)."""
    return parse_thread_count(env.get("OMP_NUM_THREADS")) or parse_thread_count(
        env.get("MKL_NUM_THREADS"))


def _kmp_binds(value: str) -> bool:
    # KMP_AFFINITY = [<modifier>,...]<type>[,<permute>][,<offset>]; modifiers such as
    # granularity=fine, verbose, respect come first, the type is the first bare word
    words = [w.strip().lower() for w in value.split(",") if w.strip()]
    for w in words:
        if "=" in w or w in {"verbose", "noverbose", "respect", "norespect", "warnings",
                             "nowarnings", "duplicates", "noduplicates"}:
            continue
        return w not in _NON_BINDING_KMP
    return False


def _binding_vars(env: Mapping[str, str], intel_openmp: bool | None) -> dict[str, str]:
    """The OpenMP binding variables in ``env`` that bind threads to places."""
    found: dict[str, str] = {}
    kmp = env.get("KMP_AFFINITY")
    # GNU libgomp ignores KMP_*: only Intel/LLVM OpenMP (or an unknown runtime) reads it
    if kmp and _kmp_binds(kmp) and intel_openmp is not False:
        found["KMP_AFFINITY"] = kmp
    bind = env.get("OMP_PROC_BIND")
    if bind and bind.split(",", 1)[0].strip().lower() in _BINDING_PROC_BIND:
        found["OMP_PROC_BIND"] = bind
    gomp = env.get("GOMP_CPU_AFFINITY")
    if gomp and gomp.strip():
        found["GOMP_CPU_AFFINITY"] = gomp
    return found


def check_environment(env: Mapping[str, str], allowed_cpus: int, *, torch: bool = True,
                      intel_openmp: bool | None = None) -> list[Finding]:
    """Findings for a training process with environment ``env`` that may run on
    ``allowed_cpus`` CPUs. ``torch``: it uses (or will import) torch; ``intel_openmp``:
    Intel/LLVM OpenMP is loaded (True), GNU libgomp is (False), not known yet (None).
    """
    out: list[Finding] = []
    binding = _binding_vars(env, intel_openmp)
    if torch and binding:
        names = " and ".join(f"{k}={v}" for k, v in binding.items())
        out.append(Finding(
            id="omp-binding-shrinks-mask",
            severity="warning",
            title="import torch pins the process to one CPU",
            evidence={**binding, "allowed_cpus": allowed_cpus},
            why=(f"With {names}, the OpenMP runtime binds the main thread to the first CPU "
                 "of its list while torch loads: the process keeps one CPU and every "
                 "DataLoader worker it forks inherits that CPU."),
            fix=("Unset " + ", ".join(binding) + " (tunerd already binds the process), or "
                 "import torch inside `with tunerd.torch.keep_affinity():`."),
            docs=[ISSUE + "91989", ISSUE + "99625", ISSUE + "49971"]))
    threads = intended_threads(env)
    if threads is not None and allowed_cpus > 0 and threads > allowed_cpus:
        var = "OMP_NUM_THREADS" if parse_thread_count(env.get("OMP_NUM_THREADS")) else \
            "MKL_NUM_THREADS"
        out.append(Finding(
            id="omp-threads-oversubscribe",
            severity="warning",
            title=f"{var}={threads} but the process may use {allowed_cpus} CPU(s)",
            evidence={var: env.get(var), "allowed_cpus": allowed_cpus},
            why=(f"{threads} intra-op threads share {allowed_cpus} CPU(s): each parallel op "
                 "waits for threads that are not running."),
            fix=(f"Set {var} to at most {allowed_cpus} (tunerctl run sets it to the "
                 "lease's CPUs per GPU); tunerd.torch lowers torch's thread count itself."),
            docs=[ISSUE + "82219"]))
    kmp = env.get("KMP_AFFINITY", "")
    if intel_openmp is True and kmp.strip().lower() != "disabled":
        out.append(Finding(
            id="intel-openmp-fork-reset",
            severity="warning",
            title="Intel OpenMP resets the affinity of forked DataLoader workers",
            evidence={"KMP_AFFINITY": kmp or None, "openmp": "libiomp5"},
            why=("Intel's OpenMP runtime resets a forked child's CPU mask on the child's "
                 "first OpenMP call, so DataLoader workers run outside the job's CPUs."),
            fix="Start the job with KMP_AFFINITY=disabled (tunerd's binding stays in force).",
            docs=[NVIDIA_AFFINITY]))
    return out


def check_workers(parent_cpus: Set[int], workers: Mapping[int, Set[int]], *,
                  intel_openmp: bool = False) -> list[Finding]:
    """Findings for DataLoader workers (pid -> CPU set) of a process on ``parent_cpus``.

    A forked worker starts with its parent's mask; one that runs outside it lost the
    binding after the fork (Intel OpenMP's reset, or a mask a ``worker_init_fn`` set
    and the first OpenMP call in the worker undid).
    """
    escaped = {pid: sorted(cpus) for pid, cpus in sorted(workers.items())
               if cpus and not set(cpus) <= set(parent_cpus)}
    if not escaped:
        return []
    cause = ("Intel OpenMP resets a forked worker's mask on its first OpenMP call"
             if intel_openmp else
             "something in the worker (an OpenMP runtime, a library, the dataset code) "
             "changed its mask after the fork")
    return [Finding(
        id="worker-affinity-lost",
        severity="warning",
        title=f"{len(escaped)} DataLoader worker(s) run outside the job's CPUs",
        evidence={"parent_cpus": sorted(parent_cpus), "workers": escaped},
        why=(cause + "; torch.randperm in a sampler is the usual first call "
             "(pytorch#28389), so a mask set in worker_init_fn is lost too."),
        fix=("Use tunerd.torch.worker_init_fn (it initialises OpenMP before pinning and "
             "checks the mask afterwards) and start the job with KMP_AFFINITY=disabled."),
        docs=[ISSUE + "28389", NVIDIA_AFFINITY])]
