"""The typed GPU layer (tunerd.adapters.nvml): the only place NVML names appear, one interface
that the replay backends and the real library answer alike (conformance), versioned
fallbacks and error codes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from tests.helpers import REPO
from tests.monitor_helpers import TELEMETRY, TelemetryReplay, nvml_error
from tests.topology_helpers import fixture
from tunerd.adapters import nvml
from tunerd.adapters.nvml import NA
from tunerd.base.errors import UsageError
from tunerd.topology.gpu import PCIE_LEVELS
from tunerd.topology.nvml_recording import RecordedNvml
from tunerd.topology.nvml_replay import ReplayNvml

NVML_NAME = re.compile(r"\bnvml[A-Z][A-Za-z0-9_]*")
PYNVML_IMPORT = re.compile(r"^\s*(import pynvml|from pynvml\b)", re.M)
LAYER = REPO / "tunerd" / "adapters" / "nvml.py"


# -- 1. NVML names are spelled in the layer only ------------------------------------
def test_nvml_function_names_appear_only_in_the_gpu_layer() -> None:
    offenders: list[str] = []
    for path in sorted((REPO / "tunerd").rglob("*.py")):
        if path == LAYER:
            continue
        text = path.read_text()
        for m in NVML_NAME.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            offenders.append(f"{path.relative_to(REPO)}:{line}: {m.group()}")
        if PYNVML_IMPORT.search(text):
            offenders.append(f"{path.relative_to(REPO)}: imports pynvml")
    assert offenders == [], ("NVML is called outside tunerd/adapters/nvml.py:\n"
                             + "\n".join(offenders))
    # the scan finds what it looks for: the layer itself is full of such names
    layer = LAYER.read_text()
    assert len(set(NVML_NAME.findall(layer))) > 40 and PYNVML_IMPORT.search(layer)


# -- 2. conformance: the same checks on every backend --------------------------------
def _real_backend() -> nvml.Backend:
    b, why = nvml._start_real()
    if b is None:
        pytest.skip(f"real NVML: {why}")
    if not b.devices():
        pytest.skip("real NVML: the driver reports no GPU")
    return b


BACKENDS = {
    "topology-replay-dgx-h100": lambda: ReplayNvml(fixture("dgx-h100.json")),
    "topology+telemetry-recording": lambda: RecordedNvml(fixture("dgx-h100.json"), TELEMETRY),
    "topology-replay-gh200": lambda: ReplayNvml(fixture("gh200.json")),
    "telemetry-replay-h100x2": lambda: nvml.NvmlBackend(TelemetryReplay()),
    "real-nvml": _real_backend,
}


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Iterator[nvml.Backend]:
    yield BACKENDS[request.param]()


def _int_or_na(v: Any, lo: int, hi: int, what: str) -> None:
    assert v is NA or (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi), \
        f"{what} = {v!r}"


def check_device(d: nvml.Device, ncpus: int, physical: bool = True) -> None:
    """Every reading is of its type or NA, in its unit's range, and never raises."""
    assert isinstance(d, nvml.Device) and isinstance(d.index, int)
    uuid = d.uuid
    assert uuid is NA or (isinstance(uuid, str) and uuid.startswith("GPU-" if physical
                                                                     else ("MIG-", "GPU-")))
    assert d.name is NA or (isinstance(d.name, str) and d.name)
    if physical:
        bus = d.pci_bus_id
        assert bus is NA or re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", bus), bus
    mem = d.memory_info
    assert isinstance(mem, nvml.MemoryInfo)
    for v in mem:
        _int_or_na(v, 0, 1 << 50, "memory")
    if isinstance(mem.total, int) and isinstance(mem.used, int):
        assert mem.used <= mem.total and d.memory_total == mem.total
    util = d.utilization
    assert isinstance(util, nvml.Utilization)
    _int_or_na(util.gpu, 0, 100, "utilization.gpu")
    _int_or_na(util.memory, 0, 100, "utilization.memory")
    _int_or_na(d.power_usage_mw, 0, 5_000_000, "power.draw mW")
    _int_or_na(d.enforced_power_limit_mw, 0, 5_000_000, "enforced.power.limit mW")
    _int_or_na(d.power_management_limit_mw, 0, 5_000_000, "power.limit mW")
    _int_or_na(d.temperature_c, -40, 150, "temperature.gpu")
    for clk in (d.sm_clock_mhz, d.memory_clock_mhz, d.graphics_clock_mhz):
        _int_or_na(clk, 0, 10_000, "clock MHz")
    _int_or_na(d.clocks_event_reasons, 0, (1 << 64) - 1, "clocks_event_reasons")
    for counter in (nvml.PCIE_UTIL_TX_BYTES, nvml.PCIE_UTIL_RX_BYTES):
        _int_or_na(d.pcie_throughput_kbs(counter), 0, 1 << 40, "pcie KB/s")
    _int_or_na(d.pcie_link_gen, 1, 7, "pcie.link.gen.current")
    _int_or_na(d.pcie_link_gen_max, 1, 7, "pcie.link.gen.max")
    for w in (d.pcie_link_width, d.pcie_link_width_max):
        assert w is NA or w in (1, 2, 4, 8, 16, 32), w
    for unc in (False, True):
        _int_or_na(d.ecc_errors_total(uncorrected=unc), 0, 1 << 62, "ecc")
    rows = d.remapped_rows
    assert rows is NA or (isinstance(rows, nvml.RemappedRows) and rows.correctable >= 0)
    procs = d.compute_processes()
    assert procs is NA or all(isinstance(p, nvml.GpuProcess) and p.pid > 0 for p in procs)
    aff = d.cpu_affinity(ncpus)
    assert aff is NA or (isinstance(aff, frozenset) and all(0 <= c < max(64, ncpus + 63)
                                                           for c in aff))
    _int_or_na(d.numa_node_id, 0, 1 << 16, "numa node")
    _int_or_na(d.mig_mode, 0, 1, "mig.mode.current")
    _int_or_na(d.persistence_mode, 0, 1, "persistence_mode")
    _int_or_na(d.compute_mode, 0, 3, "compute_mode")
    for link in range(min(d.max_nvlinks, 2)):
        assert d.nvlink_active(link) in (NA, True, False)
        _int_or_na(d.nvlink_remote_device_type(link), 0, 3, "nvlink remote type")
    for m in d.mig_devices():
        assert m.parent is d
        check_device(m, ncpus, physical=False)


