"""A real single-node Slurm for the contrib/slurm tests, and a tunerd beside it.

``slurm`` (module-scoped fixture) starts munged, slurmctld and slurmd from the
distribution's slurm-wlm 22.05 in a temporary directory: its own munge key and
socket, its own slurm.conf / gres.conf / cgroup.conf (SLURM_CONF), this host as
the only node, ``TaskPlugin=task/affinity,task/cgroup``,
``ProctrackType=proctrack/cgroup`` on the cgroup v1 hierarchies, two ``gpu`` gres
backed by character devices made with mknod in the temporary directory
(``AutoDetect=off``), and copies of contrib/slurm as TaskProlog and Epilog with a
``tunerd-slurm.conf`` next to them. Every daemon runs in the foreground as a child
of the test, so teardown stops them by PID; every wait is bounded, so a hung
Slurm fails the test instead of hanging the suite.

``start_tunerd`` / ``running_tunerd`` start a real tunerd replaying this machine's
topology, recorded when the daemon starts, plus two GPUs (the same two the Slurm
node has as gres), one local to the first CPU and one to the last
(tests/leases_helpers.snapshot_with_gpus_here): every CPU it places on exists here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.helpers import REPO, DaemonProc, wait_for, write_policy
from tests.leases_helpers import snapshot_with_gpus_here
from tests.monitor_helpers import free_port

CONTRIB = REPO / "contrib" / "slurm"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Slurm's cgroup v1 plugin puts everything under <controller>/slurm, or
# <controller>/slurm_<nodename> in builds for several slurmd per host (Debian's)
SLURM_CGROUP_CONTROLLERS = ("cpuset", "freezer", "devices", "memory", "cpu", "cpuacct")
# Two test sessions on one host would share those cgroup trees: take turns.
LOCK_PATH = Path(tempfile.gettempdir()) / "tunerd-test-slurm.lock"
LOCK_WAIT_S = 600.0
NVIDIA_MAJOR = 195
REQUIRED = {"munged": "munge", "munge": "munge", "slurmctld": "slurm-wlm",
            "slurmd": "slurm-wlm", "srun": "slurm-wlm", "sbatch": "slurm-wlm",
            "scontrol": "slurm-wlm", "squeue": "slurm-wlm", "scancel": "slurm-wlm",
            "sinfo": "slurm-wlm"}


class SlurmError(AssertionError):
    """Slurm did not do what a test needed within its time bound (fails the test)."""


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return f"({path}: {err.strerror})"
    return f"--- {path.name} (last {lines} lines)\n" + "\n".join(text.splitlines()[-lines:])


class SyslogSink:
    """A datagram socket the scripts' logger writes to (SYSLOG_SOCKET in their config).

    Read all the time by a thread: a Unix datagram socket queues only
    net.unix.max_dgram_qlen (10) messages, and then logger blocks (the scripts'
    bound on logger then drops the line; that is their job, not this sink's).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        path.chmod(0o666)  # job users log as themselves
        self.sock.settimeout(0.1)
        self.seen: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="syslog-sink", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.seen.append(data.decode(errors="replace"))

    def messages(self) -> list[str]:
        """Every message received so far."""
        with self._lock:
            return list(self.seen)

    def wait_for(self, needle: str, timeout: float = 10.0) -> str:
        return str(wait_for(lambda: next((m for m in self.messages() if needle in m), None),
                            timeout, f"a syslog message with {needle!r}", interval=0.1,
                            detail=lambda: "\n".join(self.messages()[-10:])))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@dataclass
class Job:
    jobid: int
    output: Path


@dataclass
class SlurmCluster:
    root: Path
    nodename: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    cgroups_before: set[Path] = field(default_factory=set)
    syslog: SyslogSink | None = None
    # how long stop() waits for each cgroup slurmd made to empty before it goes on
    CGROUP_WAIT_S: ClassVar[float] = 5.0

    # -- paths ----------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def scripts(self) -> Path:
        """Copies of contrib/slurm: the TaskProlog and Epilog slurmd runs."""
        return self.root / "contrib"

    @property
    def script_conf(self) -> Path:
        return self.scripts / "tunerd-slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.sock"

    @property
    def gpu_devices(self) -> list[Path]:
        return [self.root / "dev" / f"nvidia{i}" for i in range(2)]

    @property
    def slurmd_log(self) -> Path:
        return self.root / "log" / "slurmd.log"

    @property
    def slurmctld_log(self) -> Path:
        return self.root / "log" / "slurmctld.log"

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm commands: ours, minus any outer job's SLURM_*."""
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "CUDA_"))}
        return {**base, "SLURM_CONF": str(self.conf)}

    def logs(self) -> str:
        return "\n".join(tail(p) for p in (self.slurmctld_log, self.slurmd_log,
                                            self.root / "log" / "munged.out"))

    # -- set-up ---------------------------------------------------------------------
    def write_config(self) -> None:
        for d in ("etc", "munge", "dev", "log", "state", "spool", "jobs", "contrib"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o755)  # job users reach munged's socket
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        for i, dev in enumerate(self.gpu_devices):
            os.mknod(dev, 0o666 | 0o020000, os.makedev(NVIDIA_MAJOR, i))  # S_IFCHR
        install_scripts(self.scripts)
        cpu_line = node_hardware()
        log = self.root / "log"
        (self.root / "etc" / "plugstack.conf").write_text("")
        self.conf.write_text(f"""\
# written by tests/slurm_helpers.py for one test module; removed after it
ClusterName=tunerdtest
SlurmctldHost={self.nodename}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={self.root / "state"}
SlurmdSpoolDir={self.root / "spool"}
SlurmctldPidFile={self.root / "slurmctld.pid"}
SlurmdPidFile={self.root / "slurmd.pid"}
SlurmctldLogFile={log / "slurmctld.log"}
SlurmdLogFile={log / "slurmd.log"}
SlurmctldDebug=info
SlurmdDebug=debug
PlugStackConfig={self.root / "etc" / "plugstack.conf"}
ProctrackType=proctrack/cgroup
TaskPlugin=task/affinity,task/cgroup
TaskProlog={self.scripts / "tunerd-task-prolog.sh"}
Epilog={self.scripts / "tunerd-epilog.sh"}
GresTypes=gpu
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MessageTimeout=10
KillWait=2
InactiveLimit=0
MinJobAge=600
SlurmdTimeout=300
NodeName={self.nodename} NodeAddr=127.0.0.1 {cpu_line} RealMemory=500 Gres=gpu:2 State=UNKNOWN
PartitionName=test Nodes={self.nodename} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
        (self.root / "etc" / "gres.conf").write_text(
            "AutoDetect=off\n" + "".join(f"Name=gpu File={d}\n" for d in self.gpu_devices))
        (self.root / "etc" / "cgroup.conf").write_text("""\
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
CgroupAutomount=no
ConstrainCores=yes
ConstrainDevices=yes
ConstrainRAMSpace=no
""")
        self.syslog = SyslogSink(self.root / "syslog.sock")

    def configure_scripts(self, socket_path: Path | str, timeout: float = 1.0,
                          user_messages: str = "all", extra: str = "") -> None:
        """(Re)write the scripts' admin config; they read it on every run."""
        assert self.syslog is not None
        write_script_conf(self.script_conf, socket_path, self.syslog.path, timeout=timeout,
                          user_messages=user_messages, extra=extra)

    def start(self) -> None:
        self.write_config()
        self.cgroups_before = {p for p in self.cgroup_dirs() if p.exists()}
        self.spawn("munged", ["munged", "--foreground", "--force",
                              f"--socket={self.munge_socket}",
                              f"--key-file={self.root / 'munge' / 'munge.key'}",
                              f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                              f"--log-file={self.root / 'log' / 'munged.log'}",
                              f"--seed-file={self.root / 'munge' / 'munged.seed'}"])
        wait_for(self.munge_socket.exists, 20, "munged's socket", interval=0.1, detail=self.logs)
        self.spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        wait_for(lambda: self.cmd("scontrol", "ping", timeout=10).returncode == 0
                 and "UP" in self.cmd("scontrol", "ping", timeout=10).stdout,
                 60, "slurmctld answering `scontrol ping`", interval=0.3, detail=self.logs)
        # slurmd as a child subreaper (PR_SET_CHILD_SUBREAPER, kept across exec): the
        # slurmstepd it forks detaches, and would be reparented to init, outside the
        # test daemons' scope (--scope-pid: this test run's subtree); it stays below
        # slurmd instead, so the tasks of the test's jobs are in scope
        self.spawn("slurmd", [sys.executable, "-c", _SUBREAPER_EXEC, "slurmd", "-D", "-f",
                              str(self.conf), "-N", self.nodename])
        wait_for(lambda: self.node_state() == "IDLE", 90, f"node {self.nodename} idle",
                 interval=0.3, detail=lambda: f"state {self.node_state()}\n{self.logs()}")

    def spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the child owns it
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env,
                                            cwd=self.root, start_new_session=True)
        log.close()
        time.sleep(0.1)
        rc = self.procs[name].poll()
        if rc is not None:
            raise SlurmError(f"{name} exited with {rc} at start\n{self.logs()}\n"
                             + tail(self.root / "log" / f"{name}.out"))

    def cgroup_dirs(self) -> list[Path]:
        return slurm_cgroup_dirs(self.nodename)

    # -- teardown -------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, stop slurmd, slurmctld and munged by PID, remove our cgroups."""
        problems: list[str] = []
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            # a failed wait (AssertionError, SlurmError) must not skip the rest of the
            # clean-up: it is noted, and the daemons are stopped below anyway
            try:
                for jobid in self.jobs():
                    self.cmd("scancel", str(jobid), timeout=10)
                wait_for(lambda: not self.jobs(), 30, "all test jobs gone", interval=0.3)
            except (subprocess.TimeoutExpired, AssertionError) as err:
                problems.append(f"jobs not cancelled: {err}")
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                problems.append(f"{name} (pid {p.pid}) ignored SIGTERM for 15 s; killed")
                p.kill()
                p.wait()
        # slurmstepd daemonizes, so it is no child of ours: whatever is left in the
        # cgroups slurmd made for this run was started by it, for these tests
        made = [p for p in self.cgroup_dirs() if p.exists() and p not in self.cgroups_before]
        for cg in made:
            for procs in sorted(cg.rglob("cgroup.procs"), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    for pid in procs.read_text().split():
                        problems.append(f"killed leftover pid {pid} in {procs.parent}")
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
        for cg in made:
            dirs = sorted((d for d in cg.rglob("*") if d.is_dir()),
                          key=lambda d: -len(d.parts))
            for d in [*dirs, cg]:
                try:
                    wait_for(lambda d=d: not _procs_in(d), self.CGROUP_WAIT_S, f"{d} empty",
                             interval=0.1)
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except (OSError, AssertionError) as err:
                    problems.append(f"could not remove {d}: {err}")
        if self.syslog is not None:
            self.syslog.close()
        if problems:
            print("slurm teardown: " + "; ".join(problems))

    # -- commands -------------------------------------------------------------------
    def cmd(self, *argv: str, timeout: float = 30.0, **kw: Any
            ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster, bounded in time."""
        try:
            return subprocess.run(list(argv), capture_output=True, text=True, env=self.env,
                                  cwd=self.root / "jobs", timeout=timeout, **kw)
        except subprocess.TimeoutExpired as err:
            raise SlurmError(f"`{' '.join(argv)}` did not finish in {timeout:g} s"
                             f"\n{self.logs()}") from err

    def srun(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self.cmd("srun", "--quiet", *args, timeout=timeout)

    def sbatch(self, script: str, *args: str) -> Job:
        """Submit ``script`` (bash); its output goes to a file of its own."""
        out = self.root / "jobs" / f"job-{time.monotonic_ns()}.out"
        path = out.with_suffix(".sh")
        path.write_text("#!/bin/bash\n" + script)
        r = self.cmd("sbatch", "--parsable", f"--output={out}", *args, str(path))
        if r.returncode != 0:
            raise SlurmError(f"sbatch failed: {r.stderr}\n{self.logs()}")
        return Job(int(r.stdout.strip().split(";")[0]), out)

    def jobs(self) -> list[int]:
        r = self.cmd("squeue", "-h", "-o", "%i", timeout=10)
        return [int(x) for x in r.stdout.split()]

    def job_field(self, jobid: int, key: str) -> str | None:
        r = self.cmd("scontrol", "-o", "show", "job", str(jobid), timeout=10)
        m = re.search(rf"\b{key}=(\S*)", r.stdout)
        return m.group(1) if m else None

    def wait_job_running(self, job: Job, timeout: float = 30.0) -> None:
        wait_for(lambda: self.job_field(job.jobid, "JobState") == "RUNNING", timeout,
                 f"job {job.jobid} running", interval=0.2,
                 detail=lambda: f"{self.job_field(job.jobid, 'JobState')}\n{self.logs()}")

    def wait_output(self, job: Job, needle: str, timeout: float = 30.0) -> str:
        def found() -> str | None:
            try:
                text = job.output.read_text(errors="replace")
            except FileNotFoundError:
                return None
            return text if needle in text else None

        return str(wait_for(found, timeout, f"{needle!r} in job {job.jobid}'s output",
                            interval=0.1, detail=lambda: tail(job.output) + "\n" + self.logs()))

    def cancel(self, job: Job, timeout: float = 30.0) -> None:
        self.cmd("scancel", str(job.jobid), timeout=10)
        wait_for(lambda: job.jobid not in self.jobs(), timeout, f"job {job.jobid} gone",
                 interval=0.2)

    def node_state(self) -> str | None:
        r = self.cmd("scontrol", "-o", "show", "node", self.nodename, timeout=10)
        m = re.search(r"\bState=(\S+)", r.stdout)
        return m.group(1) if m else None


def tunerctl_command() -> str:
    """How the scripts run this checkout's tunerctl (TUNERCTL in their config)."""
    entry = Path(sys.executable).parent / "tunerctl"
    return str(entry) if entry.exists() else f"{sys.executable} -m tunerd.cli.main"


def install_scripts(dest: Path) -> Path:
    """Copies of contrib/slurm/*.sh in ``dest`` (a config next to them is theirs only)."""
    dest.mkdir(parents=True, exist_ok=True)
    for src in sorted(CONTRIB.glob("*.sh")):
        shutil.copy2(src, dest / src.name)
    return dest


def write_script_conf(path: Path, socket_path: Path | str, syslog_socket: Path | None,
                      timeout: float = 1.0, user_messages: str = "all",
                      extra: str = "") -> Path:
    """The scripts' admin config (tunerd-slurm.conf next to them)."""
    lines = [f"TUNERCTL={tunerctl_command()}", f"TUNERD_SOCKET={socket_path}",
             f"TIMEOUT={timeout:g}", f"USER_MESSAGES={user_messages}"]
    if syslog_socket is None:
        lines.append("SYSLOG=no")
    else:
        lines += ["SYSLOG=yes", f"SYSLOG_SOCKET={syslog_socket}"]
    path.write_text("\n".join(lines) + "\n" + extra)
    path.chmod(0o644)
    return path


def slurm_cgroup_dirs(nodename: str) -> list[Path]:
    return [CGROUP_ROOT / c / name for c in SLURM_CGROUP_CONTROLLERS
            for name in ("slurm", f"slurm_{nodename}")]


def _procs_in(d: Path) -> bool:
    try:
        return bool((d / "cgroup.procs").read_text().strip())
    except OSError:
        return False


def node_hardware() -> str:
    """CPUs/sockets/cores/threads of this host as slurmd sees them (`slurmd -C`)."""
    r = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30)
    m = re.search(r"(CPUs=\d+ .*ThreadsPerCore=\d+)", r.stdout)
    if r.returncode != 0 or not m:
        raise SlurmError(f"`slurmd -C` did not describe this host: {r.stdout}{r.stderr}")
    return m.group(1)


def missing_packages() -> list[str]:
    return sorted({pkg for tool, pkg in REQUIRED.items() if shutil.which(tool) is None})


def require_slurm() -> None:
    """Skip (with the reason) where Slurm is not installed; fail where it cannot run."""
    if os.geteuid() != 0:
        pytest.skip("a real Slurm needs root (munged, slurmd and cgroups)")
    missing = missing_packages()
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (scripts/test.sh installs them)")
    if not (CGROUP_ROOT / "cpuset" / "cpuset.cpus").exists():
        raise SlurmError("these tests run Slurm's cgroup/v1 plugin and need the v1 cpuset "
                         f"hierarchy at {CGROUP_ROOT / 'cpuset'}; this host has none")


def open_lock_file(path: Path) -> int:
    """Open (creating it 0600) the lock file ``path`` in a world-writable dir, as root.

    Another local user could have made ``path`` first: a symlink (root would then
    create or append to a file of their choosing), a FIFO (open would block) or a
    file of their own (they could hold the lock for ever). Only a regular file owned
    by root is taken; anything else is a SlurmError naming it.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise SlurmError(f"cannot open the lock file {path}: {err.strerror} (remove it if "
                         "it is not a regular file owned by root)") from err
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
        os.close(fd)
        raise SlurmError(f"the lock file {path} is not a regular file owned by root "
                         f"(mode {st.st_mode:o}, uid {st.st_uid}): remove it")
    return fd


@contextlib.contextmanager
def host_lock(path: Path = LOCK_PATH, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """One real Slurm per host at a time (bounded wait)."""
    fd = open_lock_file(path)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SlurmError(f"another test session held {path} for "
                                     f"{wait_s:g} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """A running single-node Slurm (see the module docstring); torn down by PID after."""
    require_slurm()
    with host_lock():
        for d in slurm_cgroup_dirs(socket.gethostname().split(".")[0]):
            if d.exists() and any(p.is_dir() and p.name != "system" for p in d.iterdir()):
                raise SlurmError(f"{d} has job cgroups: is another slurmd running here?")
        root = Path(tempfile.mkdtemp(prefix="tunerd-slurm-"))
        root.chmod(0o755)
        cluster = SlurmCluster(root)
        try:
            cluster.start()
            yield cluster
        finally:
            try:
                cluster.stop()
            finally:
                shutil.rmtree(root, ignore_errors=True)


SLURM_POLICY = """\
[policy]
name = "slurm-test"
"""


def start_tunerd(base: Path, policy: str = SLURM_POLICY,
                 args: list[str] | None = None) -> DaemonProc:
    """A real tunerd replaying this machine plus two GPUs, its dirs under ``base``."""
    base.mkdir(parents=True, exist_ok=True)
    pdir = base / "policies"
    write_policy(pdir, "00-test.toml", policy)
    topology, _, _ = snapshot_with_gpus_here(base / "topology.json")
    d = DaemonProc(tmp=base, policy_dir=pdir,
                   extra_args=["--topology", str(topology), *(args or [])])
    return d.start()


@contextlib.contextmanager
def running_tunerd(base: Path, policy: str = SLURM_POLICY) -> Iterator[DaemonProc]:
    d = start_tunerd(base, policy)
    try:
        yield d
    finally:
        with contextlib.suppress(Exception):
            if d.proc is not None and d.proc.poll() is None:
                d.proc.send_signal(signal.SIGCONT)  # a test may have stopped it
        d.stop()


@contextlib.contextmanager
def hung_socket(path: Path) -> Iterator[Path]:
    """A listening Unix socket that accepts connections into its backlog, never answers."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(16)
    try:
        yield path
    finally:
        s.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# runs argv[1:] as a child subreaper: prctl(PR_SET_CHILD_SUBREAPER = 36, 1), then exec
_SUBREAPER_EXEC = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(36, 1, 0, 0, 0); "
                   "os.execvp(sys.argv[1], sys.argv[1:])")
