"""`tunerctl doctor`: the environment self-check the PyTorch tuning guides ask for.

Runs locally (no daemon). Every check returns PASS, WARN, FAIL or SKIP with the
evidence it saw and the fix. It never imports torch itself: torch is probed in
a subprocess with a timeout, so a broken CUDA install cannot hang or crash it.
Roots (/proc, /sys, /etc), the environment and the Python to probe are
arguments, so each check is tested on a temporary tree.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tunerd.adapters import isolated, nvml
from tunerd.adapters.procfs import read_text, read_value
from tunerd.base.text import plural
from tunerd.tuners.nccl import match_ifnames

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
NOFILE_MIN = 65536
JUMBO_MTU = 9000
TORCH_TIMEOUT = 60.0
GOOD_FS = ("xfs", "ext4")
NVIDIA_VENDOR = "0x10de"

# the daemon's config file (tunerd.daemon.config.DEFAULT_CONFIG; doctor runs in tunerctl,
# which may not import tunerd.daemon: tests/test_layering.py)
DEFAULT_CONFIG = Path("/etc/tunerd/tunerd.toml")

# Printed as JSON by the probe subprocess; every value guarded, never raises.
TORCH_PROBE = r"""
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
except Exception as e:
    out["import_error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out)); sys.exit(0)
out["version"] = torch.__version__
out["cuda_build"] = torch.version.cuda
try:
    out["cuda_available"] = bool(torch.cuda.is_available())
    out["device_count"] = torch.cuda.device_count() if out["cuda_available"] else 0
    out["devices"] = [torch.cuda.get_device_name(i) for i in range(out["device_count"])]
except Exception as e:
    out["cuda_error"] = f"{type(e).__name__}: {e}"
try:
    out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
except Exception as e:
    out["cudnn_error"] = f"{type(e).__name__}: {e}"
try:
    v = torch.cuda.nccl.version()
    out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else v
except Exception as e:
    out["nccl_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@dataclass
class Check:
    id: str
    title: str
    status: str
    evidence: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrainingPython:
    """The interpreter training jobs use, and how doctor found it."""

    path: str | None  # None: none found
    how: str  # "--python", "python3 on PATH", "job_python in FILE"
    notes: list[str] = field(default_factory=list)  # what was looked at and passed over


def _python_on_path(environ: Mapping[str, str], own_prefix: str) -> tuple[str | None, list[str]]:
    """The first ``python3`` on PATH that is not tunerd's own venv (it has no torch)."""
    notes: list[str] = []
    own = os.path.realpath(own_prefix)
    for d in environ.get("PATH", "").split(os.pathsep):
        if not d:
            continue
        cand = os.path.join(d, "python3")
        if not (os.path.isfile(cand) and os.access(cand, os.X_OK)):
            continue
        real_dir = os.path.realpath(d)
        if real_dir == own or real_dir.startswith(own.rstrip("/") + "/"):
            notes.append(f"passed over {cand}: tunerd's own venv ({own_prefix})")
            continue
        return cand, notes
    return None, notes


def _configured_python(config: Path) -> tuple[str | None, str]:
    """``job_python`` from the daemon's config file; (None, why) when absent or unreadable."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        data = tomllib.loads(config.read_text())
    except FileNotFoundError:
        return None, f"no {config}"
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        return None, f"cannot read {config}: {getattr(err, 'strerror', None) or err}"
    value = data.get("job_python")
    if value is None:
        return None, f"no job_python in {config}"
    if not isinstance(value, str) or not value:
        return None, f"{config}: job_python must be a path, got {value!r}"
    if not os.path.isabs(value):  # as the daemon's config check: never relative to the cwd
        return None, f"{config}: job_python must be an absolute path, got {value!r}"
    return value, ""


def find_training_python(explicit: str | None, environ: Mapping[str, str],
                         config: Path | None = None,
                         own_prefix: str = sys.prefix) -> TrainingPython:
    """--python, else python3 on the caller's PATH (not tunerd's venv), else job_python."""
    if explicit:
        found = explicit if os.sep in explicit else shutil.which(
            explicit, path=environ.get("PATH", os.defpath))
        return TrainingPython(found or explicit, "--python")
    path, notes = _python_on_path(environ, own_prefix)
    if path is not None:
        return TrainingPython(path, "python3 on PATH", notes)
    notes.append("no python3 on PATH" + (" besides tunerd's own" if notes else ""))
    cfg = config or DEFAULT_CONFIG
    configured, why = _configured_python(cfg)
    if configured is not None:
        return TrainingPython(configured, f"job_python in {cfg}", notes)
    notes.append(why)
    return TrainingPython(None, "", notes)


@dataclass
class Env:
    """Where the checks look: real roots by default, temporary trees in tests."""

    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")
    etc_root: Path = Path("/etc")
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    # the training Python whose torch is checked (find_training_python); None: not found
    python: str | None = None
    python_how: str = "given"
    python_notes: list[str] = field(default_factory=list)
    data_dir: Path = field(default_factory=Path.cwd)
    torch_timeout: float = TORCH_TIMEOUT
    # the node's topology for the GPU/NIC path checks (None: read this machine's)
    topology: Any = None
    _torch: dict[str, Any] | None = None

    def which(self, name: str) -> str | None:
        return shutil.which(name, path=self.environ.get("PATH", os.defpath))

    def torch(self) -> dict[str, Any]:
        """Torch facts from a subprocess (run once); {"skip"/"fail": reason} when absent."""
        if self._torch is None:
            if self.python is None:
                self._torch = {"skip": "no training Python found ("
                               + "; ".join(self.python_notes) + "); pass --python PATH"}
            else:
                self._torch = probe_torch(self.python, self.torch_timeout, self.environ)
        return self._torch


def probe_torch(python: str, timeout: float, environ: Mapping[str, str]) -> dict[str, Any]:
    try:
        # isolated (tunerd.adapters.isolated): a json.py or torch.py in the caller's directory
        # must not run, as root, in place of the real ones
        p = subprocess.run(isolated.python_argv(python, "-c", TORCH_PROBE),
                           capture_output=True, text=True, timeout=timeout,
                           env=isolated.scrubbed(environ), cwd=isolated.CWD)
    except subprocess.TimeoutExpired:
        return {"fail": f"`{python} -c 'import torch'` did not finish in {timeout:g} s"}
    except OSError as err:
        return {"skip": f"cannot run {python}: {err.strerror or err}"}
    last = (p.stdout.strip().splitlines() or [""])[-1]
    try:
        data: dict[str, Any] = json.loads(last)
    except ValueError:
        return {"fail": f"torch probe exited {p.returncode}: {p.stderr.strip()[-300:]}"}
    if "import_error" in data:
        why = str(data["import_error"])
        if why.startswith("ModuleNotFoundError") and "'torch'" in why:
            return {"skip": f"torch is not installed for {python}", "python": data.get("python")}
        return {"fail": f"import torch failed for {python}: {why}", "python": data.get("python")}
    return data


def check_python(env: Env) -> Check:
    """Which interpreter the torch checks ran against, and how it was found."""
    title = "Training Python"
    notes = "; ".join(env.python_notes)
    if env.python is None:
        return Check("training-python", title, SKIP,
                     f"no training Python found: {notes}",
                     data={"python": None, "found_by": None, "notes": env.python_notes})
    data = {"python": env.python, "found_by": env.python_how, "notes": env.python_notes}
    t = env.torch()
    if "skip" in t and t["skip"].startswith("cannot run"):
        status = FAIL if env.python_how == "--python" else WARN
        return Check("training-python", title, status, f"{env.python} ({env.python_how}): "
                     f"{t['skip'].removeprefix('cannot run ' + env.python + ': ')}",
                     "Pass the interpreter your jobs use: tunerctl doctor --python PATH "
                     "(or set job_python in /etc/tunerd/tunerd.toml).", data=data)
    version = t.get("python")
    return Check("training-python", title, PASS,
                 f"checked {env.python}" + (f" (Python {version})" if version else "")
                 + f", found by {env.python_how}" + (f"; {notes}" if notes else ""),
                 data={**data, "version": version})



def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# -- GPU stack -----------------------------------------------------------------
def nvidia_pci_devices(env: Env) -> list[str]:
    base = env.sys_root / "bus/pci/devices"
    out: list[str] = []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return out
    for bdf in names:
        cls = read_value(base / bdf / "class") or ""
        if read_value(base / bdf / "vendor") == NVIDIA_VENDOR and cls[:4] in ("0x03", "0x12"):
            out.append(bdf)
    return out


def check_driver(env: Env) -> Check:
    if nvml.available():
        drv, lib = nvml.driver_version(), nvml.nvml_version()
        drv_s, lib_s = (_text(v) if v is not nvml.NA else "?" for v in (drv, lib))
        cuda = nvml.cuda_driver_version()
        n = nvml.device_count()
        return Check("nvidia-driver", "NVIDIA driver and NVML", PASS,
                     f"driver {drv_s}, NVML {lib_s}, CUDA driver API {fmt_cuda(cuda)}, "
                     f"{plural(n, 'GPU')}",
                     data={"driver": drv_s, "nvml": lib_s, "cuda_driver": fmt_cuda(cuda),
                           "gpus": n})
    devs = nvidia_pci_devices(env)
    if devs:
        return Check("nvidia-driver", "NVIDIA driver and NVML", FAIL,
                     f"{plural(len(devs), 'NVIDIA PCI device')} ({', '.join(devs[:4])}) but "
                     f"{nvml.reason()}",
                     "Install/load the NVIDIA driver matching your CUDA (nvidia-smi must work).")
    return Check("nvidia-driver", "NVIDIA driver and NVML", SKIP,
                 f"no NVIDIA GPU on this node: {nvml.reason()}")


def fmt_cuda(v: Any) -> str:
    """NVML's 12040 -> "12.4"."""
    if not isinstance(v, int):
        return "?"
    return f"{v // 1000}.{(v % 1000) // 10}"


def check_nvcc(env: Env) -> Check:
    nvcc = env.which("nvcc")
    if nvcc is None:
        for cand in (Path("/usr/local/cuda/bin/nvcc"),):
            if cand.exists():
                return Check("cuda-toolkit", "CUDA toolkit on PATH", WARN,
                             f"{cand} exists but nvcc is not on PATH",
                             "export PATH=/usr/local/cuda/bin:$PATH (needed to build CUDA "
                             "extensions; pip torch wheels carry their own runtime)")
        return Check("cuda-toolkit", "CUDA toolkit on PATH", SKIP,
                     "nvcc not found; pip/conda torch wheels bundle the CUDA runtime, the "
                     "toolkit is only needed to compile CUDA extensions")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=20, cwd=isolated.CWD, env=isolated.scrubbed()).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return Check("cuda-toolkit", "CUDA toolkit on PATH", FAIL, f"{nvcc} --version: {err}",
                     "Reinstall the CUDA toolkit.")
    m = re.search(r"release ([\d.]+)", out)
    return Check("cuda-toolkit", "CUDA toolkit on PATH", PASS,
                 f"{nvcc}: CUDA {m.group(1) if m else 'unknown version'}",
                 data={"nvcc": nvcc, "version": m.group(1) if m else None})


