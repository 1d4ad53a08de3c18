"""Merging, extends and node matching of policy sets; the bundled policies per node type."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, write_policy
from tunerd.policy import (
    NodeFacts,
    PolicyError,
    bundled_default,
    check_paths,
    json_schema,
    load_policy_dir,
)
from tunerd.policy.render import render_toml
from tunerd.policy.typed import PolicyModel

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BUNDLED = REPO / "policies"
NO_GPU = NodeFacts(hostname="node1")
SECTIONS = {"policy", "sysctl", "nic", "nccl", "block", "limits", "cpu", "vm", "gpu", "job",
            "leases", "irq", "pcie"}
LEASE_DEFAULTS = {"user_exclusive": False, "max_per_user": 64, "alloc_ttl": 86400}


def load(d: Path, facts: NodeFacts = NO_GPU) -> dict:
    return load_policy_dir(d, facts).data


# -- merging -----------------------------------------------------------------
def test_later_file_overrides_key_by_key(tmp_path: Path) -> None:
    write_policy(tmp_path, "10-a.toml", '[sysctl]\n"net.core.rmem_max" = 1\n'
                                        '"net.core.wmem_max" = 2\n[limits]\nnofile = 100\n'
                                        '[vm]\nnuma_balancing = false\n'
                                        'transparent_hugepage = "madvise"\n')
    write_policy(tmp_path, "20-b.toml", '[sysctl]\n"net.core.rmem_max" = 10\n'
                                        '[vm]\ntransparent_hugepage = "never"\n')
    data = load(tmp_path)
    assert data["sysctl"] == {"net.core.rmem_max": 10, "net.core.wmem_max": 2}
    assert data["vm"] == {"numa_balancing": False, "transparent_hugepage": "never"}
    assert data["limits"] == {"nofile": 100}
    assert data["policy"]["names"] == ["10-a", "20-b"]
    assert data["policy"]["name"] == "20-b"


def test_arrays_of_tables_merge_by_match_or_name(tmp_path: Path) -> None:
    write_policy(tmp_path, "10-a.toml",
                 '[[nic]]\nmatch = "ens*"\nmtu = 1500\ntxqueuelen = 5000\n'
                 '[[block]]\nmatch = "nvme*"\nscheduler = "none"\nread_ahead_kb = 128\n'
                 '[[job]]\nname = "t"\nmatch.cmdline = ["*train*"]\nplacement = "node"\n'
                 "nofile = 1000\n")
    write_policy(tmp_path, "20-b.toml",
                 '[[nic]]\nmatch = "ens*"\nmtu = 9000\n'
                 '[[nic]]\nmatch = "ib*"\ntxqueuelen = 100\n'
                 '[[block]]\nmatch = "nvme*"\nread_ahead_kb = 4096\n'
                 '[[job]]\nname = "t"\nplacement = "socket"\nmatch.env = { RANK = "*" }\n'
                 '[[job]]\nname = "u"\nmatch.user = "bob"\n')
    data = load(tmp_path)
    assert data["nic"] == [{"match": "ens*", "mtu": 9000, "txqueuelen": 5000},
                           {"match": "ib*", "txqueuelen": 100}]
    assert data["block"] == [{"match": "nvme*", "scheduler": "none", "read_ahead_kb": 4096}]
    t, u = data["job"]
    assert t == {"name": "t", "placement": "socket", "nofile": 1000,
                 "match": {"cmdline": ["*train*"], "env": {"RANK": "*"}, "user": []}}
    assert u["name"] == "u" and u["placement"] == "gpu-local"
    assert u["match"] == {"cmdline": [], "env": {}, "user": ["bob"]}


def test_apply_once_accumulates(tmp_path: Path) -> None:
    write_policy(tmp_path, "10-a.toml", '[policy]\napply_once = "nic:*:mtu"\n')
    write_policy(tmp_path, "20-b.toml", '[policy]\napply_once = ["sysctl:*", "nic:*:mtu"]\n')
    assert load(tmp_path)["policy"]["apply_once"] == ["nic:*:mtu", "sysctl:*"]


def test_every_section_present(tmp_path: Path) -> None:
    write_policy(tmp_path, "a.toml", "")
    data = load(tmp_path)
    assert set(data) == SECTIONS
    assert data["policy"] == {"name": "a", "names": ["a"], "apply_once": []}
    assert data["nic"] == [] and data["sysctl"] == {} and data["job"] == []
    assert data["leases"] == LEASE_DEFAULTS  # always in force, so always shown


# -- extends -----------------------------------------------------------------
def test_extends_merges_the_base_first_even_if_named_later(tmp_path: Path) -> None:
    write_policy(tmp_path, "10-special.toml", '[policy]\nname = "special"\nextends = ["zbase"]\n'
                                              "[limits]\nnofile = 2048\n")
    write_policy(tmp_path, "90-zbase.toml", '[policy]\nname = "zbase"\n[limits]\n'
                                            'nofile = 1024\n[vm]\nnuma_balancing = false\n')
    p = load_policy_dir(tmp_path, NO_GPU)
    assert p.data["policy"]["names"] == ["zbase", "special"]
    assert [Path(s).name for s in p.sources] == ["90-zbase.toml", "10-special.toml"]
    # the extender wins; the base applying on its own later does not override it
    assert p.data["limits"] == {"nofile": 2048}
    assert p.data["vm"] == {"numa_balancing": False}


def test_extends_ignores_the_bases_own_match(tmp_path: Path) -> None:
    write_policy(tmp_path, "a.toml", '[policy]\nname = "lib"\n[policy.match]\n'
                                     'hostname = "nowhere"\n[limits]\nnofile = 77\n')
    write_policy(tmp_path, "b.toml", '[policy]\nname = "user"\nextends = "lib"\n')
    p = load_policy_dir(tmp_path, NO_GPU)
    assert p.data["policy"]["names"] == ["lib", "user"]
    assert p.data["limits"] == {"nofile": 77}
    assert p.skipped == []
    # a non-matching base that nobody extends is reported as skipped
    write_policy(tmp_path, "b.toml", '[policy]\nname = "user"\n')
    p = load_policy_dir(tmp_path, NO_GPU)
    assert p.data["policy"]["names"] == ["user"]
    assert p.skipped[0]["file"].endswith("a.toml")
    assert "nowhere" in p.skipped[0]["reason"]


def test_extends_chain_and_bundled_fallback(tmp_path: Path) -> None:
    # "base" is not in this directory: extends falls back to the bundled policies
    write_policy(tmp_path, "site.toml", '[policy]\nname = "site"\nextends = ["base"]\n'
                                        "[limits]\nnofile = 4096\n")
    p = load_policy_dir(tmp_path, NO_GPU)
    assert p.data["policy"]["names"] == ["base", "site"]
    assert Path(p.sources[0]).resolve() == (BUNDLED / "00-base.toml").resolve()
    assert p.data["vm"]["numa_balancing"] is False
    assert p.data["limits"]["nofile"] == 4096


@pytest.mark.parametrize(("files", "bad_file", "needle"), [
    ({"a.toml": '[policy]\nname = "a"\nextends = "b"\n',
      "b.toml": '[policy]\nname = "b"\nextends = ["c"]\n',
      "c.toml": '[policy]\nname = "c"\nextends = ["a"]\n'}, "a.toml", "a -> b -> c -> a"),
    ({"a.toml": '[policy]\nname = "a"\n', "b.toml": '[policy]\nname = "a"\n'},
     "b.toml", 'policy.name: "a" is already the name of'),
    ({"a.toml": '[policy]\nname = "a"\nextends = ["a-base"]\n'}, "a.toml",
     'policy.extends[0]: no policy named "a-base"'),
    ({"a.toml": '[[job]]\nname = "ghost"\nplacement = "node"\n'}, "a.toml",
     'job[0].match: missing: no policy defines a rule named "ghost"'),
])
def test_set_errors_name_the_file(tmp_path: Path, files: dict[str, str], bad_file: str,
                                  needle: str) -> None:
    for name, body in files.items():
        write_policy(tmp_path, name, body)
    with pytest.raises(PolicyError) as exc:
        load_policy_dir(tmp_path, NO_GPU)
    errors = exc.value.details["errors"]
    assert any(e.startswith(f"{tmp_path / bad_file}: ") and needle in e for e in errors), errors


def test_job_override_of_a_rule_not_applied_here_is_ignored(tmp_path: Path) -> None:
    write_policy(tmp_path, "a.toml", '[policy.match]\nhostname = "gpu-*"\n'
                                     '[[job]]\nname = "t"\nmatch.cmdline = "*t*"\n')
    write_policy(tmp_path, "b.toml", '[[job]]\nname = "t"\nnofile = 10\n')
    p = load_policy_dir(tmp_path, NO_GPU)
    assert p.data["job"] == []
    assert any("job 't' overrides a rule" in s["reason"] for s in p.skipped)
    p = load_policy_dir(tmp_path, NodeFacts(hostname="gpu-7"))
    assert p.data["job"][0]["nofile"] == 10


# -- matching ----------------------------------------------------------------
@pytest.mark.parametrize(("match", "facts", "applies"), [
    ('hostname = ["gpu-*", "dgx-??"]', NodeFacts("dgx-07"), True),
    ('hostname = ["gpu-*", "dgx-??"]', NodeFacts("dgx-107"), False),
    ('hostname = "dgx-07"', NodeFacts("dgx-07.cluster.example"), True),  # short name
    ('hostname = "DGX-*"', NodeFacts("dgx-07"), True),  # case-insensitive
    ('gpu_model = "*H100*"', NodeFacts("n", ("NVIDIA H100 80GB HBM3",)), True),
    ('gpu_model = "*H100*"', NodeFacts("n", ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 PCIe")),
     True),  # any GPU
    ('gpu_model = "*H100*"', NodeFacts("n", ()), False),
    ('gpu_model = ["*A100*", "*L40S*"]', NodeFacts("n", ("NVIDIA L40S",)), True),
    ("min_gpus = 8", NodeFacts("n", ("X",) * 8), True),
    ("min_gpus = 8", NodeFacts("n", ("X",) * 7), False),
    ("max_gpus = 1", NodeFacts("n", ("X",)), True),
    ("max_gpus = 1", NodeFacts("n", ("X",) * 2), False),
    ('gpu_model = "*H100*"\nmin_gpus = 8', NodeFacts("n", ("NVIDIA H100",) * 4), False),
    ("", NodeFacts("anything"), True),
])
def test_match(tmp_path: Path, match: str, facts: NodeFacts, applies: bool) -> None:
    write_policy(tmp_path, "m.toml", f"[policy.match]\n{match}\n[limits]\nnofile = 5\n")
    p = load_policy_dir(tmp_path, facts)
    assert (p.data["policy"]["names"] == ["m"]) is applies
    assert (p.data["limits"] == {"nofile": 5}) is applies


def test_missing_or_empty_dir_falls_back_to_bundled_default(tmp_path: Path) -> None:
    for d in (tmp_path / "missing", tmp_path):
        (tmp_path / "README").write_text("not a policy")
        (tmp_path / ".#x.toml").write_text("garbage = = =")  # editor lock: hidden, skipped
        p = load_policy_dir(d, NO_GPU)
        assert p.sources == [str(bundled_default())]
        assert p.data["policy"]["name"] == "default"
    assert load_policy_dir(None, NO_GPU).data["policy"]["name"] == "default"


def test_no_file_applies_gives_an_empty_policy_and_a_warning(tmp_path: Path) -> None:
    a = write_policy(tmp_path, "a.toml", '[policy.match]\nmin_gpus = 1\n[limits]\nnofile = 5\n')
    b = write_policy(tmp_path, "b.toml", '[policy.match]\ngpu_model = "*H100*"\nmin_gpus = 8\n'
                                         '[sysctl]\n"net.core.rmem_max" = 1\n')
    p = load_policy_dir(tmp_path, NO_GPU)
    assert p.sources == [] and p.data["limits"] == {} and set(p.data) == SECTIONS
    assert p.model == PolicyModel()  # the empty policy, typed
    (w,) = p.warnings
    assert w.startswith("no policy file matches this node (hostname 'node1', no GPU): "
                        "running with an empty policy"), w
    assert f"{a}: [policy.match] min_gpus = 1 (0 GPU(s), fewer than min_gpus = 1)" in w
    assert (f'{b}: [policy.match] gpu_model = ["*H100*"], min_gpus = 8 (no GPU model matches '
            "['*H100*'] (node has no GPU))") in w
    assert "\n" not in w  # one log line
    assert p.describe() == "none matched: empty policy (2 files skipped)"
    assert p.to_dict()["warnings"] == [w]

    h100 = NodeFacts("dgx-1", ("NVIDIA H100 80GB HBM3",) * 8)
    p = load_policy_dir(tmp_path, h100)
    assert p.warnings == [] and p.describe() == "a, b (2 files)"
    p = load_policy_dir(tmp_path, NodeFacts("dgx-2", ("NVIDIA H100 80GB HBM3",) * 4))
    assert p.warnings == [] and p.describe() == "a (1 file)"  # one file is enough
    # the node facts in the warning: hostname, GPU count and models
    write_policy(tmp_path, "a.toml", '[policy.match]\nmin_gpus = 9\n')
    p = load_policy_dir(tmp_path, NodeFacts("dgx-2", ("NVIDIA H100 80GB HBM3",) * 2
                                            + ("NVIDIA A100",)))
    assert ("(hostname 'dgx-2', 3 GPUs (2x NVIDIA H100 80GB HBM3, 1x NVIDIA A100))"
            in p.warnings[0])


def test_describe_the_policy_in_force(tmp_path: Path) -> None:
    p = load_policy_dir(BUNDLED, NodeFacts("dgx-h100-01", ("NVIDIA H100 80GB HBM3",) * 8))
    assert p.describe() == "base, default, h100-training (3 files)"
    assert load_policy_dir(tmp_path / "missing", NO_GPU).describe() == "default (1 file)"
    assert load_policy_dir(BUNDLED, NO_GPU).warnings == []  # pcie-gpu skipped, others apply


# -- the bundled policies on the recorded node types --------------------------
NODE_TYPES = {
    "dgx-h100": (NodeFacts("dgx-h100-01", ("NVIDIA H100 80GB HBM3",) * 8),
                 ["base", "default", "h100-training"]),
    "l40s-pcie": (NodeFacts("l40s-02", ("NVIDIA L40S",) * 8), ["base", "default", "pcie-gpu"]),
    "grace-hopper": (NodeFacts("gh200-01", ("NVIDIA GH200 480GB",)), ["base", "default"]),
    "gb200-tray": (NodeFacts("gb200-01", ("NVIDIA GB200",) * 4),
                   ["base", "default", "grace-blackwell"]),
    "dgx-b200": (NodeFacts("dgx-b200-01", ("NVIDIA B200",) * 8),
                 ["base", "default", "hgx-training"]),
    "hgx-h200": (NodeFacts("hgx-h200-01", ("NVIDIA H200",) * 8),
                 ["base", "default", "hgx-training"]),
    "epyc-nps4-a100": (NodeFacts("epyc-a100-03", ("NVIDIA A100-SXM4-80GB",) * 8),
                       ["base", "default"]),
    "workstation": (NodeFacts("ws-1", ("NVIDIA RTX 6000 Ada Generation",)),
                    ["base", "default"]),
    "no-gpu": (NodeFacts(), ["base", "default"]),
}


@pytest.mark.parametrize("node", list(NODE_TYPES))
def test_bundled_policies_per_node_type(node: str) -> None:
    facts, names = NODE_TYPES[node]
    p = load_policy_dir(BUNDLED, facts)
    assert p.data["policy"]["names"] == names
    assert p.data["limits"]["nofile"] == 1048576
    assert p.data["vm"]["numa_balancing"] is False
    assert p.data["job"][0]["name"] == "torch-training"
    if "h100-training" in names or "hgx-training" in names:
        assert p.data["sysctl"]["net.core.rmem_max"] == 536870912
        assert p.data["sysctl"]["net.ipv4.tcp_rmem"] == "4096 87380 268435456"
        assert p.data["sysctl"]["net.core.default_qdisc"] == "fq"
        assert p.data["nic"] == [{"match": "en*np*", "mtu": 9000}]
        assert p.data["nccl"]["NCCL_IB_DISABLE"] == 0
    elif "grace-blackwell" in names:  # NVIDIA's Grace guidance (each with its source)
        assert p.data["vm"]["transparent_hugepage"] == "madvise"
        assert p.data["cpu"]["governor"] == "performance"
        assert p.data["nic"] == [{"match": "en*np*", "mtu": 9000}]
    else:
        assert p.data["sysctl"] == {} and p.data["nic"] == []
    if "pcie-gpu" in names:
        assert p.data["nccl"]["NCCL_P2P_LEVEL"] == "PXB"
    # what `policy show` prints parses back to the same policy
    assert tomllib.loads(render_toml(p.data)) == p.data


def test_bundled_default_alone() -> None:
    p = load_policy_dir(bundled_default().parent / "missing-dir", NO_GPU)
    assert p.data["limits"] == {"nofile": 1048576}
    assert p.data["sysctl"] == {} and p.data["nic"] == [] and p.data["nccl"] == {}


def test_check_paths_report(tmp_path: Path) -> None:
    rep = check_paths([BUNDLED], NodeFacts("dgx-h100-01", ("NVIDIA H100 80GB HBM3",) * 8))
    assert [(Path(f["file"]).name, f["name"], f["errors"], f["applies"]) for f in rep["files"]] \
        == [("00-base.toml", "base", [], True), ("00-default.toml", "default", [], True),
            ("00-grace-blackwell.toml", "grace-blackwell", [], False),
            ("00-h100-training.toml", "h100-training", [], True),
            ("00-hgx-training.toml", "hgx-training", [], False),
            ("00-pcie-gpu.toml", "pcie-gpu", [], False)]
    assert rep["effective"]["policy"]["name"] == "h100-training"
    bad = write_policy(tmp_path, "bad.toml", "[limits]\nnofile = 0\n")
    rep = check_paths([bad, tmp_path / "nope.toml", tmp_path / "empty"])
    assert rep["effective"] is None
    assert "limits.nofile" in rep["files"][0]["errors"][0]
    assert "cannot read" in rep["files"][1]["errors"][0]


def test_check_keeps_the_other_files_notes_when_one_fails(tmp_path: Path) -> None:
    """One bad file in a directory: the good ones still say whether they apply to this
    node (and why not), as without it; the bad one has its error and no note."""
    import shutil

    d = tmp_path / "pol"
    shutil.copytree(BUNDLED, d)
    write_policy(d, "50-bad.toml", "[limits]\nnofile = 0\n")
    facts = NodeFacts("dgx-h100-01", ("NVIDIA H100 80GB HBM3",) * 8)
    rows = {Path(f["file"]).name: f for f in check_paths([d], facts)["files"]}
    assert "limits.nofile" in rows["50-bad.toml"]["errors"][0]
    assert "applies" not in rows["50-bad.toml"]
    assert {n: r["applies"] for n, r in rows.items() if n != "50-bad.toml"} == {
        "00-base.toml": True, "00-default.toml": True, "00-h100-training.toml": True,
        "00-pcie-gpu.toml": False, "00-grace-blackwell.toml": False,
        "00-hgx-training.toml": False}
    assert rows["00-pcie-gpu.toml"]["reason"]
    from tunerd.cli.cmd_policy import _human_check

    text = _human_check(check_paths([d], facts))
    assert "00-base.toml (policy 'base', applies to this node)" in text, text
    assert "FAIL" in text


def test_render_toml_round_trips_odd_keys_and_values() -> None:
    data = {"top": 1, "a": {"b c": "x\"y\\z\n", "n": {"deep": [1, 2]}, "f": 1.5, "e": {}},
            "arr": [{"k": {"x": True}, "v": []}, {"k": {}}], "u": "ünï", "empty": []}
    assert tomllib.loads(render_toml(data)) == data


def test_json_schema_describes_every_section() -> None:
    s = json.loads(json.dumps(json_schema()))
    assert s["$schema"].startswith("https://json-schema.org/")
    assert set(s["properties"]) == SECTIONS
    job = s["properties"]["job"]["items"]["properties"]
    assert job["workers"]["minimum"] == 0 and job["workers"]["maximum"] == 1024
    torch = job["torch"]
    assert set(torch["properties"]) == {"num_workers", "pin_memory", "persistent_workers",
                                        "prefetch_factor", "amp", "compile"}
    assert torch["additionalProperties"] is False
    assert torch["properties"]["amp"]["enum"] == ["off", "bf16", "fp16"]
    assert (torch["properties"]["prefetch_factor"]["minimum"],
            torch["properties"]["prefetch_factor"]["maximum"]) == (1, 64)
    leases = s["properties"]["leases"]
    assert leases["properties"]["user_exclusive"]["type"] == "boolean"
    assert leases["properties"]["alloc_ttl"]["minimum"] == 0
    assert leases["additionalProperties"] is False
    assert s["additionalProperties"] is False
    nic = s["properties"]["nic"]["items"]
    assert nic["required"] == ["match"]
    assert nic["properties"]["mtu"] == {"type": "integer", "minimum": 68, "maximum": 65535,
                                       "description": nic["properties"]["mtu"]["description"]}
    assert s["properties"]["vm"]["properties"]["transparent_hugepage"]["enum"] == [
        "always", "madvise", "never"]


# the recorded node snapshots of tests/fixtures/topologies (topology area)
SNAPSHOT_POLICIES = {
    "dgx-h100": ["base", "default", "h100-training"],
    "epyc-nps4": ["base", "default"],
    "gh200": ["base", "default"],
    "gb200": ["base", "default", "grace-blackwell"],
    "gb200-hbm-numa": ["base", "default", "grace-blackwell"],
    "dgx-b200": ["base", "default", "hgx-training"],
    "hgx-h200": ["base", "default", "hgx-training"],
    "pcie-8gpu": ["base", "default", "pcie-gpu"],
    "this-machine": ["base", "default"],
    "workstation": ["base", "default"],
}


@pytest.mark.parametrize("snapshot", sorted(SNAPSHOT_POLICIES))
def test_bundled_policies_per_recorded_snapshot(snapshot: str) -> None:
    from tunerd.topology import read_snapshot

    topo = read_snapshot(REPO / "tests/fixtures/topologies" / f"{snapshot}.json")
    p = load_policy_dir(BUNDLED, NodeFacts.from_topology(topo))
    assert p.data["policy"]["names"] == SNAPSHOT_POLICIES[snapshot]
