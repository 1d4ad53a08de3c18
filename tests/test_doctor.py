"""tunerctl doctor: run for real here (no GPU), on temporary trees, and on NVML replay."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, run_ctl
from tests.monitor_helpers import TelemetryReplay
from tunerd.adapters import nvml
from tunerd.diagnose import doctor
from tunerd.diagnose.doctor import Env

GPU_CHECKS = {"nvidia-driver", "torch", "torch-cuda", "cuda-version", "cudnn", "nccl"}


def test_doctor_runs_here_and_skips_gpu_checks_with_reasons(tmp_path: Path) -> None:
    # the human run at the same time as the JSON one (doctor only reads): one torch probe's
    # time instead of two
    with subprocess.Popen([sys.executable, "-m", "tunerd.cli.main", "doctor",
                           "--data-dir", str(tmp_path), "--python", sys.executable],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=REPO) as human_p:
        r = run_ctl("--json", "doctor", "--data-dir", str(tmp_path), "--python", sys.executable)
        rep = json.loads(r.out)
        assert r.rc == (1 if rep["summary"]["FAIL"] else 0), r.err
        checks = {c["id"]: c for c in rep["checks"]}
        assert set(checks) >= GPU_CHECKS
        assert {"pcie-acs", "iommu", "data-fs", "data-device", "nofile", "numa-balancing",
                "cpu-governor", "nccl-mtu", "cuda-toolkit", "libcudart",
                "training-python"} <= set(checks)
        assert checks["training-python"]["status"] == "PASS"
        assert checks["training-python"]["data"]["python"] == sys.executable
        assert checks["training-python"]["data"]["found_by"] == "--python"
        for c in rep["checks"]:
            assert set(c) == {"id", "title", "status", "evidence", "fix", "data"}
            assert c["status"] in ("PASS", "WARN", "FAIL", "SKIP") and c["evidence"]
            if c["status"] in ("WARN", "FAIL"):
                assert c["fix"], c
        # no GPU on this machine: skipped, saying why
        assert checks["nvidia-driver"]["status"] == "SKIP"
        assert "no NVIDIA GPU" in checks["nvidia-driver"]["evidence"]
        # --python is this interpreter: whether it has torch is asked here, without a second
        # interpreter importing torch (~3 s)
        has_torch = importlib.util.find_spec("torch") is not None
        if has_torch:  # CI installs the CPU build: it imports, and CUDA is skipped, with a reason
            assert checks["torch"]["status"] == "PASS"
            assert checks["torch-cuda"]["status"] == "SKIP" and checks["torch-cuda"]["evidence"]
            assert checks["cuda-version"]["status"] == "SKIP"
        else:
            assert checks["torch"]["status"] == "SKIP"
            assert "torch is not installed" in checks["torch"]["evidence"]
        assert sum(rep["summary"].values()) == len(rep["checks"])
        human_out, _ = human_p.communicate(timeout=60)
        assert "SKIP  NVIDIA driver and NVML" in human_out and "PASS" in human_out


def _fake_python(d: Path) -> Path:
    """A real interpreter under another directory: a python3 symlink to this one."""
    d.mkdir(parents=True, exist_ok=True)
    exe = d / "python3"
    exe.symlink_to(sys.executable)
    return exe


def test_training_python_is_found_on_path_but_never_in_tunerds_own_venv(tmp_path: Path) -> None:
    own = tmp_path / "opt-tunerd"
    _fake_python(own / "bin")
    job = _fake_python(tmp_path / "conda/bin")
    env = {"PATH": f"{own / 'bin'}:{tmp_path / 'empty'}:{job.parent}"}
    found = doctor.find_training_python(None, env, tmp_path / "no.toml", own_prefix=str(own))
    assert found.path == str(job) and found.how == "python3 on PATH"
    assert any("tunerd's own venv" in n for n in found.notes)
    # --python wins over everything, and a bare name is looked up on PATH
    explicit = doctor.find_training_python("python3", {"PATH": str(job.parent)},
                                           own_prefix=str(own))
    assert explicit.path == str(job) and explicit.how == "--python"


def test_training_python_falls_back_to_job_python_in_the_config(tmp_path: Path) -> None:
    job = _fake_python(tmp_path / "venv/bin")
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text(f'job_python = "{job}"\n')
    found = doctor.find_training_python(None, {"PATH": str(tmp_path / "nothing")}, cfg,
                                        own_prefix=str(tmp_path / "own"))
    assert found.path == str(job) and found.how == f"job_python in {cfg}"
    # a relative path, which the daemon's config check refuses, is not used either
    cfg.write_text('job_python = "venv/bin/python3"\n')
    rel = doctor.find_training_python(None, {"PATH": ""}, cfg, own_prefix="/nonexistent")
    assert rel.path is None and (f"{cfg}: job_python must be an absolute path, got "
                                 "'venv/bin/python3'") in rel.notes
    cfg.write_text("verify_interval = 5.0\n")
    none = doctor.find_training_python(None, {"PATH": ""}, cfg, own_prefix="/nonexistent")
    assert none.path is None and f"no job_python in {cfg}" in none.notes
    c = doctor.check_python(Env(python=None, python_notes=none.notes))
    assert c.status == "SKIP" and "no training Python found" in c.evidence
    assert {x.status for x in doctor.check_torch(Env(python=None))} == {"SKIP"}


def test_doctor_cli_says_which_python_it_checked_and_how(tmp_path: Path) -> None:
    job = _fake_python(tmp_path / "jobs/bin")
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text(f'job_python = "{job}"\n')
    # no python3 on PATH (tunerctl runs by its full path): the config's job_python is used
    r = run_ctl("doctor", "--json", "--data-dir", str(tmp_path), "--config", str(cfg),
                env={"PATH": str(tmp_path / "empty")})
    checks = {c["id"]: c for c in json.loads(r.out)["checks"]}
    py = checks["training-python"]
    assert py["status"] == "PASS", py
    assert py["data"]["python"] == str(job) and py["data"]["found_by"] == f"job_python in {cfg}"
    assert str(job) in py["evidence"] and "job_python in" in py["evidence"]
    assert str(job) in checks["torch"]["evidence"]  # torch was probed in that interpreter
    r = run_ctl("doctor", "--data-dir", str(tmp_path), "--config", str(cfg),
                env={"PATH": str(job.parent)})
    assert f"Training Python: checked {job}" in r.out and "found by python3 on PATH" in r.out
    r = run_ctl("doctor", "--data-dir", str(tmp_path), "--python", str(tmp_path / "nope"))
    assert r.rc == 1 and "FAIL  Training Python:" in r.out


def test_driver_check_passes_on_replayed_nvml(nvml_backend: None) -> None:
    nvml.set_backend(TelemetryReplay())
    c = doctor.check_driver(Env())
    assert c.status == "PASS"
    assert c.evidence == "driver 550.54.15, NVML 12.550.54.15, CUDA driver API 12.4, 2 GPUs"


def test_driver_check_fails_when_nvidia_hardware_has_no_driver(nvml_backend: None,
                                                               tmp_path: Path) -> None:
    nvml.set_backend(None, "libnvidia-ml.so not found")
    dev = tmp_path / "sys/bus/pci/devices/0000:18:00.0"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x10de\n")
    (dev / "class").write_text("0x030200\n")
    c = doctor.check_driver(Env(sys_root=tmp_path / "sys"))
    assert c.status == "FAIL" and "0000:18:00.0" in c.evidence and c.fix


@pytest.mark.parametrize(("torch_cuda", "driver", "status"), [
    ("12.1", 12040, "PASS"), ("12.4", 12040, "PASS"), ("12.6", 12040, "WARN"),
    ("13.0", 12040, "FAIL"), (None, 12040, "SKIP"), ("12.1", None, "SKIP")])
def test_cuda_version_compatibility(torch_cuda: str | None, driver: int | None,
                                    status: str) -> None:
    assert doctor.check_cuda_versions(torch_cuda, driver).status == status


def test_torch_probe_never_hangs(tmp_path: Path) -> None:
    slow = tmp_path / "python"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    env = Env(python=str(slow), torch_timeout=0.5)
    [c] = doctor.check_torch(env)
    assert c.status == "FAIL" and "did not finish in 0.5 s" in c.evidence
    missing = Env(python=str(tmp_path / "nope"))
    assert {c.status for c in doctor.check_torch(missing)} == {"SKIP"}


def test_torch_checks_with_a_real_torch_if_installed() -> None:
    py = os.environ.get("TUNERD_TEST_TORCH_PYTHON", sys.executable)
    if py == sys.executable:  # this interpreter: asked here, not by importing torch in another
        has_torch = importlib.util.find_spec("torch") is not None
    else:
        has_torch = os.path.exists(py) and subprocess.run(
            [py, "-c", "import torch"], capture_output=True).returncode == 0
    if not has_torch:
        pytest.skip(f"no Python with torch at {py} (set TUNERD_TEST_TORCH_PYTHON)")
    checks = {c.id: c for c in doctor.check_torch(Env(python=py))}
    assert checks["torch"].status == "PASS" and checks["torch"].data["version"]
    if not nvml.available():
        assert checks["torch-cuda"].status == "SKIP"


def _net(root: Path, name: str, mtu: int, physical: bool = True) -> None:
    d = root / "class/net" / name
    d.mkdir(parents=True)
    (d / "mtu").write_text(f"{mtu}\n")
    if physical:
        (d / "device").mkdir()


def test_nccl_mtu(tmp_path: Path) -> None:
    sys_, etc = tmp_path / "sys", tmp_path / "etc"
    etc.mkdir()
    _net(sys_, "ens1f0", 1500)
    _net(sys_, "ens1f1", 9000)
    _net(sys_, "lo", 65536, physical=False)
    assert doctor.check_nccl_mtu(Env(sys_root=sys_, etc_root=etc, environ={})).status == "SKIP"
    (etc / "nccl.conf").write_text("NCCL_DEBUG=INFO\nNCCL_SOCKET_IFNAME=ens\n")
    c = doctor.check_nccl_mtu(Env(sys_root=sys_, etc_root=etc, environ={}))
    assert c.status == "WARN" and "ens1f0 mtu 1500" in c.evidence and "ens1f0" in c.fix
    ok = doctor.check_nccl_mtu(Env(sys_root=sys_, etc_root=etc,
                                   environ={"NCCL_SOCKET_IFNAME": "=ens1f1"}))
    assert ok.status == "PASS" and "env NCCL_SOCKET_IFNAME" in ok.evidence
    none = doctor.check_nccl_mtu(Env(sys_root=sys_, etc_root=etc,
                                     environ={"NCCL_SOCKET_IFNAME": "=ib0"}))
    assert none.status == "FAIL" and "matches no interface" in none.evidence


def test_match_ifnames_follows_nccl_syntax() -> None:
    names = ["docker0", "ens1f0", "ens1f1", "eth0", "lo"]
    assert doctor.match_ifnames("ens", names) == ["ens1f0", "ens1f1"]
    assert doctor.match_ifnames("=ens1f1,eth0", names) == ["ens1f1", "eth0"]
    assert doctor.match_ifnames("^docker,lo", names) == ["ens1f0", "ens1f1", "eth0"]
    assert doctor.match_ifnames("^=ens1f0", names) == ["docker0", "ens1f1", "eth0", "lo"]


def test_governor_numa_balancing_iommu_on_trees(tmp_path: Path) -> None:
    sys_, proc = tmp_path / "sys", tmp_path / "proc"
    for cpu, gov in ((0, "performance"), (1, "powersave")):
        d = sys_ / f"devices/system/cpu/cpu{cpu}/cpufreq"
        d.mkdir(parents=True)
        (d / "scaling_governor").write_text(gov + "\n")
    g = doctor.check_governor(Env(sys_root=sys_))
    assert g.status == "WARN" and "powersave on 1 CPU" in g.evidence
    assert "performance on 1 CPU" in g.evidence
    assert doctor.check_governor(Env(sys_root=tmp_path / "none")).status == "SKIP"
    (proc / "sys/kernel").mkdir(parents=True)
    (proc / "sys/kernel/numa_balancing").write_text("1\n")
    for n in (0, 1):
        (sys_ / f"devices/system/node/node{n}").mkdir(parents=True)
    assert doctor.check_numa_balancing(Env(proc_root=proc, sys_root=sys_)).status == "WARN"
    (sys_ / "devices/system/node/node1").rmdir()
    one = doctor.check_numa_balancing(Env(proc_root=proc, sys_root=sys_))
    assert one.status == "PASS" and "one NUMA node" in one.evidence
    (sys_ / "class/iommu/dmar0").mkdir(parents=True)
    (proc / "cmdline").write_text("ro quiet intel_iommu=on\n")
    assert doctor.check_iommu(Env(sys_root=sys_, proc_root=proc)).status == "WARN"
    (proc / "cmdline").write_text("ro quiet intel_iommu=on iommu=pt\n")
    assert doctor.check_iommu(Env(sys_root=sys_, proc_root=proc)).status == "PASS"


def test_data_dir_filesystem_and_device(tmp_path: Path) -> None:
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    data = tmp_path / "data"
    data.mkdir()
    (proc / "self").mkdir(parents=True)
    (proc / "self/mountinfo").write_text(
        "22 1 0:21 / / rw - overlay overlay rw\n"
        f"30 22 259:1 / {tmp_path} rw,relatime - xfs /dev/nvme0n1p1 rw\n")
    disk = sys_ / "devices/pci/nvme/nvme0n1"
    (disk / "nvme0n1p1").mkdir(parents=True)
    (disk / "nvme0n1p1/partition").write_text("1\n")
    (disk / "queue").mkdir()
    (disk / "queue/rotational").write_text("0\n")
    (sys_ / "dev/block").mkdir(parents=True)
    (sys_ / "dev/block/259:1").symlink_to(disk / "nvme0n1p1")
    fs, dev = doctor.check_data_fs(Env(proc_root=proc, sys_root=sys_, data_dir=data))
    assert (fs.status, dev.status) == ("PASS", "PASS")
    assert "xfs" in fs.evidence and "nvme0n1 (NVMe)" in dev.evidence
    (disk / "queue/rotational").write_text("1\n")
    (proc / "self/mountinfo").write_text(f"30 1 259:1 / {tmp_path} rw - nfs4 srv:/x rw\n")
    fs, dev = doctor.check_data_fs(Env(proc_root=proc, sys_root=sys_, data_dir=data))
    assert (fs.status, dev.status) == ("WARN", "WARN")
    [missing] = doctor.check_data_fs(Env(data_dir=tmp_path / "absent"))
    assert missing.status == "FAIL"


def test_data_dir_mount_found_past_64_kib_of_mountinfo(tmp_path: Path) -> None:
    """A host with thousands of mounts (containers, Kubernetes volumes): the mount that
    holds the data directory may come after the first 64 KiB of mountinfo."""
    proc, data = tmp_path / "proc", tmp_path / "data"
    data.mkdir()
    (proc / "self").mkdir(parents=True)
    filler = "".join(f"{100 + i} 22 0:{50 + i} / /run/containers/storage/overlay/{i:05d}/"
                     f"merged rw,relatime - overlay overlay rw,lowerdir=/l{i}\n"
                     for i in range(1500))
    text = (f"22 1 0:21 / / rw - overlay overlay rw\n{filler}"
            f"30 22 259:1 / {tmp_path} rw,relatime - xfs /dev/nvme0n1p1 rw\n")
    assert len(text) > 1 << 16
    (proc / "self/mountinfo").write_text(text)
    assert doctor.find_mount(Env(proc_root=proc), data) == (str(tmp_path), "xfs", "259:1")


def test_nccl_conf_read_whole(tmp_path: Path) -> None:
    (tmp_path / "nccl.conf").write_text("# padding\n" * 8000 + "NCCL_SOCKET_IFNAME=ens\n")
    assert doctor.nccl_ifname(Env(etc_root=tmp_path, environ={})) == (
        "ens", f"{tmp_path}/nccl.conf")


def test_acs_register_decoding() -> None:
    assert doctor.acs_source_validation("001d\n") is True
    assert doctor.acs_source_validation("0000") is False
    assert doctor.acs_source_validation("") is None
    assert doctor.acs_source_validation("Capability not found") is None
    lspci = ("00:01.0 PCI bridge: PLX Technology, Inc. PEX 8747\n"
             "\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+\n"
             "\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+\n")
    assert doctor.acs_from_lspci(lspci) is True
    assert doctor.acs_from_lspci(lspci.replace("ACSCtl:\tSrcValid+", "ACSCtl:\tSrcValid-")) \
        is False
    assert doctor.acs_from_lspci("00:00.0 Host bridge: Intel\n") is None


def test_nofile_check_reads_this_process() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    c = doctor.check_nofile(Env())
    assert c.status == ("WARN" if soft < 65536 else "PASS") and str(soft) in c.evidence


def test_nofile_fix_never_asks_past_the_hard_limit() -> None:
    """A hard limit of 20000 cannot take `ulimit -n 1048576` (issue 29)."""
    import resource

    c = doctor.check_nofile(Env(), limits=(1024, 20000))
    assert c.status == "WARN" and "ulimit -n 1048576" not in c.fix
    assert "hard limit 20000" in c.fix and "only root" in c.fix
    c = doctor.check_nofile(Env(), limits=(1024, 524288))
    assert "`ulimit -n 524288`" in c.fix
    c = doctor.check_nofile(Env(), limits=(1024, resource.RLIM_INFINITY))
    assert "`ulimit -n 1048576`" in c.fix
    assert doctor.check_nofile(Env(), limits=(65536, 65536)).status == "PASS"


def test_read_acs_runs_the_real_pciutils_on_a_device_without_acs() -> None:
    import shutil

    setpci, lspci = shutil.which("setpci"), shutil.which("lspci")
    if setpci is None or not os.path.exists("/sys/bus/pci/devices/0000:00:00.0"):
        pytest.skip("no pciutils or no PCI device 00:00.0 here")
    raw = subprocess.run([lspci or "lspci", "-vvv", "-s", "0000:00:00.0"],
                         capture_output=True, text=True).stdout
    if "ACSCtl" in raw:
        pytest.skip("this host bridge has ACS")
    # a device without the ACS capability: setpci fails, lspci shows no ACSCtl
    assert doctor.read_acs("0000:00:00.0", setpci, lspci) == (None, "unreadable")