def check_libcudart(env: Env) -> Check:
    dirs = [d for d in env.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for d in dirs:
        try:
            hits = sorted(n for n in os.listdir(d) if n.startswith("libcudart.so"))
        except OSError:
            continue
        if hits:
            return Check("libcudart", "CUDA runtime on LD_LIBRARY_PATH", PASS,
                         f"{d}/{hits[0]}")
    if env.which("nvcc"):
        return Check("libcudart", "CUDA runtime on LD_LIBRARY_PATH", WARN,
                     "nvcc is installed but no libcudart.so in "
                     f"LD_LIBRARY_PATH={':'.join(dirs) or '(unset)'}",
                     "export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH")
    return Check("libcudart", "CUDA runtime on LD_LIBRARY_PATH", SKIP,
                 "no CUDA toolkit; torch wheels load their bundled libcudart")


def check_torch(env: Env) -> list[Check]:
    t = env.torch()
    if "skip" in t:
        reason = t["skip"] + (f" ({env.python_how})" if env.python else "")
        return [Check(i, title, SKIP, reason) for i, title in (
            ("torch", "PyTorch imports"), ("torch-cuda", "torch.cuda is available"),
            ("cuda-version", "torch CUDA vs driver CUDA"), ("cudnn", "cuDNN version"),
            ("nccl", "NCCL version"))]
    if "fail" in t:
        return [Check("torch", "PyTorch imports", FAIL, t["fail"] + f" ({env.python_how})",
                      "Reinstall torch matching your CUDA driver (pip install torch "
                      "--index-url https://download.pytorch.org/whl/cuXYZ).")]
    out = [Check("torch", "PyTorch imports", PASS,
                 f"torch {t['version']} (CUDA build {t.get('cuda_build') or 'none: CPU-only'}) "
                 f"in {env.python}", data=t)]
    gpu_node = nvml.available()
    if t.get("cuda_available"):
        out.append(Check("torch-cuda", "torch.cuda is available", PASS,
                         f"{plural(t['device_count'], 'device')}: "
                         f"{', '.join(t.get('devices') or [])}"))
    elif gpu_node:
        out.append(Check("torch-cuda", "torch.cuda is available", FAIL,
                         f"NVML sees GPUs but torch.cuda.is_available() is False "
                         f"({t.get('cuda_error') or 'CUDA build ' + str(t.get('cuda_build'))})",
                         "Install a CUDA build of torch that the driver supports; check "
                         "CUDA_VISIBLE_DEVICES and /dev/nvidia* permissions."))
    else:
        out.append(Check("torch-cuda", "torch.cuda is available", SKIP,
                         "no GPU on this node (torch.cuda.is_available() is False)"))
    out.append(check_cuda_versions(t.get("cuda_build"), nvml.cuda_driver_version()))
    if t.get("cudnn"):
        out.append(Check("cudnn", "cuDNN version", PASS, f"cuDNN {t['cudnn']}"))
    else:
        out.append(Check("cudnn", "cuDNN version", SKIP if not t.get("cuda_build") else WARN,
                         t.get("cudnn_error") or "torch.backends.cudnn is not available",
                         "" if not t.get("cuda_build") else "Install the cuDNN build of torch."))
    if t.get("nccl"):
        out.append(Check("nccl", "NCCL version", PASS, f"NCCL {t['nccl']}"))
    else:
        why = t.get("nccl_error")
        out.append(Check("nccl", "NCCL version", SKIP,
                         "torch was built without NCCL" + (f" ({why})" if why else "")))
    return out


def check_cuda_versions(torch_cuda: str | None, driver_cuda: Any) -> Check:
    title = "torch CUDA vs driver CUDA"
    if not torch_cuda:
        return Check("cuda-version", title, SKIP, "CPU-only torch build")
    if not isinstance(driver_cuda, int):
        return Check("cuda-version", title, SKIP,
                     f"torch built for CUDA {torch_cuda}; no driver to compare with")
    t_major, t_minor = (int(x) for x in torch_cuda.split(".")[:2])
    d_major, d_minor = driver_cuda // 1000, (driver_cuda % 1000) // 10
    ev = f"torch built for CUDA {torch_cuda}; driver supports up to {d_major}.{d_minor}"
    if (t_major, t_minor) <= (d_major, d_minor):
        return Check("cuda-version", title, PASS, ev)
    if t_major == d_major:  # CUDA minor-version compatibility: runs, PTX JIT may not
        return Check("cuda-version", title, WARN, ev,
                     "Works through minor-version compatibility, but kernels needing PTX "
                     "JIT fail; upgrade the driver.")
    return Check("cuda-version", title, FAIL, ev,
                 f"Upgrade the driver to one supporting CUDA {t_major}.{t_minor}, or install "
                 f"a torch built for CUDA {d_major}.x.")


# -- PCIe / IOMMU --------------------------------------------------------------
def pci_bridges(env: Env) -> list[str]:
    base = env.sys_root / "bus/pci/devices"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    return [b for b in names if (read_value(base / b / "class") or "").startswith("0x0604")]


def acs_source_validation(setpci_out: str) -> bool | None:
    """ACS Control register (``setpci -s BDF ECAP_ACS+6.w``): bit 0 = Source Validation.

    None when the output is not a register value (no ACS capability, not root).
    """
    val = setpci_out.strip()
    if not re.fullmatch(r"[0-9a-fA-F]{4}", val):
        return None
    return bool(int(val, 16) & 0x1)


def acs_from_lspci(text: str) -> bool | None:
    """``lspci -vvv`` prints ``ACSCtl: SrcValid+ TransBlk- ...`` for a bridge with ACS."""
    m = re.search(r"ACSCtl:\s*SrcValid([+-])", text)
    return None if m is None else m.group(1) == "+"


def read_acs(bdf: str, setpci: str | None, lspci: str | None) -> tuple[bool | None, str]:
    """(Source Validation on?, evidence): the register via setpci, else lspci's decoding."""
    cmds: list[tuple[list[str], Callable[[str], bool | None]]] = []
    if setpci:
        cmds.append(([setpci, "-s", bdf, "ECAP_ACS+6.w"], acs_source_validation))
    if lspci:
        cmds.append(([lspci, "-vvv", "-s", bdf], acs_from_lspci))
    for argv, decode in cmds:
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=5,
                               cwd=isolated.CWD, env=isolated.scrubbed())
        except (OSError, subprocess.TimeoutExpired):
            continue
        sv = decode(p.stdout) if p.returncode == 0 else None
        if sv is not None:
            what = (f"ACS ctl {p.stdout.strip()}" if decode is acs_source_validation
                    else "lspci ACSCtl SrcValid+" if sv else "lspci ACSCtl SrcValid-")
            return sv, what
    return None, "unreadable"


