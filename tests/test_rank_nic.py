"""Each rank's NIC ([nccl] per_rank_nic) on the replayed DGX H100: tunerctl env
--local-rank N, tunerctl run and tunerd.torch.export_nccl_env name the rank's GPU's NIC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, run_ctl, write_policy

DGX = Path(__file__).parent / "fixtures" / "topologies" / "dgx-h100.json"
POLICY = ('[policy]\nname = "nic"\n\n[nccl]\nper_rank_nic = true\n'
          'NCCL_IB_TIMEOUT = 22\n')


def _daemon(daemon_factory, tmp_path: Path, policy: str = POLICY,  # type: ignore[no-untyped-def]
            snap: Path = DGX):
    pdir = tmp_path / "policies"
    write_policy(pdir, "00-nic.toml", policy)
    return daemon_factory(policy_dir=pdir, args=["--topology", str(snap)]).start()


def _clean_env() -> dict[str, str]:
    # CUDA_VISIBLE_DEVICES="" would hide every GPU (a rank then has none: exit 2); the
    # module fixture below removes the variable instead
    return {k: "" for k in ("NCCL_IB_HCA", "UCX_NET_DEVICES", "LOCAL_RANK")}


@pytest.fixture(autouse=True)
def _no_cvd(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("snap", ["dgx-h100.json", "dgx-b200.json"])  # hgx-h200: dgx-h100's NICs
def test_env_local_rank_exports_each_ranks_nic(daemon_factory, tmp_path: Path,
                                               snap: str) -> None:
    d = _daemon(daemon_factory, tmp_path, snap=DGX.parent / snap)
    for rank in range(8):
        r = run_ctl("--socket", str(d.socket), "env", "--local-rank", str(rank),
                    env=_clean_env())
        assert r.rc == 0, r.err
        assert f"export NCCL_IB_HCA==mlx5_{rank}:1" in r.out
        assert f"export UCX_NET_DEVICES=mlx5_{rank}:1" in r.out
        assert "export NCCL_IB_TIMEOUT=22" in r.out
    # a numeric CUDA_VISIBLE_DEVICES maps the local rank to its GPU
    r = run_ctl("--socket", str(d.socket), "--json", "env", "--local-rank", "1",
                env={**_clean_env(), "CUDA_VISIBLE_DEVICES": "5,6"})
    data = json.loads(r.out)
    assert data["nic_env"]["NCCL_IB_HCA"] == "=mlx5_6:1"
    assert data["nics"][0]["tier"] == "switch"
    assert "per_rank_nic" not in data["nccl"]  # never written to nccl.conf


def test_without_per_rank_nic_nothing_is_named(daemon_factory, tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path, '[policy]\nname = "x"\n')
    r = run_ctl("--socket", str(d.socket), "--json", "env", "--local-rank", "0",
                env=_clean_env())
    assert json.loads(r.out)["nic_env"] == {}


def test_run_exports_the_lease_gpus_nic_and_keeps_the_jobs_own(daemon_factory,
                                                               tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path)
    show = ["sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES|$NCCL_IB_HCA|$UCX_NET_DEVICES"']
    env = {k: v for k, v in os.environ.items()
           if k not in ("NCCL_IB_HCA", "UCX_NET_DEVICES")}
    p = subprocess.run([sys.executable, "-m", "tunerd.cli.main", "--socket", str(d.socket),
                        "run", "--gpus", "1", "--", *show], capture_output=True, text=True,
                       timeout=60, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr
    gpu, hca, ucx = p.stdout.strip().split("|")
    assert hca == f"=mlx5_{gpu}:1" and ucx == f"mlx5_{gpu}:1"
    p = subprocess.run([sys.executable, "-m", "tunerd.cli.main", "--socket", str(d.socket),
                        "run", "--gpus", "1", "--", *show], capture_output=True, text=True,
                       timeout=60, cwd=REPO, env={**env, "NCCL_IB_HCA": "mine"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().split("|")[1] == "mine"


def test_export_nccl_env_sets_the_ranks_nic_before_init(daemon_factory, tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path)
    code = ("import json, os, sys; from tunerd.torch.ncclenv import export_nccl_env; "
            "done = export_nccl_env(sys.argv[1], local_rank=4); "
            "print(json.dumps([done, os.environ.get('NCCL_IB_HCA'), "
            "os.environ.get('UCX_NET_DEVICES')]))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("NCCL_IB_HCA", "UCX_NET_DEVICES", "CUDA_VISIBLE_DEVICES")}
    p = subprocess.run([sys.executable, "-c", code, str(d.socket)], capture_output=True,
                       text=True, timeout=60, cwd=REPO, env={**env, "UCX_NET_DEVICES": "x"})
    assert p.returncode == 0, p.stderr
    done, hca, ucx = json.loads(p.stdout)
    assert hca == "=mlx5_4:1" and done["NCCL_IB_HCA"] == "=mlx5_4:1"
    assert ucx == "x" and "UCX_NET_DEVICES" not in done  # the job's own value wins


# -- issue 33 item 2: one GPU resolver for the rank's NIC; item 4: the rank's slice ----------
def _uuid(index: int) -> str:
    gpus = json.loads(DGX.read_text())["gpus"]
    return str(next(g["uuid"] for g in gpus if g["index"] == index))


def _slice(index: int) -> str:
    from tunerd.base.cpulist import format_cpulist
    from tunerd.topology.model import Topology
    from tunerd.topology.nodemap import node_map

    return format_cpulist(node_map(Topology.from_json(json.loads(DGX.read_text())))
                          .slice_cpus((index,)))


def _env(d, rank: int, **env: str):  # type: ignore[no-untyped-def]
    return run_ctl("--socket", str(d.socket), "env", "--local-rank", str(rank),
                   env={**_clean_env(), **env})


def test_env_resolves_a_uuid_to_that_gpus_nic_and_slice(daemon_factory, tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path)
    uuid5 = _uuid(5)
    for cvd in (uuid5, uuid5[:12], f"{_uuid(2)},{uuid5}"):
        rank = 1 if "," in cvd else 0
        r = _env(d, rank, CUDA_VISIBLE_DEVICES=cvd)
        assert r.rc == 0, r.err
        assert "export NCCL_IB_HCA==mlx5_5:1" in r.out, (cvd, r.out)
        cpus = _slice(5)
        assert f"export TUNERD_RANK_CPUS={cpus}" in r.out
        from tunerd.base.cpulist import parse_cpulist

        assert f"export OMP_NUM_THREADS={len(parse_cpulist(cpus))}\n" in r.out + "\n"
    assert _slice(5) != _slice(0)


def test_env_names_what_it_cannot_resolve_never_gpu_0(daemon_factory, tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path)
    bad = "GPU-deadbeef-0000-4000-8000-000000000000"
    r = _env(d, 0, CUDA_VISIBLE_DEVICES=bad)
    assert r.rc == 2 and bad in r.err and "export" not in r.out, (r.rc, r.out, r.err)
    r = _env(d, 3, CUDA_VISIBLE_DEVICES="0,1")
    assert r.rc == 2 and "local rank 3" in r.err and "'0,1'" in r.err, (r.rc, r.out, r.err)
    assert "mlx5" not in r.out
    r = _env(d, 8)  # the node has 8 GPUs: rank 8 has none
    assert r.rc == 2 and "local rank 8" in r.err
    r = _env(d, 0, CUDA_VISIBLE_DEVICES="GPU-0000")  # a prefix of all eight
    assert r.rc == 2 and "ambiguous" in r.err


def test_env_under_a_renumbered_slurm_grant_names_the_granted_gpus_nic(
        daemon_factory, tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path)
    slurm = {"SLURM_JOB_ID": "12", "SLURM_STEP_GPUS": "1", "CUDA_VISIBLE_DEVICES": "0"}
    r = _env(d, 0, **slurm)
    assert r.rc == 0, r.err
    assert "export NCCL_IB_HCA==mlx5_1:1" in r.out
    assert f"export TUNERD_RANK_CPUS={_slice(1)}" in r.out
    # a job given GPUs 6,7 sees 0,1: local rank 1 is GPU 7; rank 2 is past its GPUs
    slurm = {"SLURM_JOB_ID": "12", "SLURM_JOB_GPUS": "6,7", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert "export NCCL_IB_HCA==mlx5_7:1" in _env(d, 1, **slurm).out
    assert _env(d, 2, **slurm).rc == 2
    # a UUID outside the grant is named
    r = _env(d, 0, SLURM_JOB_ID="12", SLURM_STEP_GPUS="1", CUDA_VISIBLE_DEVICES=_uuid(5))
    assert r.rc == 2 and "grant" in r.err


def test_export_nccl_env_resolves_uuids_and_the_grant(daemon_factory, tmp_path: Path) -> None:
    d = _daemon(daemon_factory, tmp_path)
    code = ("import json, os, sys; from tunerd.torch.ncclenv import export_nccl_env; "
            "done = export_nccl_env(sys.argv[1], local_rank=0); print(json.dumps(done))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("NCCL_IB_HCA", "UCX_NET_DEVICES", "OMP_NUM_THREADS", "SLURM_JOB_ID",
                        "TUNERD_RANK_CPUS", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")}

    def run(**more: str) -> tuple[dict[str, str], str]:
        p = subprocess.run([sys.executable, "-c", code, str(d.socket)], capture_output=True,
                           text=True, timeout=60, cwd=REPO, env={**env, **more})
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout), p.stderr

    done, _ = run(CUDA_VISIBLE_DEVICES=_uuid(5))
    assert done["NCCL_IB_HCA"] == "=mlx5_5:1" and done["TUNERD_RANK_CPUS"] == _slice(5)
    done, _ = run(CUDA_VISIBLE_DEVICES="0", SLURM_JOB_ID="7", SLURM_STEP_GPUS="3")
    assert done["NCCL_IB_HCA"] == "=mlx5_3:1" and done["TUNERD_RANK_CPUS"] == _slice(3)
    done, err = run(CUDA_VISIBLE_DEVICES="GPU-feedface")
    assert done == {} and "GPU-feedface" in err
    done, _ = run(CUDA_VISIBLE_DEVICES=_uuid(5), OMP_NUM_THREADS="3")
    assert "OMP_NUM_THREADS" not in done  # the job's own value wins
