"""``[[job]]`` rules: which exec'd processes the daemon binds by itself.

A rule matches when every key it gives matches (README, "Policies"):

* ``match.cmdline`` -- any of the globs matches the command line, its
  NUL-separated arguments joined by single spaces (``python -u train.py --lr 3``);
* ``match.env`` -- every listed variable is set and its value matches the glob
  (``LOCAL_RANK = "*"`` means "is set");
* ``match.user`` -- the real uid is one of the named users (names or numbers);
* ``match.rank = true`` -- the process is a rank of a training job: it carries a
  rank identity (LOCAL_RANK from torchrun, ``python -m torch.distributed.run``,
  deepspeed or accelerate; OMPI_COMM_WORLD_LOCAL_RANK; MPI_LOCALRANKID;
  SLURM_LOCALID of an srun task), whatever its script is called, and it is no
  launcher (torchrun agent, mpirun, srun, slurmstepd) or wrapper (numactl, taskset,
  env, nsys, a shell). The daemon's intake (tunerd.jobs.intake) then tells ranks
  from their descendants (workers inherit the variables). ``cmdline``/``env``/
  ``user`` only narrow it.

Matching runs for every exec on the host, so the no-match path is one file read
and no parsing: when every rule has a command-line glob, the command line (one
bounded read, globs compiled once per policy) rejects unrelated commands; when
every rule needs the environment (``match.rank``, ``match.env``: the bundled rule),
the raw bytes of environ are searched for the variable names the rules need
(``LOCAL_RANK=`` ...) before anything is decoded, and the command line is read only
for a process that has them. Both are necessary conditions (a name found in the
middle of another entry only costs the full check), never a different answer.

Bounds. Only the first ``CMDLINE_MATCH_BYTES`` (4 KiB, one page: all that
/proc/PID/cmdline showed before Linux 4.2) of a command line are read and
matched: a glob must match within them, and on a longer command line it must
end with ``*`` (standing for the unseen rest). A glob that would only match past
the first 4 KiB does not match. The environment is read up to
``ENVIRON_MATCH_BYTES`` (64 KiB): a larger one as its first and last 32 KiB,
where launchers such as torchrun put LOCAL_RANK and RANK (tunerd.adapters.procfs,
``Process.environ``); a variable only in between is not seen. Without the bounds
a user exec'ing 1 MiB command lines in a loop made the daemon read and scan
every byte of each (milliseconds of CPU per exec); with them the cost per exec
is fixed (bench/exec_storm.py). Globs are matched in time linear in the text
(tunerd.watch.globs), never with a backtracking regex.
"""

from __future__ import annotations

import logging
import pwd
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from tunerd.adapters import procfs
from tunerd.base.modes import Mode, parse_mode
from tunerd.policy.typed import JobSpec, TorchSettings
from tunerd.watch.globs import Glob, GlobSet
from tunerd.watch.launchers import RANK_VARS, is_launcher, wrapper_name

__all__ = ["CMDLINE_MATCH_BYTES", "ENVIRON_MATCH_BYTES", "GpuUseMatch", "JobRule", "RuleMatch",
           "RuleSet"]

CMDLINE_MATCH_BYTES = 4 << 10
ENVIRON_MATCH_BYTES = 64 << 10

log = logging.getLogger("tunerd.rules")