def check_acs(env: Env) -> Check:
    title = "PCIe ACS on bridges (NCCL P2P)"
    bridges = pci_bridges(env)
    if not bridges:
        return Check("pcie-acs", title, SKIP, "no PCI-to-PCI bridges on this node")
    setpci, lspci = env.which("setpci"), env.which("lspci")
    if setpci is None and lspci is None:
        return Check("pcie-acs", title, SKIP, "setpci/lspci not found (apt-get install pciutils)")
    enabled: list[str] = []
    unreadable = 0
    for bdf in bridges:
        sv, how = read_acs(bdf, setpci, lspci)
        if sv is None:
            unreadable += 1  # no ACS capability on this bridge, or not root
        elif sv:  # Source Validation on: peer-to-peer traffic is sent up to the root port
            enabled.append(f"{bdf} ({how})")
    if enabled:
        return Check("pcie-acs", title, WARN,
                     f"ACS enabled on {plural(len(enabled), 'bridge')}: {', '.join(enabled[:6])}",
                     "ACS redirects GPU peer-to-peer traffic through the root complex (slow "
                     "NCCL P2P, hangs). On bare metal: setpci -s BDF ECAP_ACS+6.w=0000 at "
                     "boot (not with VMs that need IOMMU isolation).",
                     data={"enabled": enabled})
    return Check("pcie-acs", title, PASS,
                 f"ACS source validation off on {plural(len(bridges) - unreadable, 'bridge')}; "
                 f"{unreadable} without ACS capability or unreadable")


