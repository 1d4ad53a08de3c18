"""Exec-path matching: linear-time globs, and rules that read a bounded prefix.

Regression for the exec storm (a user exec'ing 1 MiB command lines made the
daemon read and regex-scan all of each): the bound is checked by what the
matcher READ, from this process's own /proc/self/io rchar, not by timing.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import subprocess
from collections.abc import Iterator
from types import MappingProxyType

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import ready_child
from tunerd.adapters import procfs
from tunerd.policy.typed import JobSpec
from tunerd.watch.globs import Glob, GlobSet
from tunerd.watch.rules import CMDLINE_MATCH_BYTES, ENVIRON_MATCH_BYTES, RuleSet

SLEEPER = "print('ready', flush=True)\nimport time\ntime.sleep(60)"
FILLER = ["f" * 65_536] * 16  # 1 MiB of arguments (one argument may be at most 128 KiB)
TORCH_RULE = (JobSpec(name="torch-training", cmdline=("*torchrun*", "*train*.py*"),
                      env=MappingProxyType({"LOCAL_RANK": "*"})),)


@given(st.text("ab*?[]!-^\\.", max_size=8), st.text("ab-.[]!^\\\n", max_size=10))
@settings(max_examples=3000, deadline=None)
def test_globs_mean_what_fnmatch_means(pattern: str, s: str) -> None:
    assert Glob(pattern).match(s) == fnmatch.fnmatchcase(s, pattern)


def test_a_cut_string_matches_only_within_the_prefix() -> None:
    g = GlobSet(["*train*.py*"])
    assert g.match("python train.py --x", cut=True)  # the trailing * covers the rest
    assert not g.match("python train", cut=True)  # ".py" would be past the cut
    assert Glob("*train.py").match("python train.py")
    assert not Glob("*train.py").match("python train.py", cut=True)  # the end is unseen
    assert not Glob("python").match("python", cut=True)
    assert Glob("py*").match("pyx", cut=True) and not Glob("py*").match("p", cut=True)
    assert Glob("[!a]*").match("b") and not Glob("[z-a]*").match("b")  # empty range
    assert Glob("*[0-9]?x*").match("ab12x") and not Glob("*[0-9]?x*").match("abx2x")


def test_star_globs_do_not_backtrack() -> None:
    # fnmatch.translate regexes of *a*b* scan in the regex engine; these run on str.find
    s = "a" * 1_000_000
    assert not Glob("*a*a*a*b*").match(s) and Glob("*a*a*a*").match(s)


@contextlib.contextmanager
def sleeper(args: list[str], env: dict[str, str] | None = None
            ) -> Iterator[subprocess.Popen[str]]:
    with ready_child(SLEEPER, args, {"PATH": "/usr/bin:/bin", **(env or {})}) as p:
        yield p


def read_chars() -> int:
    """Bytes this process has got from read(2) so far (/proc/self/io rchar). The
    count includes the ~100 bytes of the previous call's own read: SLACK covers it."""
    return procfs.Process(os.getpid()).io_counters().rchar


SLACK = 256


def test_rules_read_a_bounded_prefix_of_a_1mib_command_line() -> None:
    rules = RuleSet.from_policy(TORCH_RULE)
    rank = {"LOCAL_RANK": "0"}
    with sleeper(["train.py", *FILLER], rank) as early, \
            sleeper([*FILLER, "train.py"], rank) as late:
        # the measure can fail: an unbounded read shows up in rchar
        before = read_chars()
        assert procfs.read_cmdline(late.pid) is not None
        assert read_chars() - before > 1 << 20

        before = read_chars()
        m = rules.match(early.pid)
        used = read_chars() - before
        assert m is not None and m.rule.name == "torch-training" and m.env == {
            "PATH": "/usr/bin:/bin", "LOCAL_RANK": "0"}
        assert len(m.cmdline) == CMDLINE_MATCH_BYTES
        # command line prefix + environ + status/stat: never the whole MiB
        assert used <= CMDLINE_MATCH_BYTES + 1 + ENVIRON_MATCH_BYTES + (8 << 10) + SLACK, used

        before = read_chars()
        assert rules.match(late.pid) is None  # train.py is past the prefix: not seen
        assert read_chars() - before <= CMDLINE_MATCH_BYTES + 1 + SLACK, "read past the bound"


def test_a_glob_that_needs_the_end_does_not_match_a_cut_line() -> None:
    rules = RuleSet.from_policy((JobSpec(name="end", cmdline=("*-c*x.py",)),))
    with sleeper(["x.py"]) as short, sleeper([*FILLER, "x.py"]) as long:
        assert rules.match(short.pid) is not None
        assert rules.match(long.pid) is None


def test_local_rank_after_a_huge_environment_is_found() -> None:
    """torchrun appends LOCAL_RANK to a copy of its environment: read the end too."""
    env = {f"MODULE_{i}": "m" * 2000 for i in range(200)}  # ~400 KiB, as Lmod can make
    env["LOCAL_RANK"] = "3"
    rules = RuleSet.from_policy(TORCH_RULE)
    with sleeper(["train.py"], env) as p:
        before = read_chars()
        m = rules.match(p.pid)
        assert m is not None and m.env["LOCAL_RANK"] == "3"
        used = read_chars() - before
        assert used <= CMDLINE_MATCH_BYTES + ENVIRON_MATCH_BYTES + (8 << 10) + SLACK, used


RANK_RULE = (JobSpec(name="torch-training", rank=True),)  # the bundled rule's match


def test_the_rank_rule_rejects_an_unrelated_exec_by_its_environment_alone() -> None:
    """Every exec on the host is looked at under the bundled rule: one bounded read
    of environ, no command line (8 KiB here, so a read of it would show) and no
    status read for a process without a rank identity."""
    rules = RuleSet.from_policy(RANK_RULE)
    huge = {f"MODULE_{i}": "m" * 2000 for i in range(200)}  # ~400 KiB
    with sleeper(["a" * 8192], {"X": "LOCAL_RANK"}) as plain, \
            sleeper(["a" * 8192], huge) as big:
        env_bytes = len(procfs.read_bytes(f"/proc/{plain.pid}/environ"))
        before = read_chars()
        assert rules.match(plain.pid) is None
        assert read_chars() - before <= env_bytes + SLACK
        before = read_chars()
        assert rules.match(big.pid) is None
        # head and tail of environ, and stat for its size
        assert read_chars() - before <= ENVIRON_MATCH_BYTES + (2 << 10) + SLACK


def test_every_rank_identity_is_found_and_look_alikes_are_not_ranks() -> None:
    rules = RuleSet.from_policy(RANK_RULE)
    narrowed = RuleSet.from_policy((JobSpec(name="t", rank=True,
                                            env=MappingProxyType({"TOKEN": "abc"})),))
    pad = {f"MODULE_{i}": "m" * 2000 for i in range(200)}  # the identity in the tail
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                "SLURM_LOCALID"):
        with sleeper([], {var: "1"}) as p, sleeper([], {**pad, var: "0"}) as tail, \
                sleeper([], {var: "1", "TOKEN": "abc"}) as tok:
            for pid in (p.pid, tail.pid, tok.pid):
                m = rules.match(pid)
                assert m is not None and var in m.env, (var, pid)
            assert narrowed.match(p.pid) is None and narrowed.match(tok.pid) is not None
    # names that only contain an identity, or values that spell one: no rank
    with sleeper([], {"XLOCAL_RANK": "1", "V": "LOCAL_RANK=1", "TOKEN": "abc"}) as fake:
        assert rules.match(fake.pid) is None and narrowed.match(fake.pid) is None
