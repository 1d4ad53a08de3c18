"""Automatic binding: [[job]] rules applied by the real daemon to processes we spawn."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, wait_for
from tests.leases_helpers import (
    DGX_H100,
    autobind_status,
    cpus_allowed,
    kill,
    kill_pids,
    kill_tree,
    rule_policy,
    snapshot_with_gpus_here,
    spawn,
    unique_sleeper,
)
from tunerd.base.cpulist import parse_cpulist
from tunerd.policy.typed import JobSpec
from tunerd.watch.rules import RuleSet

pytestmark = pytest.mark.root

HOST_CPUS = frozenset(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs to move between")


def _rule(name: str, exe: Path, extra: str = "") -> str:
    return (f'[[job]]\nname = "{name}"\nmatch.cmdline = ["*{exe.name}*"]\n'
            f'match.env = {{ LOCAL_RANK = "*" }}\n{extra}\n')


def test_ruleset_matches_real_processes(tmp_path: Path) -> None:
    exe = unique_sleeper(tmp_path, f"rs_train_{os.getpid()}")
    rules = RuleSet.from_policy([
        JobSpec("other-user", cmdline=(f"*{exe.name}*",), users=("nobody",)),
        JobSpec("t", cmdline=(f"*{exe.name}* 30",), env={"LOCAL_RANK": "[0-3]"},
                users=("root",)),
    ])
    ranked = spawn([str(exe), "30"], {"LOCAL_RANK": "2"})
    unranked = spawn([str(exe), "30"])
    high_rank = spawn([str(exe), "30"], {"LOCAL_RANK": "7"})
    other = spawn(["sleep", "30"], {"LOCAL_RANK": "0"})
    try:
        time.sleep(0.05)
        m = rules.match(ranked.pid)
        assert m is not None and m.rule.name == "t" and m.env["LOCAL_RANK"] == "2"
        assert m.cmdline == f"{exe} 30" and m.uid == 0
        assert rules.match(unranked.pid) is None
        assert rules.match(high_rank.pid) is None
        assert rules.match(other.pid) is None
        assert rules.match(999_999_999) is None  # gone: no error
    finally:
        for p in (ranked, unranked, high_rank, other):
            kill(p)


@needs_two_cpus
def test_matching_process_is_bound_automatically(tmp_path: Path, daemon_factory) -> None:
    exe = unique_sleeper(tmp_path, f"ab_train_{os.getpid()}")
    target = max(HOST_CPUS)
    pol = rule_policy(tmp_path / "pol", _rule("trainer", exe, f'cpus = "{target}"\nnofile = 4096'))
    d = daemon_factory(policy_dir=pol).start()
    ranked = spawn([str(exe), "30"], {"LOCAL_RANK": "0"})
    unranked = spawn([str(exe), "30"])
    try:
        wait_for(lambda: cpus_allowed(ranked.pid) == str(target), 10,
                 "the ranked process to be bound", detail=d.log)

        def nofile_set() -> bool:  # bind first: the fd limit follows the CPUs
            with open(f"/proc/{ranked.pid}/limits") as f:
                return any(line.startswith("Max open files") and "4096" in line for line in f)

        wait_for(nofile_set, 5, "the rule's fd limit", detail=d.log)
        jobs = d.ctl("--json", "jobs").json()["jobs"]
        rec = [j for j in jobs if j["pid"] == ranked.pid]
        assert rec and rec[0]["origin"] == "rule" and rec[0]["name"] == "trainer"
        assert rec[0]["cmdline"] == f"{exe} 30"
        row = [ln.split() for ln in d.ctl("jobs").out.splitlines()[1:]
               if ln.split()[:1] == [str(ranked.pid)]]
        assert row and row[0][1:3] == [exe.name[:15], "trainer"]  # live name, then the rule
        # the one without LOCAL_RANK does not match the rule
        time.sleep(0.3)
        assert parse_cpulist(cpus_allowed(unranked.pid) or "") == HOST_CPUS
        assert all(j["pid"] != unranked.pid for j in d.ctl("--json", "jobs").json()["jobs"])
        st = autobind_status(d)
        assert st["watcher"]["mode"] == "proc-connector"
        assert st["watcher"]["kernel_event_filter"] in (True, False)
    finally:
        kill(ranked)
        kill(unranked)


@needs_two_cpus
def test_process_running_before_the_rule_is_bound_at_start(tmp_path: Path,
                                                          daemon_factory) -> None:
    exe = unique_sleeper(tmp_path, f"ab_early_{os.getpid()}")
    target = min(HOST_CPUS)
    early = spawn([str(exe), "30"], {"LOCAL_RANK": "0"})
    try:
        pol = rule_policy(tmp_path / "pol", _rule("early", exe, f'cpus = "{target}"'))
        d = daemon_factory(policy_dir=pol).start()
        wait_for(lambda: cpus_allowed(early.pid) == str(target), 10,
                 "the process that ran before the daemon to be bound")
        summary = autobind_status(d)["summary"]
        assert "(1 already running at start, of user(s) root)" in summary, summary
    finally:
        kill(early)


@needs_two_cpus
def test_a_process_a_reload_binds_is_not_said_to_run_at_start(tmp_path: Path,
                                                               daemon_factory) -> None:
    """A rule added by a reload binds a process already running: status says it was
    running at a reload, not "at start" (the daemon was up before it)."""
    exe = unique_sleeper(tmp_path, f"ab_reload_{os.getpid()}")
    target = min(HOST_CPUS)
    pol = rule_policy(tmp_path / "pol", "")
    d = daemon_factory(policy_dir=pol).start()
    early = spawn([str(exe), "30"], {"LOCAL_RANK": "0"})
    try:
        rule_policy(pol, _rule("late", exe, f'cpus = "{target}"'))
        assert d.ctl("reload").rc == 0
        wait_for(lambda: cpus_allowed(early.pid) == str(target), 10,
                 "the rule of the reload to bind it", detail=d.log)
        summary = wait_for(lambda: (s := autobind_status(d)["summary"]) and
                           "already running" in s and s, 10, "the summary", detail=d.log)
        assert "at start" not in summary, summary
        assert "(1 already running at a reload, of user(s) root)" in summary, summary
        assert "already running at start" not in d.log()
    finally:
        kill(early)


def test_torchrun_ranks_get_distinct_gpus_and_cpus_on_replay(tmp_path: Path,
                                                            daemon_factory) -> None:
    exe = unique_sleeper(tmp_path, f"ab_ranks_{os.getpid()}")
    pol = rule_policy(tmp_path / "pol", _rule("torch", exe, 'placement = "gpu-local"'))
    d = daemon_factory(policy_dir=pol, args=["--topology", str(DGX_H100)]).start()
    run_id = f"run{os.getpid()}"
    ranks = [spawn([str(exe), "30"], {"LOCAL_RANK": str(r), "TORCHELASTIC_RUN_ID": run_id})
             for r in range(4)]
    # a second job that only sees GPUs 4-7: its rank 1 is GPU 5
    other = spawn([str(exe), "30"], {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    try:
        def bound() -> dict[int, dict]:
            got = {b["pid"]: b for b in autobind_status(d)["bound"]}
            return got if len(got) >= 5 else {}

        got = wait_for(bound, 15, "five bound ranks", detail=d.log)
        by_rank = [got[p.pid] for p in ranks]
        assert [b["gpus"] for b in by_rank] == [[0], [1], [2], [3]]
        cpu_sets = [parse_cpulist(b["cpus"]) for b in by_rank]
        node0 = parse_cpulist("0-55,112-167")  # GPUs 0-3 sit on NUMA node 0
        for i, s in enumerate(cpu_sets):
            assert s and s <= node0
            for t in cpu_sets[i + 1:]:
                assert not (s & t), "ranks of one job share CPUs"
        assert got[other.pid]["gpus"] == [5]
        assert parse_cpulist(got[other.pid]["cpus"]) <= parse_cpulist("56-111,168-223")
        # replay: nothing was applied to this machine, and the reply says why
        assert not any(b["applied"] for b in by_rank)
        assert "nothing was applied" in " ".join(by_rank[0]["notes"])
        assert parse_cpulist(cpus_allowed(ranks[0].pid) or "") == HOST_CPUS
    finally:
        for p in [*ranks, other]:
            kill(p)


@needs_two_cpus
def test_exclusive_rule_moves_scope_off_and_back(tmp_path: Path, daemon_factory) -> None:
    exe = unique_sleeper(tmp_path, f"ab_excl_{os.getpid()}")
    job_cpu = max(HOST_CPUS)
    # bystanders: a shell and its two children, all started by this test
    bystander = spawn(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    children: list[int] = []
    try:
        def kids() -> list[int]:
            try:
                with open(f"/proc/{bystander.pid}/task/{bystander.pid}/children") as f:
                    return [int(x) for x in f.read().split()]
            except OSError:
                return []

        children = wait_for(lambda: len(kids()) == 2 and kids(), 5, "the two children")
        tree = [bystander.pid, *children]
        pol = rule_policy(tmp_path / "pol", _rule(
            "excl", exe, f'cpus = "{job_cpu}"\nexclusive = true\n'
                         f'exclusive_scope = "pid:{bystander.pid}"'))
        d = daemon_factory(policy_dir=pol).start()
        job = spawn([str(exe), "30"], {"LOCAL_RANK": "0"})
        rest = HOST_CPUS - {job_cpu}
        wait_for(lambda: cpus_allowed(job.pid) == str(job_cpu), 10, "the job to be bound",
                 detail=d.log)
        wait_for(lambda: all(parse_cpulist(cpus_allowed(p) or "") == rest for p in tree), 5,
                 "the scope to move off the job's CPU",
                 detail=lambda: str([cpus_allowed(p) for p in tree]))
        state = (d.runtime_dir / "state.json").read_text()
        assert f"rule:{job.pid}:" in state  # originals saved
        kill(job)
        wait_for(lambda: all(parse_cpulist(cpus_allowed(p) or "") == HOST_CPUS for p in tree),
                 5, "the scope to get every CPU back",
                 detail=lambda: str([cpus_allowed(p) for p in tree]))
    finally:
        kill_tree(bystander)


@needs_two_cpus
def test_ranks_are_really_bound_near_their_gpus(tmp_path: Path, daemon_factory) -> None:
    """A snapshot with every CPU of this machine: rank placement is applied for real."""
    snap, lo, hi = snapshot_with_gpus_here(tmp_path / "snap.json")
    exe = unique_sleeper(tmp_path, f"ab_real_{os.getpid()}")
    pol = rule_policy(tmp_path / "pol", _rule("torch", exe))
    d = daemon_factory(policy_dir=pol, args=["--topology", str(snap)]).start()
    r0 = spawn([str(exe), "30"], {"LOCAL_RANK": "0"})
    r1 = spawn([str(exe), "30"], {"LOCAL_RANK": "1"})
    try:
        wait_for(lambda: cpus_allowed(r0.pid) == str(lo) and cpus_allowed(r1.pid) == str(hi),
                 10, "ranks 0 and 1 bound near their GPUs", detail=d.log)
        jobs = {j["pid"]: j for j in d.ctl("--json", "jobs").json()["jobs"]}
        assert jobs[r0.pid]["gpus"] == [0] and jobs[r1.pid]["gpus"] == [1]
    finally:
        kill(r0)
        kill(r1)


@needs_two_cpus
def test_proc_scan_fallback_still_binds(tmp_path: Path, daemon_factory) -> None:
    exe = unique_sleeper(tmp_path, f"ab_scan_{os.getpid()}")
    target = max(HOST_CPUS)
    pol = rule_policy(tmp_path / "pol", _rule("scan", exe, f'cpus = "{target}"'))
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text("watch_execs = false\n")
    d = daemon_factory(policy_dir=pol, args=["--config", str(cfg)]).start()
    assert autobind_status(d)["watcher"]["mode"] == "proc-scan"
    p = spawn([str(exe), "30"], {"LOCAL_RANK": "0"})
    try:
        wait_for(lambda: cpus_allowed(p.pid) == str(target), 10,
                 "the /proc scan to bind the process", detail=d.log)
        assert "scanning /proc every" in d.log()
    finally:
        kill(p)


def test_ranks_under_a_run_lease_stay_inside_it(tmp_path: Path, daemon_factory) -> None:
    import subprocess
    import sys

    exe = unique_sleeper(tmp_path, f"ab_lease_{os.getpid()}")
    pol = rule_policy(tmp_path / "pol", _rule("torch", exe))
    d = daemon_factory(policy_dir=pol, args=["--topology", str(DGX_H100)]).start()
    # take GPUs 0-3 first so the run lease lands elsewhere
    assert d.ctl("alloc", "--gpus", "4").rc == 0
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tunerd.cli.main", "--socket", str(d.socket), "run", "--gpus",
         "2", "--", "sh", "-c", f"LOCAL_RANK=0 {exe} 30 & LOCAL_RANK=1 {exe} 30 & wait"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def state() -> tuple[dict, list[dict]] | None:
            runs = [x for x in d.ctl("--json", "leases").json() if x["origin"] == "run"]
            bound = autobind_status(d)["bound"]
            return (runs[0], bound) if runs and len(bound) == 2 else None

        lease, bound = wait_for(state, 15, "the run lease and its two bound ranks",
                                detail=d.log)
        assert sorted(b["gpus"][0] for b in bound) == sorted(lease["gpus"])
        inside = parse_cpulist(lease["cpus"])
        for b in bound:
            assert parse_cpulist(b["cpus"]) <= inside
        assert not parse_cpulist(bound[0]["cpus"]) & parse_cpulist(bound[1]["cpus"])
    finally:
        from tunerd.adapters.procfs import descendants

        kill_pids(reversed(descendants(launcher.pid)))  # children first, by pid
        launcher.wait()


@pytest.mark.skipif(not HOST_CPUS & parse_cpulist("0-7"), reason="needs one of CPUs 0-7")
def test_a_slurm_task_under_a_run_lease_keeps_its_granted_cpu_count(
        tmp_path: Path, daemon_factory) -> None:
    """Inside a `tunerctl run` lease, a Slurm task still counts the CPUs Slurm granted
    it (its affinity mask), as it does outside a lease."""
    import subprocess
    import sys

    exe = unique_sleeper(tmp_path, f"ab_slurm_{os.getpid()}")
    pol = rule_policy(tmp_path / "pol", _rule("torch", exe))
    d = daemon_factory(policy_dir=pol, args=["--topology", str(DGX_H100)]).start()
    # the replayed lease holds CPUs 0-7; the task's mask is this host's CPUs (nothing
    # is applied on a replay), so Slurm granted it len(HOST_CPUS & 0-7) of them
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tunerd.cli.main", "--socket", str(d.socket), "run",
         "--cpus", "0-7", "--", "sh", "-c", f"SLURM_JOB_ID=7 LOCAL_RANK=0 {exe} 30"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        bound = wait_for(lambda: autobind_status(d)["bound"], 15, "the bound task",
                         detail=d.log)
        granted = len(HOST_CPUS & parse_cpulist("0-7"))
        assert f"{granted} CPUs, as Slurm job 7 granted the task" in bound[0]["notes"], bound
        assert len(parse_cpulist(bound[0]["cpus"])) == granted
        assert parse_cpulist(bound[0]["cpus"]) <= parse_cpulist("0-7")
    finally:
        from tunerd.adapters.procfs import descendants

        kill_pids(reversed(descendants(launcher.pid)))  # children first, by pid
        launcher.wait()


def test_a_rule_that_cannot_be_placed_reports_once(tmp_path: Path, daemon_factory) -> None:
    import signal as sig

    exe = unique_sleeper(tmp_path, f"ab_fail_{os.getpid()}")
    pol = rule_policy(tmp_path / "pol", _rule("too-big", exe, "gpus = 9"))
    d = daemon_factory(policy_dir=pol, args=["--topology", str(DGX_H100)]).start()
    p = spawn([str(exe), "30"], {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""})
    try:
        st = wait_for(lambda: (s := autobind_status(d))["failed"] and s, 10,
                      "the rule's failure to be reported", detail=d.log)
        assert st["failed"] == 1 and st["matched"] == 1
        assert f"rule too-big, pid {p.pid}: need 9 GPU(s)" in st["last_error"]
        errors = d.ctl("--json", "status").json()["errors"]
        assert any(e["source"] == "autobind" and "too-big" in e["message"] for e in errors)
        d.signal(sig.SIGHUP)  # reload -> rescan: the same process is not retried
        time.sleep(1.0)
        st = autobind_status(d)
        assert st["failed"] == 1 and st["matched"] == 1, st  # nor counted as a new match
        assert cpus_allowed(p.pid) is not None
    finally:
        kill(p)


def test_leases_avoid_what_exclusive_rule_jobs_use(tmp_path: Path, daemon_factory) -> None:
    exe = unique_sleeper(tmp_path, f"ab_hold_{os.getpid()}")
    pol = rule_policy(tmp_path / "pol", _rule("held", exe, "exclusive = true"))
    d = daemon_factory(policy_dir=pol, args=["--topology", str(DGX_H100)]).start()
    p = spawn([str(exe), "30"], {"LOCAL_RANK": "0"})
    try:
        got = wait_for(lambda: autobind_status(d)["bound"], 10, "the rank to be bound",
                       detail=d.log)
        assert got[0]["gpus"] == [0]
        rank_cpus = parse_cpulist(got[0]["cpus"])
        # its CPUs are held; its GPU only by its environment's word, which holds nothing
        # (a GPU is in use when seen from outside: tunerd.jobs.gate)
        lease = d.ctl("alloc", "--gpus", "3", "--json").json()
        assert not parse_cpulist(lease["cpus"]) & rank_cpus
    finally:
        kill(p)