def check_iommu(env: Env) -> Check:
    title = "IOMMU mode"
    try:
        units = os.listdir(env.sys_root / "class/iommu")
    except OSError:
        units = []
    cmdline = read_value(env.proc_root / "cmdline") or ""
    args = cmdline.split()
    if not units:
        return Check("iommu", title, PASS, "no IOMMU active (DMA is not translated)")
    if "iommu=pt" in args or "iommu.passthrough=1" in args:
        return Check("iommu", title, PASS,
                     f"{plural(len(units), 'IOMMU unit')}, passthrough (iommu=pt)")
    return Check("iommu", title, WARN,
                 f"{plural(len(units), 'IOMMU unit')} translating DMA; kernel cmdline has no "
                 "iommu=pt",
                 "Add iommu=pt (with intel_iommu=on / amd_iommu=on) to the kernel command "
                 "line so GPU and NIC DMA (GPUDirect RDMA, NCCL) skips translation.")


def _speed(text: str | None) -> float | None:
    m = re.match(r"\s*([\d.]+)", text or "")
    return float(m.group(1)) if m else None


def check_io_paths(env: Env) -> list[Check]:
    """Per GPU and its NIC (tunerd.topology.iopath): ACS source validation on a bridge
    between them, their NUMA nodes, IOMMU translation, relaxed ordering on the NIC,
    links below their width or generation."""
    from tunerd.topology.iopath import gpu_nics
    from tunerd.topology.pcicfg import read_function

    topo = env.topology
    if topo is None:
        try:
            from tunerd.topology import read_system

            topo = read_system(env.sys_root, env.proc_root)
        except Exception as err:
            return [Check("io-path", "GPU/NIC I/O path", SKIP, f"no topology: {err}")]
    pairs = gpu_nics(topo)
    if not any(pairs.values()):
        return [Check("io-path", "GPU/NIC I/O path", SKIP,
                      "no GPU with a fabric NIC on this node")]
    acs: list[str] = []
    far: list[str] = []
    iommu: list[str] = []
    ro: list[str] = []
    links: list[str] = []
    slow: list[str] = []
    seen: set[str] = set()
    data: dict[str, Any] = {}
    for g in topo.gpus:
        for p in pairs.get(g.index, ()):
            n = p.nic
            start = max(len(p.shared_path) - 1, 1)
            between = [b for b in (*g.pcie_path[start:], *n.pcie_path[start:])
                       if not b.startswith("pci")]
            on = [b for b in dict.fromkeys(between)
                  if read_function(b, env.sys_root).acs_source_validation]
            if on:
                acs.append(f"GPU{g.index}-{n.device}: {', '.join(on)}")
            if not p.same_numa:
                far.append(f"GPU{g.index} (node {g.numa_node}) - {n.device} "
                           f"(node {n.numa_node})")
            data[str(g.index)] = {"nic": n.device, "tier": p.tier, "acs_bridges": on}
            for what, bdf in ((f"GPU{g.index}", g.pci_bus_id), (n.device, n.pci_bus_id)):
                if not bdf or bdf in seen:
                    continue
                seen.add(bdf)
                f = read_function(bdf, env.sys_root)
                if f.iommu_type is not None and f.iommu_type != "identity":
                    iommu.append(f"{what} ({f.iommu_type})")
                if what == n.device and f.relaxed_ordering is False:
                    ro.append(what)
                if f.link_width and f.max_link_width and f.link_width < f.max_link_width:
                    links.append(f"{what} x{f.link_width} of x{f.max_link_width}")
                cur, top = _speed(f.link_speed), _speed(f.max_link_speed)
                if cur and top and cur < top:
                    slow.append(f"{what} {f.link_speed} of {f.max_link_speed}")
    t = "GPU/NIC path"
    out = [
        Check("io-acs", f"{t}: ACS", WARN if acs else PASS,
              ("ACS source validation on a bridge between a GPU and its NIC: " + "; ".join(acs))
              if acs else f"no ACS source validation between {len(data)} GPU(s) and their NICs",
              "ACS routes GPU<->NIC traffic (GPUDirect RDMA) through the root complex "
              "(NCCL: inter-node all-reduce far below line rate). On bare metal clear it: "
              "setpci -s BDF ECAP_ACS+6.w=0000 (every boot; never inside a VM).",
              data={"pairs": data}),
        Check("io-numa", f"{t}: NUMA", WARN if far else PASS,
              ("NIC on another NUMA node than its GPU: " + "; ".join(far)) if far
              else "every GPU's NIC is on its NUMA node",
              "Use a NIC on the GPU's node (NCCL_IB_HCA per rank: [nccl] per_rank_nic)."),
        Check("io-iommu", f"{t}: IOMMU", WARN if iommu else PASS,
              ("DMA translated (IOMMU domain not identity): " + ", ".join(iommu)) if iommu
              else "GPU and NIC DMA not translated (no IOMMU or passthrough)",
              "Boot with iommu=pt so GPUDirect RDMA skips translation."),
        Check("io-relaxed-ordering", f"{t}: relaxed ordering",
              WARN if ro else PASS,
              ("relaxed ordering disabled on " + ", ".join(ro)) if ro
              else "relaxed ordering enabled (or not readable) on the GPUs' NICs",
              "Enable PCIe relaxed ordering on the NIC (mlxconfig PCI_WR_ORDERING / "
              "NCCL_IB_PCI_RELAXED_ORDERING=1)."),
        Check("io-link", f"{t}: PCIe links", WARN if links else PASS,
              ("link narrower than the device's: " + ", ".join(links)) if links
              else "every GPU and NIC link at its full width"
              + (f" (below top speed, often idle power saving: {', '.join(slow)})"
                 if slow else ""),
              "Reseat the card or check the slot/riser: a link below its width halves "
              "bandwidth."),
    ]
    return out