def test_every_backend_answers_the_same_interface(backend: nvml.Backend) -> None:
    devs = backend.devices()
    assert devs and [d.index for d in devs] == sorted({d.index for d in devs})
    for d in devs:
        check_device(d, ncpus=1024)
    if len(devs) > 1:
        lvl = devs[0].common_ancestor(devs[1])
        assert lvl is NA or lvl in PCIE_LEVELS
    for v in (backend.driver_version, backend.nvml_version):
        assert v is NA or (isinstance(v, str) and re.match(r"\d+\.\d+", v)), v
    _int_or_na(backend.cuda_driver_version, 1000, 99_990, "cuda driver version")
    watch = backend.xid_watch(devs)
    assert watch is NA or all(isinstance(e, nvml.XidEvent) for e in watch.poll(4))


def test_a_node_without_gpus_is_na_everywhere() -> None:
    b, d = nvml.Backend(), nvml.Device(0)
    assert b.devices() == [] and b.driver_version is NA and b.xid_watch([]) is NA
    check_device(d, ncpus=4)
    assert d.uuid is NA and d.memory_info == (NA, NA, NA) and not d.mig_devices()
    assert repr(NA) == str(NA) == "N/A" and not NA
    with pytest.raises(nvml.NvmlError) as ei:
        d.set_power_limit_mw(300_000)
    assert ei.value.code == nvml.ERROR_NOT_SUPPORTED


def test_replayed_telemetry_reads_in_units_through_the_real_adapter() -> None:
    """The h100x2 recording through NvmlBackend: the numbers and units nvidia-smi shows."""
    rec = TelemetryReplay()
    g0, g1 = nvml.NvmlBackend(rec).devices()
    assert g0.uuid == "GPU-5b3a9a1e-6f0c-2d4e-8a31-0c1f7d2e9b10"
    assert g0.memory_info == (85520809984, 71243776000, 14277033984)
    assert g0.utilization == (97, 41) and g0.power_usage_mw == 612345
    assert (g0.temperature_c, g0.sm_clock_mhz) == (67, 1980)
    assert g1.clocks_event_reasons == 0x24  # sw_power_cap | sw_thermal
    assert g1.pcie_throughput_kbs(nvml.PCIE_UTIL_TX_BYTES) is NA  # NOT_SUPPORTED in the record
    assert g0.remapped_rows == nvml.RemappedRows(1, 0, False, False)
    assert g1.compute_processes() == [nvml.GpuProcess(4243, 39728447488),
                                      nvml.GpuProcess(4244, NA)]
    assert nvml.NvmlBackend(rec).cuda_driver_version == 12040


