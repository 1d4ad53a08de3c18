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
    return {k: "" for k in ("CUDA_VISIBLE_DEVICES", "NCCL_IB_HCA", "UCX_NET_DEVICES",
                            "LOCAL_RANK")}


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