def _read_whole(path: Path) -> str | None:
    """All of a file that may be large (mountinfo on a host with many mounts), or None."""
    try:
        return read_text(path, None)
    except OSError:
        return None


# -- storage -------------------------------------------------------------------
def find_mount(env: Env, path: Path) -> tuple[str, str, str] | None:
    """(mount point, fs type, major:minor) of the mount holding ``path``."""
    text = _read_whole(env.proc_root / "self/mountinfo")
    if text is None:
        return None
    target = str(path.resolve())
    best: tuple[str, str, str] | None = None
    for line in text.splitlines():
        pre, _, post = line.partition(" - ")
        f = pre.split()
        mnt = f[4].replace("\\040", " ")
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and (best is None or len(mnt) >= len(best[0])):
            best = (mnt, post.split()[0], f[2])
    return best


def check_data_fs(env: Env) -> list[Check]:
    d = env.data_dir
    if not d.exists():
        return [Check("data-fs", "Data directory filesystem", FAIL, f"{d} does not exist",
                      "Pass an existing directory with --data-dir.")]
    m = find_mount(env, d)
    if m is None:
        return [Check("data-fs", "Data directory filesystem", SKIP,
                      f"cannot read {env.proc_root}/self/mountinfo")]
    mnt, fstype, majmin = m
    if fstype in GOOD_FS:
        fs = Check("data-fs", "Data directory filesystem", PASS, f"{d} is on {fstype} ({mnt})")
    else:
        fs = Check("data-fs", "Data directory filesystem", WARN,
                   f"{d} is on {fstype} ({mnt})",
                   "Stage training data on a local XFS or ext4 filesystem (NVMe) for "
                   "predictable throughput; network/overlay filesystems add latency.")
    return [fs, check_data_device(env, d, majmin)]