@dataclass(frozen=True)
class JobRule:
    name: str
    cmdline: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    users: tuple[str, ...] = ()
    rank: bool = False  # ranks of a training job only (by environment and tree)
    placement: Mode = Mode.GPU_LOCAL
    cpus: frozenset[int] | None = None
    gpus: int | None = None
    nofile: int | None = None
    exclusive: bool = False
    exclusive_scope: str | None = None
    uids: frozenset[int] = field(default=frozenset(), compare=False)
    workers: int | None = None  # DataLoader workers per rank: placement room
    self_pinned_memory: str = "bind"  # a self-pinned rank's memory: bind | leave
    gpu_memory: bool = False  # memory also on the GPUs' own (CPU-less) NUMA nodes
    # what tunerd.torch applies in the processes this rule bound
    torch: TorchSettings = field(default_factory=TorchSettings)
    # [job.gpu_use]: processes seen using a GPU are placed under this rule too (None: off)
    gpu_use: GpuUseMatch | None = None

    def __post_init__(self) -> None:
        if type(self.placement) is not Mode:  # text from a caller: parsed here, once
            object.__setattr__(self, "placement", parse_mode(self.placement))

    @classmethod
    def from_policy(cls, spec: JobSpec) -> JobRule:
        """Build from one typed ``[[job]]`` rule of the policy in force."""
        uids = _uids(spec.name, spec.users)
        env = tuple(sorted(spec.env.items()))
        return cls(
            name=spec.name, cmdline=spec.cmdline, env=env, users=spec.users, rank=spec.rank,
            placement=spec.placement, cpus=spec.cpus, gpus=spec.gpus, nofile=spec.nofile,
            exclusive=spec.exclusive, exclusive_scope=spec.exclusive_scope,
            workers=spec.workers, self_pinned_memory=spec.self_pinned_memory,
            gpu_memory=spec.gpu_memory, torch=spec.torch,
            uids=frozenset(uids), gpu_use=GpuUseMatch.from_policy(spec),
        )

    def matches(self, cmdline: str, uid: int | None, env: dict[str, str] | None) -> bool:
        """Whether this rule alone matches (RuleSet.match is the compiled, bounded path)."""
        if self.cmdline and not GlobSet(self.cmdline).match(cmdline, False):
            return False
        if self.users and uid not in self.uids:
            return False
        if self.env:
            if env is None:
                return False
            for var, g in self.env:
                val = env.get(var)
                if val is None or not Glob(g).match(val):
                    return False
        return True


    def places_gpu_user(self, cmdline: str, uid: int | None, env: Mapping[str, str]) -> bool:
        """Whether a process seen using a GPU is placed under this rule: ``gpu_use`` on,
        the rule's own keys (``match.rank`` aside: such a process has no rank variable)
        and ``gpu_use``'s narrowing keys all match."""
        g = self.gpu_use
        return g is not None and self.matches(cmdline, uid, dict(env)) and g.matches(
            cmdline, uid, env)


@dataclass(frozen=True)
class GpuUseMatch:
    """``[job.gpu_use]``'s narrowing keys, as ``match``'s: every one given must match."""

    cmdline: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    users: tuple[str, ...] = ()
    uids: frozenset[int] = frozenset()

    @classmethod
    def from_policy(cls, spec: JobSpec) -> GpuUseMatch | None:
        g = spec.gpu_use
        if g is None:
            return None
        return cls(g.cmdline, tuple(sorted(g.env.items())), g.users,
                   frozenset(_uids(spec.name, g.users)))

    def matches(self, cmdline: str, uid: int | None, env: Mapping[str, str]) -> bool:
        if self.cmdline and not GlobSet(self.cmdline).match(cmdline, False):
            return False
        if self.users and uid not in self.uids:
            return False
        return all((val := env.get(var)) is not None and Glob(g).match(val)
                   for var, g in self.env)


def _uids(rule: str, users: Iterable[str]) -> set[int]:
    """Uids of user names (or numbers); a name this node lacks is warned about."""
    uids: set[int] = set()
    for u in users:
        if u.isdigit():
            uids.add(int(u))
            continue
        try:
            uids.add(pwd.getpwnam(u).pw_uid)
        except KeyError:
            log.warning("job rule %r: user %r does not exist on this node", rule, u)
    return uids


@dataclass(frozen=True)
class RuleMatch:
    rule: JobRule
    pid: int
    cmdline: str  # at most CMDLINE_MATCH_BYTES of it
    uid: int | None
    env: Mapping[str, str]  # procfs.environ_view: looked up, not parsed whole


@dataclass(frozen=True)
class _Compiled:
    """A rule's globs, compiled once per policy (RuleSet is built on each load)."""

    rule: JobRule
    cmd: GlobSet | None
    env: tuple[tuple[str, Glob], ...]
    # ``NAME=`` of each variable the rule needs set: all must be in the raw environ
    env_needles: tuple[bytes, ...]

    @property
    def needs_env(self) -> bool:
        return bool(self.env) or self.rule.rank

    def env_possible(self, blob: bytes) -> bool:
        """Whether the raw environ bytes can satisfy the rule's env and rank keys."""
        return (all(n in blob for n in self.env_needles)
                and (not self.rule.rank or any(n in blob for n in _RANK_NEEDLES)))


def _needles(names: Iterable[str]) -> tuple[bytes, ...]:
    """``NAME=`` as bytes for each name, those implied by another one left out (if
    ``OMPI_COMM_WORLD_LOCAL_RANK=`` is there, so is ``LOCAL_RANK=``). A name that
    would decode differently from its bytes (U+FFFD) is not looked for."""
    out = {n.encode() + b"=" for n in names if "\ufffd" not in n}
    return tuple(sorted(n for n in out if not any(n != m and m in n for m in out)))


_RANK_NEEDLES = _needles(RANK_VARS)  # any one of them: a rank identity