def test_a_snapshot_with_a_recording_answers_both(tmp_path: Path) -> None:
    """Locality from the snapshot, readings from the recording (GPU i: record i mod n)."""
    b = RecordedNvml(fixture("dgx-h100.json"), TELEMETRY)
    devs = b.devices()
    assert len(devs) == 8 and b.driver_version == "550.54.15"
    assert b.cuda_driver_version == 12040
    assert [d.temperature_c for d in devs[:3]] == [67, 88, 67]
    assert devs[1].clocks_event_reasons == 0x24 and devs[0].power_usage_mw == 612345
    assert devs[0].memory_clock_mhz is NA  # the h100x2 recording has no memory clock
    assert devs[0].cpu_affinity(224) == fixture("dgx-h100.json").gpus[0].local_cpus
    bad = tmp_path / "x.json"
    bad.write_text('{"gpus": []}')
    with pytest.raises(UsageError, match=r"x\.json: not an NVML recording"):
        RecordedNvml(fixture("dgx-h100.json"), bad)


# -- 3. versioned fallbacks and error codes ------------------------------------------
class _Lib(SimpleNamespace):
    """A driver older than the pynvml in use: the _v3 symbol is missing in libnvidia-ml."""

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: Any) -> Any:
        raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: Any) -> Any:
        return [SimpleNamespace(pid=7, usedGpuMemory=5)]

    def nvmlDeviceGetPowerUsage(self, h: Any) -> Any:
        raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)

    def nvmlDeviceSetPowerManagementLimit(self, h: Any, mw: int) -> None:
        raise nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)

    def nvmlDeviceSetComputeMode(self, h: Any, mode: int) -> None:
        # the message is not what tells errors apart: a lying one changes nothing
        raise type(nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT))("Insufficient Permissions")

    nvmlMemory_v2 = 0x02000028

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: int | None = None) -> Any:
        if version and h == "old-driver":  # no nvmlDeviceGetMemoryInfo_v2 symbol
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        reserved = 0 if version else 512 << 20  # v1 counts the driver's reserved memory
        return SimpleNamespace(total=8 << 30, used=(1 << 30) + reserved,
                               free=(7 << 30) - reserved)

    def nvmlEventSetCreate(self) -> str:
        return "es"

    def nvmlEventSetWait_v2(self, es: str, ms: int) -> Any:
        raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)


def test_versioned_fallback_and_errors_by_code() -> None:
    b = nvml.NvmlBackend(_Lib())
    d = nvml.NvmlDevice(b, "h0", 0)
    assert d.compute_processes() == [nvml.GpuProcess(7, 5)]  # _v3 not found -> _v2
    assert d.memory_info.used == 1 << 30  # the v2 struct: as nvidia-smi's memory.used
    assert nvml.NvmlDevice(b, "old-driver", 1).memory_info.used == (1 << 30) + (512 << 20)
    assert b.attempt(("nvmlDeviceGetPowerUsage",), "h0") == (NA, nvml.ERROR_GPU_IS_LOST)
    assert d.power_usage_mw is NA and d.temperature_c is NA  # missing function: NA too
    assert b.attempt(("nvmlNoSuchFunction",)) == (NA, nvml.ERROR_FUNCTION_NOT_FOUND)
    with pytest.raises(nvml.NvmlError) as ei:
        d.set_power_limit_mw(1)
    assert ei.value.code == nvml.ERROR_NO_PERMISSION and "root" in str(ei.value)
    with pytest.raises(nvml.NvmlError) as ei:
        d.set_compute_mode(3)
    assert ei.value.code == nvml.ERROR_INVALID_ARGUMENT and "root" not in str(ei.value)
    watch = b.xid_watch([d])
    assert not isinstance(watch, nvml.NotAvailable) and watch.poll() == []  # TIMEOUT: none


def test_nvml_starts_lazily_and_once(nvml_backend: Any) -> None:
    """The GPUs are enumerated on the first reading that needs them, and only once."""
    starts: list[int] = []

    class Counting(TelemetryReplay):
        def nvmlDeviceGetCount(self) -> int:
            starts.append(1)
            return super().nvmlDeviceGetCount()

    nvml_backend(Counting())
    assert starts == []
    assert nvml.device_count() == 2 and len(nvml.devices()) == 2 and nvml.device(1) is not NA
    assert starts == [1] and nvml.device(5) is NA
