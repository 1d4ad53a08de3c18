"""Random and mutated TOML never crashes the loader: a policy, or a PolicyError."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import REPO
from tunerd.policy import NodeFacts, PolicyError
from tunerd.policy.loader import check_set, read_policy_file, resolve
from tunerd.policy.render import render_toml
from tunerd.policy.sections import SECTION_DEFAULTS

FACTS = [NodeFacts("dgx-h100-01", ("NVIDIA H100 80GB HBM3",) * 8), NodeFacts("ws", ())]
SEEDS = [p.read_text() for p in sorted((REPO / "policies").glob("*.toml"))] + [
    '[policy]\nname = "x"\nextends = ["base"]\napply_once = ["nic:*:mtu"]\n'
    '[policy.match]\nhostname = ["gpu-*"]\nmin_gpus = 1\nmax_gpus = 8\n'
    '[cpu]\nhousekeeping = "0-1"\ngovernor = "performance"\n'
    '[vm]\ntransparent_hugepage = "madvise"\ntransparent_hugepage_defrag = "defer"\n'
    '[gpu]\npersistence_mode = true\ncompute_mode = "default"\npower_limit_w = 400\n'
    '[[block]]\nmatch = "nvme*"\nscheduler = "none"\nread_ahead_kb = 4096\nnr_requests = 1023\n'
    '[[nic]]\nmatch = "ens*"\nmtu = 9000\ntxqueuelen = 10000\n'
    '[[job]]\nname = "j"\nmatch.cmdline = ["*x*"]\nmatch.user = "bob"\ncpus = "2-15"\n'
    'gpus = 2\nexclusive = true\nexclusive_scope = "pid:1"\nworkers = 8\n'
    'torch = { num_workers = 8, pin_memory = true, persistent_workers = true, '
    'prefetch_factor = 2, amp = "bf16", compile = false }\n'
    '[leases]\nuser_exclusive = false\nmax_per_user = 64\nalloc_ttl = 86400\n',
]
FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

VALUES = ["1", "-1", "0", "9000", "99999999999999999999", '"x"', '""', "true", "1.5", "nan",
          "[]", "[1, \"a\"]", "{}", "{ a = 1 }", "1979-05-27T07:32:00Z", '"0-3,a"', '"\\n"',
          '"gpu-local"', '"*"', "inf", "[[1]]"]


def load_text(text: str) -> None:
    """The daemon's path for a one-file set; anything but PolicyError fails the test."""
    report = read_policy_file(Path("/fuzz/policy.toml"), text)
    check_set([report])
    if report.errors:
        assert all(e.startswith("/fuzz/policy.toml: ") for e in report.errors)
        return
    assert report.parsed is not None
    for facts in FACTS:
        try:
            p = resolve([report.parsed], facts)
        except PolicyError:
            continue
        assert set(SECTION_DEFAULTS) <= set(p.data)
        render_toml(p.data)
        # the typed policy is built from the same merged data
        m = p.model
        assert m.limits.nofile == p.data["limits"].get("nofile")
        assert [j.name for j in m.jobs] == [j["name"] for j in p.data["job"]]
        assert [r.match for r in m.nic] == [e["match"] for e in p.data["nic"]]
        assert dict(m.sysctl) == p.data["sysctl"]
        assert m.leases.alloc_ttl == p.data["leases"]["alloc_ttl"]


@st.composite
def mutated(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["drop", "dup", "insert", "value", "key", "swap", "type"]))
        i = draw(st.integers(0, max(len(text) - 1, 0)))
        if op == "drop":
            text = text[:i] + text[i + 1:]
        elif op == "dup":
            text = text[:i] + text[i:i + 1] * draw(st.integers(2, 3)) + text[i + 1:]
        elif op == "insert":
            text = text[:i] + draw(st.text(max_size=3)) + text[i:]
        elif op == "value":  # swap a value for one of another type or range
            lines = text.split("\n")
            candidates = [n for n, ln in enumerate(lines) if re.match(r"^[^#\[]*=", ln)]
            if candidates:
                n = draw(st.sampled_from(candidates))
                key = lines[n].split("=", 1)[0]
                lines[n] = f"{key}= {draw(st.sampled_from(VALUES))}"
                text = "\n".join(lines)
        elif op == "key":  # a random key into a random place
            lines = text.split("\n")
            n = draw(st.integers(0, len(lines)))
            key = draw(st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,12}", fullmatch=True))
            lines.insert(n, f"{key} = {draw(st.sampled_from(VALUES))}")
            text = "\n".join(lines)
        elif op == "swap":
            lines = text.split("\n")
            a, b = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            lines[a], lines[b] = lines[b], lines[a]
            text = "\n".join(lines)
        else:  # table <-> array of tables
            text = text.replace("[[", "[", 1) if draw(st.booleans()) else \
                text.replace("[", "[[", 1)
    return text


@FUZZ
@given(mutated())
def test_mutated_policies(text: str) -> None:
    load_text(text)


@FUZZ
@given(st.text(max_size=300))
def test_random_text(text: str) -> None:
    load_text(text)


TOML_SCALARS = st.one_of(st.integers(-(1 << 70), 1 << 70), st.booleans(), st.text(max_size=8),
                         st.floats(allow_nan=False), st.sampled_from(["ens*", "0-3", "none"]))
TOML_KEYS = st.sampled_from(["policy", "name", "match", "mtu", "nic", "job", "sysctl", "nccl",
                             "NCCL_X", "net.core.x", "cpus", "nofile", "limits", "vm",
                             "extends", "hostname", "gpu_model", "min_gpus", "cmdline", "env",
                             "placement", "block", "cpu", "gpu", "apply_once", "x", "workers",
                             "torch", "num_workers", "amp", "leases", "alloc_ttl"])
TOML_DOCS = st.recursive(
    TOML_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(TOML_KEYS, inner, max_size=4)),
    max_leaves=25,
)


@FUZZ
@given(st.dictionaries(TOML_KEYS, TOML_DOCS, max_size=6))
def test_random_structures(doc: dict) -> None:
    load_text(render_toml(doc))


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    report = read_policy_file(Path("/fuzz/deep.toml"), "x = " + "[" * 5000 + "]" * 5000)
    assert report.errors and report.errors[0].startswith("/fuzz/deep.toml: ")