class RuleSet:
    """All rules of the policy in force, with a one-pass early reject."""

    def __init__(self, rules: list[JobRule], proc: str = procfs.PROC) -> None:
        self.rules = rules
        self.proc = proc
        self._compiled = [
            _Compiled(r, GlobSet(r.cmdline) if r.cmdline else None,
                      tuple((var, Glob(g)) for var, g in r.env),
                      _needles(var for var, _ in r.env))
            for r in rules]
        # A rule without a cmdline glob must look at every exec; otherwise the
        # globs of every rule together reject unrelated commands at once.
        self._any_cmd: GlobSet | None = None
        if rules and all(c.cmd is not None for c in self._compiled):
            self._any_cmd = GlobSet(g for r in rules for g in r.cmdline)
        self._need_uid = any(r.users for r in self.rules)
        # every rule needs variables set: the raw environ rejects what lacks them
        self._env_gate = bool(rules) and all(c.needs_env for c in self._compiled)

    @classmethod
    def from_policy(cls, jobs: Iterable[JobSpec], proc: str = procfs.PROC) -> RuleSet:
        """The rules of the policy in force (``Policy.model.jobs``), in policy order."""
        return cls([JobRule.from_policy(j) for j in jobs], proc)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def match(self, pid: int,
              uid_for: Callable[[JobRule], bool] | None = None) -> RuleMatch | None:
        """The first rule matching process ``pid``, or None (also when it is gone).

        Reads at most CMDLINE_MATCH_BYTES of the command line and ENVIRON_MATCH_BYTES
        of the environment; an unrelated exec costs one of the two (module docstring).
        ``uid_for``: the match's uid is read only for a rule it says needs it now (or
        one with ``match.user``); otherwise ``uid`` is None, for the caller to read (the
        exec watcher binds first: /proc/PID/status is ~0.1 ms it reads after).
        """
        if not self.rules:
            return None
        got = None
        if self._any_cmd is not None:
            got = procfs.read_cmdline_prefix(pid, self.proc, CMDLINE_MATCH_BYTES)
            if got is None or not got[0] or not self._any_cmd.match(*got):
                return None  # gone, a kernel thread, or no glob matches
        pieces: procfs.EnvPieces | None = None
        blob = b""
        if self._env_gate:
            pieces = procfs.read_environ_raw(pid, self.proc, ENVIRON_MATCH_BYTES)
            if pieces is None:
                return None  # gone
            blob = pieces[0][0] if len(pieces) == 1 else b"\0".join(p[0] for p in pieces)
            if not any(c.env_possible(blob) for c in self._compiled):
                return None
        if got is None:
            got = procfs.read_cmdline_prefix(pid, self.proc, CMDLINE_MATCH_BYTES)
            if got is None or not got[0]:  # gone, or a kernel thread
                return None
        cmdline, cut = got
        # one rule whose globs matched already (``_any_cmd`` is its GlobSet's patterns)
        matched_cmd = self._any_cmd is not None and len(self._compiled) == 1
        uid = procfs.read_uid(pid, self.proc) if self._need_uid else None
        env: Mapping[str, str] | None = None
        for c in self._compiled:
            rule = c.rule
            if c.cmd is not None and not matched_cmd and not c.cmd.match(cmdline, cut):
                continue
            if rule.users and uid not in rule.uids:
                continue
            if rule.rank and not self._rank_candidate(cmdline):
                continue
            if c.needs_env:
                if pieces is None:
                    pieces = procfs.read_environ_raw(pid, self.proc, ENVIRON_MATCH_BYTES)
                    if pieces is None:
                        return None  # gone
                    blob = (pieces[0][0] if len(pieces) == 1
                            else b"\0".join(p[0] for p in pieces))
                if not c.env_possible(blob):
                    continue
                if env is None:
                    env = procfs.environ_view(pieces)
                if not all((val := env.get(var)) is not None and glob.match(val)
                           for var, glob in c.env):
                    continue
                if rule.rank and not any(v in env for v in RANK_VARS):
                    continue
            if env is None:  # binding needs LOCAL_RANK / CUDA_VISIBLE_DEVICES
                if pieces is None:
                    pieces = procfs.read_environ_raw(pid, self.proc, ENVIRON_MATCH_BYTES)
                env = procfs.environ_view(pieces) if pieces is not None else None
            if uid is None and (uid_for is None or uid_for(rule)):
                uid = procfs.read_uid(pid, self.proc)
            return RuleMatch(rule, pid, cmdline, uid, env or {})
        return None

    @staticmethod
    def _rank_candidate(cmdline: str) -> bool:
        """Cheap part of ``match.rank``: a wrapper or a launcher is never a rank."""
        argv = cmdline.split(" ", 8)
        return not (wrapper_name(argv) or is_launcher(argv))
