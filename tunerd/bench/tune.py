"""``tunerctl tune``: the guide's A/B checklist, done by the machine.

One setting at a time (placement, num_workers, pin_memory, AMP, compile), each change
benchmarked against the current best with ``run_bench``; a change is kept only when
the 95% interval of the ratio says it helps. num_workers is walked in one direction
(doubling up, then halving down) and the walk stops at the first step that does not
help; a second round runs only when the first kept something. The settings that
reach a command through ``tunerd.torch`` are known from what its helpers recorded in
a first probe run: a setting the command never reads is skipped and the report says
why, instead of benchmarking a change that cannot happen.

The winners are printed as a ``[[job]]`` rule (``workers`` and the ``torch`` table),
so the daemon applies them to the job's future runs.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from tunerd.bench import BenchConfig, BenchResult, run_bench
from tunerd.bench.arms import RULE_PLACEMENT, ArmSpec
from tunerd.bench.runner import RunResult, run_once

__all__ = ["DIMENSIONS", "Probe", "Step", "TuneResult", "probe_command", "rule_snippet",
           "search"]

DIMENSIONS = ("placement", "num_workers", "pin_memory", "amp", "compile")
TORCH_KEYS = ("num_workers", "pin_memory", "amp", "compile")


@dataclass
class Probe:
    """What one run of the command as it is showed about it."""

    run: RunResult
    device: str = "cpu"
    num_workers: int | None = None  # None: it does not call dataloader_kwargs
    pin_memory: bool | None = None
    amp: str | None = None  # None: it does not use tunerd.torch.Amp
    compile: bool | None = None  # None: it does not call maybe_compile


def probe_command(cfg: BenchConfig) -> Probe:
    """Run the command once as it is and read what its tunerd.torch helpers resolved."""
    r = run_once(list(cfg.command), dict(cfg.env), cfg.timeout, "A", 0, True)
    p = Probe(r)
    loader = r.helper("dataloader")
    if loader is not None:
        p.num_workers = int(loader["num_workers"])
        p.pin_memory = bool(loader["pin_memory"])
    amp = r.helper("amp")
    if amp is not None:
        p.amp = str(amp["amp"])
        p.device = str(amp.get("device") or "cpu")
    comp = r.helper("compile")
    if comp is not None:
        p.compile = bool(comp["compile"])
    for h in r.helpers:
        if h.get("kind") == "reporter" and h.get("device") == "cuda":
            p.device = "cuda"
    if r.workload and r.workload.get("device") == "cuda":
        p.device = "cuda"
    return p


@dataclass
class Step:
    setting: str
    value: Any
    baseline: ArmSpec
    candidate: ArmSpec
    result: BenchResult
    kept: bool
    old: Any = None  # the value in the baseline (the command's own when not set)

    def describe(self) -> str:
        c = self.result.comparison
        old = self.old
        head = f"{self.setting}: {_show(old)} -> {_show(self.value)}: "
        if self.result.failed():
            first = self.result.failed()[0]
            return head + f"failed runs ({first.arm}: {first.error}); kept {_show(old)}"
        return head + c.verdict + ("; kept" if self.kept else f"; kept {_show(old)}")

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "value": self.value, "old": self.old,
                "baseline": self.baseline.to_dict(), "candidate": self.candidate.to_dict(),
                "kept": self.kept, "comparison": self.result.comparison.to_dict(),
                "failed_runs": len(self.result.failed())}


@dataclass
class TuneResult:
    command: list[str]
    probe: Probe
    start: ArmSpec
    final: ArmSpec
    known: dict[str, Any]  # the values the command used as it was (from its helpers)
    steps: list[Step] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def final_values(self) -> dict[str, Any]:
        """The setting of every dimension tried, as measured in the final configuration."""
        tried = {s.setting for s in self.steps}
        out: dict[str, Any] = {}
        for key in TORCH_KEYS:
            if key in tried:
                out[key] = self.final.settings.get(key, self.known.get(key))
        return out

    def gain(self) -> tuple[float | None, float | None]:
        """(median of the start configuration, median of the final one) as measured: the
        first comparison's A and the last kept change's B; (start, None) when nothing was
        kept (the final configuration is the start: there is no gain to speak of)."""
        first = self.steps[0].result.comparison.median_a if self.steps else None
        kept = [s for s in self.steps if s.kept]
        return first, (kept[-1].result.comparison.median_b if kept else None)

    def to_dict(self) -> dict[str, Any]:
        start, end = self.gain()
        return {"command": self.command, "start": self.start.to_dict(),
                "final": self.final.to_dict(), "known": self.known,
                "steps": [s.to_dict() for s in self.steps], "skipped": self.skipped,
                "start_median": start, "final_median": end,
                "rule": rule_snippet(self), "elapsed_s": round(self.elapsed_s, 3)}


def _ratio(step: Step) -> str:
    c = step.result.comparison
    if c.ratio is None:
        return "no ratio"
    return f"{c.ratio:.3f}x" + (f" (95% {c.ci[0]:.3f}-{c.ci[1]:.3f})" if c.ci else "")


def _value_of(spec: ArmSpec, key: str, known: dict[str, Any] | None = None) -> Any:
    if key == "placement":
        return spec.placement
    return spec.settings.get(key, (known or {}).get(key))


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return "as is" if v is None else str(v)


def _worker_walk(start: int, cap: int) -> tuple[list[int], list[int]]:
    """num_workers to try upwards (doubling) and downwards (halving) from ``start``."""
    up, n = [], max(1, start * 2)
    while n <= cap:
        up.append(n)
        n *= 2
    down, n = [], start // 2
    while start > 0:
        down.append(n)
        if n == 0:
            break
        n //= 2
    return up, down


Bench = Callable[[BenchConfig], BenchResult]
Report = Callable[[str], None]


def search(cfg: BenchConfig, *, dims: tuple[str, ...] = DIMENSIONS, daemon: bool = True,
           rounds: int = 2, bench: Bench = run_bench,
           report: Report | None = None) -> TuneResult:
    """Vary one setting at a time from ``cfg.arms[0]``; keep what the interval says helps.

    ``daemon``: a daemon answers (placement can be tried). The num_workers walk stops
    at twice the CPUs this process may use.
    """
    t0 = time.monotonic()
    say = report or (lambda _s: None)
    probe = probe_command(cfg)
    start = cfg.arms[0]
    known = {"placement": start.placement, "num_workers": probe.num_workers,
             "pin_memory": probe.pin_memory, "amp": probe.amp, "compile": probe.compile}
    res = TuneResult(list(cfg.command), probe, start, start, known)
    if probe.run.error is not None:  # failed as it is: no comparison can say anything
        res.elapsed_s = time.monotonic() - t0
        return res
    res.skipped = _skips(dims, probe, daemon)
    for k, why in res.skipped.items():
        say(f"{k}: skipped ({why})")
    cap = 2 * len(os.sched_getaffinity(0))
    current = start

    def attempt(dim: str, value: Any) -> bool:
        nonlocal current
        cand = current.with_setting(dim, value)
        out = bench(replace(cfg, arms=(current, cand)))
        kept = out.comparison.winner == "B" and not out.failed()
        step = Step(dim, value, current, cand, out, kept, _value_of(current, dim, known))
        res.steps.append(step)
        say(step.describe())
        if kept:
            current = cand
        return kept

    for rnd in range(max(1, rounds)):
        steps_before = sum(1 for s in res.steps if s.kept)
        for dim in (d for d in DIMENSIONS if d in dims and d not in res.skipped):
            if dim == "num_workers":
                base = int(_value_of(current, dim, known) or 0)
                up, down = _worker_walk(base, cap)
                # walk up while it helps; only if the first step up did not, walk down
                went_up = False
                for n in up:
                    if not attempt(dim, n):
                        break
                    went_up = True
                if not went_up:
                    for n in down:
                        if not attempt(dim, n):
                            break
                continue
            for value in _candidates(dim, current, known, probe):
                if value != _value_of(current, dim, known):
                    attempt(dim, value)
        if sum(1 for s in res.steps if s.kept) == steps_before:
            break  # nothing helped this round: stop
        if rnd + 1 < rounds:
            say(f"round {rnd + 2}: trying the other values again with the kept changes")
    res.final = current
    res.elapsed_s = time.monotonic() - t0
    return res


def _candidates(dim: str, current: ArmSpec, known: dict[str, Any],
                probe: Probe) -> Iterator[Any]:
    if dim == "placement":
        yield from ("tunerd", "exclusive")
    elif dim == "pin_memory":
        yield not bool(_value_of(current, dim, known))
    elif dim == "amp":
        modes = ("off", "bf16", "fp16") if probe.device == "cuda" else ("off", "bf16")
        yield from (m for m in modes if m != _value_of(current, dim, known))
    elif dim == "compile":
        yield not bool(_value_of(current, dim, known))


def _skips(dims: tuple[str, ...], probe: Probe, daemon: bool) -> dict[str, str]:
    out: dict[str, str] = {}
    if "placement" in dims and not daemon:
        out["placement"] = "the daemon is not reachable, so tunerctl run cannot place it"
    if probe.num_workers is None:
        for k in ("num_workers", "pin_memory"):
            if k in dims:
                out[k] = ("the command does not call tunerd.torch.dataloader_kwargs, so "
                          f"{k} cannot be changed from outside")
    elif "pin_memory" in dims and probe.device != "cuda":
        out["pin_memory"] = "no CUDA: pinned host memory only speeds up copies to a GPU"
    if "amp" in dims and probe.amp is None:
        out["amp"] = "the command does not use tunerd.torch.Amp"
    if "compile" in dims and probe.compile is None:
        out["compile"] = "the command does not call tunerd.torch.maybe_compile"
    return out


# -- the rule ---------------------------------------------------------------------------

def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return json.dumps(str(v))  # a TOML basic string: JSON's escapes are TOML's


# programs that run a script: never a rule's match on their own (`*python*` binds every
# Python process of every user)
_RUNNERS = re.compile(r"^(python[0-9.]*|pypy[0-9.]*|sh|bash|dash|zsh|env|uv|conda|"
                      r"torchrun|accelerate|deepspeed|srun|mpirun|nohup|time|nice|numactl|"
                      r"taskset)$")


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def _match_token(command: list[str]) -> str:
    """What of the command line a rule matches on: its script's name (``*train.py*``),
    else the module of ``-m MOD``, else a program that is not a mere runner, else the
    whole command line as it ran (escaped), never an interpreter's name alone."""
    words = [os.path.basename(w) for w in command]
    script = next((w for w in words if w.endswith(".py")), None)
    if script:
        return _glob_escape(script)
    if "-m" in command[:-1]:
        return _glob_escape("-m " + command[command.index("-m") + 1])
    program = next((w for w in words if w and not w.startswith("-")
                    and not _RUNNERS.match(w)), None)
    if program and words and not _RUNNERS.match(words[0]):
        return _glob_escape(program)
    return _glob_escape(" ".join(command)) or "train"


