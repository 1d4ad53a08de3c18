"""The typed GPU layer: the one place NVML (nvidia-ml-py, import name ``pynvml``) is called.

Everything tunerd knows about a GPU goes through a :class:`Device`. Each reading is a
typed property (``int | NotAvailable``, ``str | NotAvailable``...) whose docstring gives
its unit and the ``nvidia-smi --query-gpu=...`` field that shows the same number, in the
style of nvitop's ``api/device.py``. A value the driver, the GPU or the backend cannot
give is the explicit :data:`NA`, never an exception and never ``None``: one unsupported
query (NVLink on a PCIe card, ECC on a consumer GPU) degrades that value only.

Two backends implement the same interface (:class:`Backend`, :class:`Device`):

* :class:`NvmlBackend`: a pynvml-shaped library, pynvml itself by default. Newest
  function versions are tried first and an older one is used when the driver lacks the
  symbol (``NVML_ERROR_FUNCTION_NOT_FOUND``); errors are told apart by their NVML error
  code (``err.value``), never by their message.
* ``tunerd.topology.nvml_replay.ReplayNvml``: a recorded topology snapshot, answering
  what the snapshot records and NA for the rest.

NVML is started lazily and once (the first call that needs it). A missing driver is not
an error: :func:`available` is False and :func:`reason` says why in words an operator can
act on. Tests install another backend with :func:`set_backend` / :func:`use_backend`.

No other module of tunerd spells an NVML function name (tests/test_nvml_layer.py checks).
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, TypeVar, Union

__all__ = [
    "NA", "Backend", "Device", "GpuProcess", "MemoryInfo", "NaOr", "NotAvailable",
    "NvmlBackend", "NvmlDevice", "NvmlError", "RemappedRows", "Utilization", "XidEvent",
    "XidWatch", "available", "backend", "cuda_driver_version", "device", "device_count",
    "devices", "driver_version", "error_code", "nvml_version", "reason", "restoring_backend",
    "set_backend", "use_backend",
]

T = TypeVar("T")


class NotAvailable(enum.Enum):
    """The one "not available" value (no driver, no GPU, unsupported): falsy, prints N/A.

    An enum member so that ``if v is NA`` narrows ``int | NotAvailable`` for mypy.
    """

    NA = "N/A"

    def __repr__(self) -> str:
        return "N/A"

    def __str__(self) -> str:
        return "N/A"

    def __bool__(self) -> bool:
        return False


NA: Final = NotAvailable.NA
NaOr = Union[T, NotAvailable]  # noqa: UP007 (a generic alias: `int | NotAvailable` spelled once)

# NVML return codes (nvml.h NVML_ERROR_*), compared with ``error_code(err)``
ERROR_UNINITIALIZED: Final = 1
ERROR_INVALID_ARGUMENT: Final = 2
ERROR_NOT_SUPPORTED: Final = 3
ERROR_NO_PERMISSION: Final = 4
ERROR_NOT_FOUND: Final = 6
ERROR_DRIVER_NOT_LOADED: Final = 9
ERROR_TIMEOUT: Final = 10
ERROR_LIBRARY_NOT_FOUND: Final = 12
ERROR_FUNCTION_NOT_FOUND: Final = 13
ERROR_GPU_IS_LOST: Final = 15
ERROR_LIB_RM_VERSION_MISMATCH: Final = 18
ERROR_UNKNOWN: Final = 999

# other nvml.h constants, spelled out so no module needs pynvml to import
TEMPERATURE_GPU: Final = 0      # NVML_TEMPERATURE_GPU
CLOCK_GRAPHICS, CLOCK_SM, CLOCK_MEM = 0, 1, 2  # NVML_CLOCK_*
PCIE_UTIL_TX_BYTES, PCIE_UTIL_RX_BYTES = 0, 1  # NVML_PCIE_UTIL_*
MEMORY_ERROR_CORRECTED, MEMORY_ERROR_UNCORRECTED = 0, 1  # NVML_MEMORY_ERROR_TYPE_*
AGGREGATE_ECC: Final = 1        # NVML_AGGREGATE_ECC: lifetime counts
EVENT_XID_CRITICAL: Final = 0x8  # nvmlEventTypeXidCriticalError
NVLINK_DEVICE_TYPE_SWITCH: Final = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH
FEATURE_ENABLED: Final = 1      # NVML_FEATURE_ENABLED
MIG_ENABLE: Final = 1           # NVML_DEVICE_MIG_ENABLE
MAX_NVLINKS: Final = 18         # links a Hopper GPU has; the loop stops at the first NA


def error_code(err: BaseException) -> int | None:
    """The NVML return code an exception carries (pynvml's ``NVMLError.value``), or None."""
    v = getattr(err, "value", None)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class NvmlError(Exception):
    """A setter NVML refused; ``code`` is the NVML return code (None: not an NVML error)."""

    def __init__(self, code: int | None, message: str) -> None:
        super().__init__(message)
        self.code = code


class MemoryInfo(NamedTuple):
    """Device memory in bytes (``nvidia-smi --query-gpu=memory.total,memory.used,memory.free``
    shows MiB)."""
    total: NaOr[int]
    used: NaOr[int]
    free: NaOr[int]


class Utilization(NamedTuple):
    """Percent of the last sample period (1/6 s to 1 s) a kernel ran / memory was read or
    written (``utilization.gpu``, ``utilization.memory``)."""
    gpu: NaOr[int]
    memory: NaOr[int]


class RemappedRows(NamedTuple):
    """Row remapping counts (``remapped_rows.correctable,remapped_rows.uncorrectable,
    remapped_rows.pending,remapped_rows.failure``)."""
    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


class GpuProcess(NamedTuple):
    """A compute process on a GPU (``nvidia-smi --query-compute-apps=pid,used_memory``);
    memory in bytes, NA where the driver hides it (no permission, MIG)."""
    pid: int
    used_memory: NaOr[int]


@dataclass(frozen=True)
class XidEvent:
    """One Xid critical error: the UUID of the GPU it names (NA if that cannot be told)."""
    uuid: NaOr[str]
    xid: int


class XidWatch:
    """Xid critical-error events of some GPUs (``nvidia-smi -q -d ...``: not shown; the
    kernel log's ``NVRM: Xid`` lines). The base class never sees any."""

    def poll(self, limit: int = 64) -> list[XidEvent]:
        """Events that arrived since the last poll, at most ``limit`` (never blocks)."""
        return []


class Device:
    """One GPU, or one MIG slice of one, as NVML sees it.

    Every property reads the driver now (nothing is cached but the identity); every one
    returns :data:`NA` where the value is not available. This base class knows nothing,
    so every reading is NA: a backend overrides what it can answer.
    """

    #: highest NVLink index + 1 worth asking about
    max_nvlinks: int = MAX_NVLINKS

    def __init__(self, index: int, parent: Device | None = None) -> None:
        #: NVML index (the ``nvidia-smi -i`` number); for a MIG slice, its slot on the parent
        self.index = index
        #: the physical GPU of a MIG slice (None for a physical GPU)
        self.parent = parent

    def __repr__(self) -> str:
        kind = "MigDevice" if self.parent is not None else "Device"
        return f"{kind}(index={self.index}, uuid={self.uuid!r})"

    # -- identity ---------------------------------------------------------------------
    @property
    def uuid(self) -> NaOr[str]:
        """``GPU-...`` (``MIG-...`` for a slice) (``--query-gpu=uuid``)."""
        return NA

    @property
    def name(self) -> NaOr[str]:
        """Product name, e.g. ``NVIDIA H200`` (``--query-gpu=name``)."""
        return NA

    @property
    def pci_bus_id(self) -> NaOr[str]:
        """PCI address in sysfs form, ``0000:18:00.0`` (``--query-gpu=pci.bus_id`` prints
        ``00000000:18:00.0``)."""
        return NA

    # -- memory -----------------------------------------------------------------------
    @property
    def memory_info(self) -> MemoryInfo:
        """Total, used and free device memory in bytes (``memory.total,used,free``, MiB;
        ``used`` without the driver's reserved memory, ``memory.reserved``, where the
        driver has the v2 query)."""
        return MemoryInfo(NA, NA, NA)

    @property
    def memory_total(self) -> NaOr[int]:
        """Device memory size in bytes (``--query-gpu=memory.total``, MiB)."""
        return self.memory_info.total

    @property
    def memory_used(self) -> NaOr[int]:
        """Device memory in use in bytes (``--query-gpu=memory.used``, MiB)."""
        return self.memory_info.used

    # -- load, power, heat, clocks ----------------------------------------------------
    @property
    def utilization(self) -> Utilization:
        """Kernel and memory-controller busy percentages (``utilization.gpu,.memory``)."""
        return Utilization(NA, NA)

    @property
    def power_usage_mw(self) -> NaOr[int]:
        """Power draw in milliwatts (``--query-gpu=power.draw``, W)."""
        return NA

    @property
    def enforced_power_limit_mw(self) -> NaOr[int]:
        """The power limit in force, in milliwatts (``enforced.power.limit``, W)."""
        return NA

    @property
    def power_management_limit_mw(self) -> NaOr[int]:
        """The configured power limit in milliwatts (``power.limit``, W; set with
        ``nvidia-smi -pl``)."""
        return NA

    @property
    def temperature_c(self) -> NaOr[int]:
        """Core temperature in degrees Celsius (``--query-gpu=temperature.gpu``)."""
        return NA

    @property
    def sm_clock_mhz(self) -> NaOr[int]:
        """Current SM clock in MHz (``--query-gpu=clocks.sm``)."""
        return NA

    @property
    def memory_clock_mhz(self) -> NaOr[int]:
        """Current memory clock in MHz (``--query-gpu=clocks.mem``)."""
        return NA

    @property
    def graphics_clock_mhz(self) -> NaOr[int]:
        """Current graphics clock in MHz (``--query-gpu=clocks.gr``)."""
        return NA

    @property
    def clocks_event_reasons(self) -> NaOr[int]:
        """Bit mask of why the clocks are held down (``clocks_event_reasons.active``, older
        ``clocks_throttle_reasons.active``; 0x1 idle, 0x4 power cap, 0x20/0x40 thermal)."""
        return NA

    # -- PCIe -------------------------------------------------------------------------
    def pcie_throughput_kbs(self, counter: int) -> NaOr[int]:
        """PCIe KB/s over a 20 ms window, ``PCIE_UTIL_TX_BYTES`` or ``_RX_BYTES``
        (``nvidia-smi dmon -s t``, MB/s). NVML sleeps 20 ms inside this call."""
        return NA

    @property
    def pcie_link_gen(self) -> NaOr[int]:
        """Current PCIe generation (``--query-gpu=pcie.link.gen.current``; it drops at idle
        on power-saving links)."""
        return NA

    @property
    def pcie_link_width(self) -> NaOr[int]:
        """Current PCIe lanes (``--query-gpu=pcie.link.width.current``)."""
        return NA

    @property
    def pcie_link_gen_max(self) -> NaOr[int]:
        """Highest PCIe generation of GPU and slot (``--query-gpu=pcie.link.gen.max``)."""
        return NA

    @property
    def pcie_link_width_max(self) -> NaOr[int]:
        """Widest PCIe link of GPU and slot (``--query-gpu=pcie.link.width.max``)."""
        return NA

    # -- health -----------------------------------------------------------------------
    def ecc_errors_total(self, uncorrected: bool) -> NaOr[int]:
        """Lifetime ECC error count (``ecc.errors.corrected.aggregate.total`` /
        ``ecc.errors.uncorrected.aggregate.total``)."""
        return NA

    @property
    def remapped_rows(self) -> NaOr[RemappedRows]:
        """Row remapping state (``remapped_rows.*``; Ampere and later)."""
        return NA

    def compute_processes(self) -> NaOr[list[GpuProcess]]:
        """Compute processes on this GPU (``nvidia-smi --query-compute-apps=pid,used_memory``)."""
        return NA

    def graphics_processes(self) -> NaOr[list[GpuProcess]]:
        """Graphics processes on this GPU (``nvidia-smi`` lists them as type G)."""
        return NA

    @property
    def minor_number(self) -> NaOr[int]:
        """The N of this GPU's ``/dev/nvidiaN`` (``--query-gpu=`` has none; ``nvidia-smi
        -q`` prints it as ``Minor Number``)."""
        return NA

    # -- locality ---------------------------------------------------------------------
    def cpu_affinity(self, ncpus: int) -> NaOr[frozenset[int]]:
        """CPUs the driver calls close to this GPU (``nvidia-smi topo -m``, CPU Affinity)."""
        return NA

    @property
    def numa_node_id(self) -> NaOr[int]:
        """NUMA node NVML names for the GPU (``nvidia-smi topo -m``, NUMA Affinity). On
        Grace Hopper this is the GPU *memory* node, which has no CPUs."""
        return NA

    def common_ancestor(self, other: Device) -> NaOr[int]:
        """How two GPUs meet on PCIe: 0/10 one switch (PIX), 20 several (PXB), 30 host
        bridge (PHB), 40 one NUMA node (NODE), 50 across sockets (SYS) (``topo -m``)."""
        return NA

    # -- NVLink -----------------------------------------------------------------------
    def nvlink_active(self, link: int) -> NaOr[bool]:
        """Whether NVLink ``link`` is up; NA past the last link (``nvidia-smi nvlink -s``)."""
        return NA

    def nvlink_remote_device_type(self, link: int) -> NaOr[int]:
        """What the far end of ``link`` is: 0 GPU, 1 IBMNPU, 2 NVSwitch (r470+ drivers;
        ``nvidia-smi nvlink -R``)."""
        return NA

    def nvlink_remote_bus_id(self, link: int) -> NaOr[str]:
        """PCI address (sysfs form) of the far end of ``link`` (``nvidia-smi nvlink -R``)."""
        return NA

    # -- MIG --------------------------------------------------------------------------
    @property
    def mig_mode(self) -> NaOr[int]:
        """Current MIG mode, 1 enabled (``--query-gpu=mig.mode.current``)."""
        return NA

    def mig_devices(self) -> list[Device]:
        """The populated MIG slices of this GPU (``nvidia-smi -L``); [] without MIG."""
        return []

    @property
    def gpu_instance_id(self) -> NaOr[int]:
        """GPU instance of a MIG slice (``nvidia-smi mig -lgi``)."""
        return NA

    @property
    def compute_instance_id(self) -> NaOr[int]:
        """Compute instance of a MIG slice (``nvidia-smi mig -lci``)."""
        return NA

    # -- settings (tunerd.tuners.gpu) --------------------------------------------------
    @property
    def persistence_mode(self) -> NaOr[int]:
        """1 when the driver stays loaded with no client (``--query-gpu=persistence_mode``)."""
        return NA

    @property
    def compute_mode(self) -> NaOr[int]:
        """0 default, 1 exclusive thread, 2 prohibited, 3 exclusive process
        (``--query-gpu=compute_mode``)."""
        return NA

    def set_persistence_mode(self, on: bool) -> None:
        """``nvidia-smi -i N -pm 1``; raises :class:`NvmlError`."""
        raise NvmlError(ERROR_NOT_SUPPORTED, "this backend cannot change GPU settings")

    def set_compute_mode(self, mode: int) -> None:
        """``nvidia-smi -i N -c MODE``; raises :class:`NvmlError`."""
        raise NvmlError(ERROR_NOT_SUPPORTED, "this backend cannot change GPU settings")

    def set_power_limit_mw(self, milliwatts: int) -> None:
        """``nvidia-smi -i N -pl WATTS``; raises :class:`NvmlError`."""
        raise NvmlError(ERROR_NOT_SUPPORTED, "this backend cannot change GPU settings")


class Backend:
    """Where GPU readings come from. The base class is a node without GPUs."""

    def devices(self) -> list[Device]:
        """The physical GPUs, in NVML index order (a GPU that fell off the bus is left out)."""
        return []

    @property
    def driver_version(self) -> NaOr[str]:
        """Kernel driver version (``--query-gpu=driver_version``), e.g. ``580.159.03``."""
        return NA

    @property
    def nvml_version(self) -> NaOr[str]:
        """NVML library version, e.g. ``13.580.159.03`` (``nvidia-smi -q``)."""
        return NA

    @property
    def cuda_driver_version(self) -> NaOr[int]:
        """Highest CUDA the driver supports, 1000*major + 10*minor (nvidia-smi's header
        ``CUDA Version: 13.0`` is 13000)."""
        return NA

    def xid_watch(self, devices: list[Device]) -> NaOr[XidWatch]:
        """A watch for Xid critical errors on ``devices``; NA where events are unsupported."""
        return NA


# -- the real library ------------------------------------------------------------------
def _text(v: Any) -> str:
    return v.decode(errors="replace").rstrip("\x00") if isinstance(v, bytes) else str(v)


def _sysfs_bus_id(raw: Any) -> NaOr[str]:
    """NVML's ``00000000:18:00.0`` -> ``0000:18:00.0`` (lower case, 4-digit domain)."""
    if not raw:
        return NA
    s = _text(raw).strip().lower()
    dom, sep, rest = s.partition(":")
    if not sep:
        return NA
    try:
        return f"{int(dom, 16):04x}:{rest}"
    except ValueError:
        return NA


class NvmlBackend(Backend):
    """NVML through a pynvml-shaped library: ``pynvml`` itself, or a recording (tests)."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self._devices: list[Device] | None = None

    def attempt(self, names: tuple[str, ...], *args: Any) -> tuple[Any, int | None]:
        """(value, None), or (NA, the NVML error code; ERROR_UNKNOWN for a non-NVML one).

        ``names`` lists function versions newest first; the next is tried only when the
        library or the driver lacks the previous one (``NVML_ERROR_FUNCTION_NOT_FOUND``).
        """
        code: int | None = ERROR_FUNCTION_NOT_FOUND
        for name in names:
            fn: Callable[..., Any] | None = getattr(self.lib, name, None)
            if fn is None or not callable(fn):
                continue
            try:
                return fn(*args), None
            except Exception as err:  # NVMLError_* (compared by code below), ctypes errors
                code = error_code(err)
                if code == ERROR_FUNCTION_NOT_FOUND:
                    continue
                return NA, ERROR_UNKNOWN if code is None else code
        return NA, code

    def query(self, names: tuple[str, ...], *args: Any) -> Any:
        """The value, or NA for any error (not supported, no permission, GPU lost...)."""
        return self.attempt(names, *args)[0]

    def devices(self) -> list[Device]:
        if self._devices is None:
            n = self.query(("nvmlDeviceGetCount",))
            out: list[Device] = []
            for i in range(n if isinstance(n, int) else 0):
                h = self.query(("nvmlDeviceGetHandleByIndex",), i)
                if h is not NA:
                    out.append(NvmlDevice(self, h, i))
            self._devices = out
        return list(self._devices)

    @property
    def driver_version(self) -> NaOr[str]:
        v = self.query(("nvmlSystemGetDriverVersion",))
        return NA if v is NA else _text(v)

    @property
    def nvml_version(self) -> NaOr[str]:
        v = self.query(("nvmlSystemGetNVMLVersion",))
        return NA if v is NA else _text(v)

    @property
    def cuda_driver_version(self) -> NaOr[int]:
        v = self.query(("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion"))
        return int(v) if isinstance(v, int) else NA

    def xid_watch(self, devices: list[Device]) -> NaOr[XidWatch]:
        ev = self.query(("nvmlEventSetCreate",))
        if ev is NA:
            return NA
        for d in devices:
            if isinstance(d, NvmlDevice):
                self.attempt(("nvmlDeviceRegisterEvents",), d.handle, EVENT_XID_CRITICAL, ev)
        return _NvmlXidWatch(self, ev)


class _NvmlXidWatch(XidWatch):
    def __init__(self, backend: NvmlBackend, event_set: Any) -> None:
        self.backend = backend
        self.event_set = event_set

    def poll(self, limit: int = 64) -> list[XidEvent]:
        out: list[XidEvent] = []
        for _ in range(limit):  # bounded: a storm of events must not stall a cycle
            data, code = self.backend.attempt(("nvmlEventSetWait_v2", "nvmlEventSetWait"),
                                              self.event_set, 0)
            if code is not None or data is None:  # ERROR_TIMEOUT: nothing pending
                break
            # the event names its device by a fresh handle: match on the UUID
            uuid = self.backend.query(("nvmlDeviceGetUUID",), getattr(data, "device", None))
            out.append(XidEvent(NA if uuid is NA else _text(uuid),
                                int(getattr(data, "eventData", 0) or 0)))
        return out


def _int(v: Any) -> NaOr[int]:
    if isinstance(v, bool) or v is None:
        return NA
    try:
        return int(v)
    except (TypeError, ValueError):
        return NA


class NvmlDevice(Device):
    """A GPU (or MIG slice) behind an NVML handle."""

    def __init__(self, backend: NvmlBackend, handle: Any, index: int,
                 parent: Device | None = None) -> None:
        super().__init__(index, parent)
        self.backend = backend
        self.handle = handle
        self._ident: dict[str, Any] = {}
        self.max_nvlinks = int(getattr(backend.lib, "NVML_NVLINK_MAX_LINKS", MAX_NVLINKS))

    def _q(self, *names: str, args: tuple[Any, ...] = ()) -> Any:
        return self.backend.query(names, self.handle, *args)

    def _qint(self, *names: str, args: tuple[Any, ...] = ()) -> NaOr[int]:
        return _int(self._q(*names, args=args))

    def _ident_text(self, key: str, *names: str) -> NaOr[str]:
        if key not in self._ident:
            v = self._q(*names)
            if v is NA:
                return NA
            self._ident[key] = _text(v)
        return str(self._ident[key])

    @property
    def uuid(self) -> NaOr[str]:
        return self._ident_text("uuid", "nvmlDeviceGetUUID")

    @property
    def name(self) -> NaOr[str]:
        return self._ident_text("name", "nvmlDeviceGetName")

    @property
    def pci_bus_id(self) -> NaOr[str]:
        if "bus" not in self._ident:
            pci = self._q("nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo")
            if pci is NA:
                return NA
            bus = _sysfs_bus_id(getattr(pci, "busId", None) or getattr(pci, "busIdLegacy", None))
            if bus is NA:
                return NA
            self._ident["bus"] = bus
        return str(self._ident["bus"])

    @property
    def memory_info(self) -> MemoryInfo:
        # the v2 struct first: its ``used`` leaves out the driver's reserved memory, as
        # nvidia-smi's memory.used does (v1's counts it: ~0.5 GiB more on an H100)
        m: Any = NA
        v2 = getattr(self.backend.lib, "nvmlMemory_v2", None)
        if isinstance(v2, int):
            m = self._q("nvmlDeviceGetMemoryInfo", args=(v2,))
        if m is NA:
            m = self._q("nvmlDeviceGetMemoryInfo")
        if m is NA:
            return MemoryInfo(NA, NA, NA)
        return MemoryInfo(_int(getattr(m, "total", None)), _int(getattr(m, "used", None)),
                          _int(getattr(m, "free", None)))

    @property
    def utilization(self) -> Utilization:
        u = self._q("nvmlDeviceGetUtilizationRates")
        if u is NA:
            return Utilization(NA, NA)
        return Utilization(_int(getattr(u, "gpu", None)), _int(getattr(u, "memory", None)))

    @property
    def power_usage_mw(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetPowerUsage")

    @property
    def enforced_power_limit_mw(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetEnforcedPowerLimit")

    @property
    def power_management_limit_mw(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetPowerManagementLimit")

    @property
    def temperature_c(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetTemperature", args=(TEMPERATURE_GPU,))

    @property
    def sm_clock_mhz(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetClockInfo", args=(CLOCK_SM,))

    @property
    def memory_clock_mhz(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetClockInfo", args=(CLOCK_MEM,))

    @property
    def graphics_clock_mhz(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetClockInfo", args=(CLOCK_GRAPHICS,))

    @property
    def clocks_event_reasons(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetCurrentClocksEventReasons",
                          "nvmlDeviceGetCurrentClocksThrottleReasons")

    def pcie_throughput_kbs(self, counter: int) -> NaOr[int]:
        return self._qint("nvmlDeviceGetPcieThroughput", args=(counter,))

    @property
    def pcie_link_gen(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetCurrPcieLinkGeneration")

    @property
    def pcie_link_width(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetCurrPcieLinkWidth")

    @property
    def pcie_link_gen_max(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetMaxPcieLinkGeneration")

    @property
    def pcie_link_width_max(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetMaxPcieLinkWidth")

    def ecc_errors_total(self, uncorrected: bool) -> NaOr[int]:
        kind = MEMORY_ERROR_UNCORRECTED if uncorrected else MEMORY_ERROR_CORRECTED
        return self._qint("nvmlDeviceGetTotalEccErrors", args=(kind, AGGREGATE_ECC))

    @property
    def remapped_rows(self) -> NaOr[RemappedRows]:
        rows = self._q("nvmlDeviceGetRemappedRows")
        if rows is NA or not isinstance(rows, (list, tuple)) or len(rows) < 3:
            return NA
        fail = bool(rows[3]) if len(rows) > 3 else False
        return RemappedRows(int(rows[0]), int(rows[1]), bool(rows[2]), fail)

    def compute_processes(self) -> NaOr[list[GpuProcess]]:
        plist = self._q("nvmlDeviceGetComputeRunningProcesses_v3",
                        "nvmlDeviceGetComputeRunningProcesses_v2",
                        "nvmlDeviceGetComputeRunningProcesses")
        if plist is NA:
            return NA
        return [GpuProcess(int(p.pid), _int(getattr(p, "usedGpuMemory", None)))
                for p in plist or []]

    def graphics_processes(self) -> NaOr[list[GpuProcess]]:
        plist = self._q("nvmlDeviceGetGraphicsRunningProcesses_v3",
                        "nvmlDeviceGetGraphicsRunningProcesses_v2",
                        "nvmlDeviceGetGraphicsRunningProcesses")
        if plist is NA:
            return NA
        return [GpuProcess(int(p.pid), _int(getattr(p, "usedGpuMemory", None)))
                for p in plist or []]

    @property
    def minor_number(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetMinorNumber") if self.parent is None else NA

    def cpu_affinity(self, ncpus: int) -> NaOr[frozenset[int]]:
        words = max(1, (ncpus + 63) // 64)
        masks = self._q("nvmlDeviceGetCpuAffinity", args=(words,))
        if masks is NA:
            return NA
        out = set()
        for w, mask in enumerate(masks):
            m, bit = int(mask), 0
            while m:
                if m & 1:
                    out.add(w * 64 + bit)
                m >>= 1
                bit += 1
        return frozenset(out)

    @property
    def numa_node_id(self) -> NaOr[int]:
        v = self._qint("nvmlDeviceGetNumaNodeId")
        return NA if v is NA or v < 0 else v  # -1: the driver names no node

    def common_ancestor(self, other: Device) -> NaOr[int]:
        if not isinstance(other, NvmlDevice):
            return NA
        return self._qint("nvmlDeviceGetTopologyCommonAncestor", args=(other.handle,))

    def nvlink_active(self, link: int) -> NaOr[bool]:
        v = self._qint("nvmlDeviceGetNvLinkState", args=(link,))
        return NA if v is NA else v == FEATURE_ENABLED

    def nvlink_remote_device_type(self, link: int) -> NaOr[int]:
        return self._qint("nvmlDeviceGetNvLinkRemoteDeviceType", args=(link,))

    def nvlink_remote_bus_id(self, link: int) -> NaOr[str]:
        pci = self._q("nvmlDeviceGetNvLinkRemotePciInfo_v2", "nvmlDeviceGetNvLinkRemotePciInfo",
                      args=(link,))
        if pci is NA:
            return NA
        return _sysfs_bus_id(getattr(pci, "busId", None) or getattr(pci, "busIdLegacy", None))

    @property
    def mig_mode(self) -> NaOr[int]:
        mode = self._q("nvmlDeviceGetMigMode")
        if isinstance(mode, (list, tuple)) and mode:
            return _int(mode[0])
        return NA

    def mig_devices(self) -> list[Device]:
        if self.parent is not None or self.mig_mode != MIG_ENABLE:
            return []
        count = self._qint("nvmlDeviceGetMaxMigDeviceCount")
        out: list[Device] = []
        for i in range(count if isinstance(count, int) else 0):
            mh = self._q("nvmlDeviceGetMigDeviceHandleByIndex", args=(i,))
            if mh is not NA:  # NA: slot not populated
                out.append(NvmlDevice(self.backend, mh, i, parent=self))
        return out

    @property
    def gpu_instance_id(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetGpuInstanceId")

    @property
    def compute_instance_id(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetComputeInstanceId")

    @property
    def persistence_mode(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetPersistenceMode")

    @property
    def compute_mode(self) -> NaOr[int]:
        return self._qint("nvmlDeviceGetComputeMode")

    def _set(self, name: str, *args: Any) -> None:
        fn = getattr(self.backend.lib, name, None)
        if fn is None:
            raise NvmlError(ERROR_FUNCTION_NOT_FOUND, f"this NVML has no {name}")
        try:
            fn(self.handle, *args)
        except Exception as err:
            code = error_code(err)
            if code == ERROR_NO_PERMISSION:
                raise NvmlError(code, "no permission (GPU settings need root)") from err
            raise NvmlError(code, str(err)) from err

    def set_persistence_mode(self, on: bool) -> None:
        self._set("nvmlDeviceSetPersistenceMode", 1 if on else 0)

    def set_compute_mode(self, mode: int) -> None:
        self._set("nvmlDeviceSetComputeMode", mode)

    def set_power_limit_mw(self, milliwatts: int) -> None:
        self._set("nvmlDeviceSetPowerManagementLimit", milliwatts)


# -- the process-wide backend --------------------------------------------------------
_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "backend": None, "reason": None}


def _start_real() -> tuple[Backend | None, str | None]:
    try:
        import pynvml
    except ImportError as err:
        return None, f"nvidia-ml-py is not installed ({err}); pip install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except OSError as err:  # libnvidia-ml.so missing (older pynvml)
        return None, f"libnvidia-ml.so not found ({err}); no NVIDIA driver on this node"
    except Exception as err:  # NVMLError_*: told apart by code
        code = error_code(err)
        if code == ERROR_LIBRARY_NOT_FOUND:
            return None, "libnvidia-ml.so not found; no NVIDIA driver on this node"
        if code == ERROR_DRIVER_NOT_LOADED:
            return None, ("the NVIDIA kernel driver is not loaded (check `lsmod | grep nvidia`"
                          " and `nvidia-smi`)")
        if code == ERROR_NO_PERMISSION:
            return None, "no permission to open the NVIDIA devices (/dev/nvidia*)"
        if code == ERROR_LIB_RM_VERSION_MISMATCH:
            return None, ("NVML and the kernel driver differ in version (a driver upgrade "
                          "without a reboot?)")
        return None, (f"NVML could not start: {err}. Is the NVIDIA driver installed and "
                      "loaded? (check `nvidia-smi` and `lsmod | grep nvidia`)")
    return NvmlBackend(pynvml), None


def _init() -> None:
    if _state["tried"]:
        return
    with _lock:
        if _state["tried"]:
            return
        b, why = _start_real()
        _state.update(tried=True, backend=b, reason=why)


def set_backend(b: Any | None, why: str | None = None) -> None:
    """Use backend ``b`` instead of real NVML: a :class:`Backend`, or an object with
    pynvml's function names (wrapped in :class:`NvmlBackend`).

    ``set_backend(None, why)`` simulates a node without a driver.
    """
    if b is not None and not isinstance(b, Backend):
        b = NvmlBackend(b)
    with _lock:
        _state.update(tried=True, backend=b, reason=why if b is None else None)


@contextlib.contextmanager
def restoring_backend() -> Iterator[None]:
    """Whatever ``set_backend`` does inside the block is undone after it (tests)."""
    with _lock:
        saved = dict(_state)
    try:
        yield
    finally:
        with _lock:
            _state.clear()
            _state.update(saved)


@contextlib.contextmanager
def use_backend(b: Any | None, why: str | None = None) -> Iterator[None]:
    """``set_backend(b, why)`` for the block only (tests)."""
    with restoring_backend():
        set_backend(b, why)
        yield


def backend() -> Backend | None:
    """The backend in use (NVML is started on the first call); None without a driver."""
    _init()
    b: Backend | None = _state["backend"]
    return b


def available() -> bool:
    return backend() is not None


def reason() -> str | None:
    """Why NVML is not available (None when it is)."""
    _init()
    r: str | None = _state["reason"]
    return r


def devices() -> list[Device]:
    """Every physical GPU; [] without a driver."""
    b = backend()
    return b.devices() if b is not None else []


def device_count() -> int:
    return len(devices())


def device(index: int) -> NaOr[Device]:
    """GPU ``index`` (NVML order), or NA."""
    for d in devices():
        if d.index == index:
            return d
    return NA


def driver_version() -> NaOr[str]:
    b = backend()
    return b.driver_version if b is not None else NA


def nvml_version() -> NaOr[str]:
    b = backend()
    return b.nvml_version if b is not None else NA


def cuda_driver_version() -> NaOr[int]:
    b = backend()
    return b.cuda_driver_version if b is not None else NA