def check_data_device(env: Env, d: Path, majmin: str) -> Check:
    title = "Data directory device"
    dev = env.sys_root / "dev/block" / majmin
    try:
        real = dev.resolve(strict=True)
    except OSError:
        return Check("data-device", title, SKIP, f"{d} is not on a block device ({majmin})")
    disk = real.parent if (real / "partition").exists() else real
    rot = read_value(disk / "queue/rotational")
    name = disk.name
    if rot is None:
        return Check("data-device", title, SKIP, f"{name}: no queue/rotational")
    if rot == "1":
        return Check("data-device", title, WARN, f"{d} is on {name}, a rotational disk",
                     "Put training data on NVMe/SSD; a spinning disk cannot feed random reads.")
    kind = "NVMe" if name.startswith("nvme") else "non-rotational"
    return Check("data-device", title, PASS, f"{d} is on {name} ({kind})")


# -- limits and kernel ---------------------------------------------------------
def check_nofile(env: Env, limits: tuple[int, int] | None = None) -> Check:
    soft, hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_NOFILE)
    ev = f"RLIMIT_NOFILE soft {soft}, hard {hard}"
    if soft != resource.RLIM_INFINITY and soft < NOFILE_MIN:
        elsewhere = ("LimitNOFILE= in the unit, nofile in /etc/security/limits.conf, or "
                     "policy [limits] nofile (tunerd sets it on run and rule-bound jobs)")
        if hard == resource.RLIM_INFINITY or hard >= NOFILE_MIN:
            # the soft limit may be raised up to the hard one without privilege
            to = 1048576 if hard == resource.RLIM_INFINITY else min(hard, 1048576)
            fix = f"Raise to >= {NOFILE_MIN}: `ulimit -n {to}` (up to the hard limit), or " \
                  + elsewhere + "."
        else:
            fix = (f"The hard limit {hard} is below {NOFILE_MIN} and only root can raise "
                   f"it (`ulimit -n` cannot go past it): " + elsewhere + ".")
        return Check("nofile", "Open-file limit", WARN, ev, fix)
    return Check("nofile", "Open-file limit", PASS, ev)