def _user() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def rule_snippet(res: TuneResult, user: str | None = None) -> str:
    """The winning settings as a ``[[job]]`` rule for a policy file: it matches the job
    that was measured (its script, run by ``user``: the caller), nothing wider."""
    token = _match_token(res.command)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", re.sub(r"\[(.)\]", r"\1", token)
                  .rsplit(".py", 1)[0]).strip("-.") or "job"
    lines = [f"# tunerctl tune: {' '.join(res.command)}"[:300]]
    kept = [s for s in res.steps if s.kept]
    if kept:
        lines.append("# kept (each one's 95% interval of the ratio excluded 1): " + "; ".join(
            f"{s.setting}={_show(s.value)}: {_ratio(s)}" for s in kept))
    else:
        lines.append("# kept: nothing (no change helped beyond the noise); the rule below "
                     "only places the job as measured")
    lines += ["[[job]]", f"name = {_toml('tuned-' + stem)}",
              f"match.cmdline = [{_toml('*' + token + '*')}]",
              f"match.user = [{_toml(user or _user())}]",
              f"placement = {_toml(RULE_PLACEMENT[res.final.placement])}"]
    values = res.final_values()
    if values.get("num_workers") is not None:
        lines.append(f"workers = {int(values['num_workers'])}")
    table = ", ".join(f"{k} = {_toml(v)}" for k, v in values.items() if v is not None)
    if table:
        lines.append(f"torch = {{ {table} }}")
    return "\n".join(lines) + "\n"