def check_training_env(env: Env) -> list[Check]:
    """The ways a binding is silently lost inside a training script (tunerd.diagnose.training_env),
    for the environment tunerctl doctor runs in: the one jobs are started from."""
    from tunerd.diagnose.training_env import check_environment

    try:
        allowed = len(os.sched_getaffinity(0))
    except OSError:
        allowed = os.cpu_count() or 1
    found = check_environment(env.environ, allowed, torch=True, intel_openmp=None)
    if not found:
        return [Check("binding-env", "OpenMP variables and the CPUs given", PASS,
                      f"no OpenMP binding variable; thread counts fit the {allowed} CPU(s) "
                      "this shell may use")]
    out = []
    for f in found:
        evidence = ", ".join(f"{k}={v}" for k, v in f.evidence.items())
        out.append(Check(f.id, f.title, WARN, f"{f.why} ({evidence})", f.fix,
                         data={"docs": list(f.docs)}))
    return out


def check_numa_balancing(env: Env) -> Check:
    val = read_value(env.proc_root / "sys/kernel/numa_balancing")
    if val is None:
        return Check("numa-balancing", "Automatic NUMA balancing", SKIP,
                     "kernel without CONFIG_NUMA_BALANCING")
    if val == "0":
        return Check("numa-balancing", "Automatic NUMA balancing", PASS, "numa_balancing=0")
    try:
        nodes = [n for n in os.listdir(env.sys_root / "devices/system/node")
                 if re.fullmatch(r"node\d+", n)]
    except OSError:
        nodes = []
    if len(nodes) == 1:
        return Check("numa-balancing", "Automatic NUMA balancing", PASS,
                     f"numa_balancing={val}, but one NUMA node: nothing to migrate")
    return Check("numa-balancing", "Automatic NUMA balancing", WARN,
                 f"numa_balancing={val}: the kernel migrates pages and tasks behind the binding",
                 "sysctl kernel.numa_balancing=0 (policy [vm] numa_balancing = false) when jobs "
                 "are bound with tunerctl bind/run.")


def check_governor(env: Env) -> Check:
    base = env.sys_root / "devices/system/cpu"
    try:
        cpus = sorted(n for n in os.listdir(base) if re.fullmatch(r"cpu\d+", n))
    except OSError:
        cpus = []
    govs: dict[str, int] = {}
    for c in cpus:
        g = read_value(base / c / "cpufreq/scaling_governor")
        if g is not None:
            govs[g] = govs.get(g, 0) + 1
    if not govs:
        return Check("cpu-governor", "CPU frequency governor", SKIP,
                     "no cpufreq on this node (VM or firmware-controlled)")
    ev = ", ".join(f"{g} on {plural(n, 'CPU')}" for g, n in sorted(govs.items()))
    if set(govs) == {"performance"}:
        return Check("cpu-governor", "CPU frequency governor", PASS, ev)
    return Check("cpu-governor", "CPU frequency governor", WARN, ev,
                 "Use the performance governor (policy [cpu] governor = \"performance\", or "
                 "cpupower frequency-set -g performance).")


# -- network -------------------------------------------------------------------
def nccl_ifname(env: Env) -> tuple[str | None, str]:
    v = env.environ.get("NCCL_SOCKET_IFNAME")
    if v:
        return v, "env NCCL_SOCKET_IFNAME"
    text = _read_whole(env.etc_root / "nccl.conf") or ""
    for line in text.splitlines():
        k, _, val = line.partition("=")
        if k.strip() == "NCCL_SOCKET_IFNAME" and val.strip():
            return val.strip(), f"{env.etc_root}/nccl.conf"
    return None, ""



def check_nccl_mtu(env: Env) -> Check:
    title = "MTU of the NCCL interfaces"
    spec, src = nccl_ifname(env)
    if spec is None:
        return Check("nccl-mtu", title, SKIP,
                     "NCCL_SOCKET_IFNAME is not set (env or /etc/nccl.conf)")
    base = env.sys_root / "class/net"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        names = []
    nics = match_ifnames(spec, names)
    if not nics:
        return Check("nccl-mtu", title, FAIL,
                     f"NCCL_SOCKET_IFNAME={spec} ({src}) matches no interface ({', '.join(names)})",
                     "Set NCCL_SOCKET_IFNAME to the fabric interface(s), e.g. =ens1f0.")
    small, info = [], []
    for n in nics:
        mtu = read_value(base / n / "mtu")
        fabric = (base / n / "device").exists()  # a physical NIC, not lo/bridge/veth
        info.append(f"{n} mtu {mtu}{'' if fabric else ' (virtual)'}")
        if fabric and mtu is not None and int(mtu) < JUMBO_MTU:
            small.append(n)
    ev = f"NCCL_SOCKET_IFNAME={spec} ({src}): " + ", ".join(info)
    if small:
        return Check("nccl-mtu", title, WARN, ev,
                     f"Use jumbo frames (MTU {JUMBO_MTU}) on {', '.join(small)} and the switch "
                     "ports: policy [[nic]] mtu = 9000.")
    return Check("nccl-mtu", title, PASS, ev)


CHECKS: list[Callable[[Env], Check | list[Check]]] = [
    check_driver, check_nvcc, check_libcudart, check_python, check_torch, check_acs, check_iommu,
    check_data_fs, check_nofile, check_training_env, check_numa_balancing, check_governor,
    check_nccl_mtu, check_io_paths,
]


def run_checks(data_dir: Path | None = None, env: Env | None = None) -> list[Check]:
    env = env or Env()
    if data_dir is not None:
        env.data_dir = data_dir
    out: list[Check] = []
    for fn in CHECKS:
        try:
            r = fn(env)
        except Exception as err:  # a check with a bug must not hide the others
            r = Check(fn.__name__.removeprefix("check_"), fn.__name__, FAIL,
                      f"the check itself failed: {type(err).__name__}: {err}")
        out.extend(r if isinstance(r, list) else [r])
    return out


def format_report(results: list[Check]) -> str:
    lines = []
    for r in results:
        lines.append(f"{r.status:4}  {r.title}: {r.evidence}")
        if r.fix and r.status in (WARN, FAIL):
            lines.append(f"      fix: {r.fix}")
    counts = {s: sum(1 for r in results if r.status == s) for s in (PASS, WARN, FAIL, SKIP)}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)
