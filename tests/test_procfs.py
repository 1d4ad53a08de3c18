"""tunerd.adapters.procfs: the one /proc reader, on recorded trees and on real processes.

Real-process getters are checked against psutil, an independent reader of the
same files, so a wrong field index cannot agree with itself.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import ready_child as child
from tests.helpers import run_as
from tunerd.adapters import procfs
from tunerd.adapters.procfs import Process, Stat
from tunerd.base.errors import Failed, NoSuchProcess, PermissionDenied

# pid 4242 "(py) x (y)": comm with a space and parentheses; env_start/env_end given
STAT = ("4242 (py) x (y) S 1 4242 4242 0 -1 4194560 100 0 0 0 11 7 0 0 20 0 3 0 "
        "987654 10000000 2500 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 "
        "0 0 0 5000 5100 {es} {ee} 0\n")
STATUS = ("Name:\tpy\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\nPid:\t4242\n"
          "PPid:\t1\nUid:\t1000\t0\t0\t0\nGid:\t100\t100\t100\t100\n"
          "CapEff:\t0000000001000000\nvoluntary_ctxt_switches:\t12\n"
          "nonvoluntary_ctxt_switches:\t3\n")
IO = ("rchar: 900\nwchar: 800\nsyscr: 3\nsyscw: 2\nread_bytes: 4096\nwrite_bytes: 8192\n"
      "cancelled_write_bytes: 0\n")
LIMITS = ("Limit                     Soft Limit           Hard Limit           Units     \n"
          "Max open files            1024                 unlimited            files     \n")
NUMA = ("55e0 default file=/usr/bin/python3 mapped=2 N0=2 kernelpagesize_kB=4\n"
        "7f00 interleave:0-1 anon=300 dirty=300 N0=120 N1=180 kernelpagesize_kB=4\n"
        "7f10 bind:1 anon=5 dirty=5 N1=5 kernelpagesize_kB=2048\n"
        "7f20 default\n")


def write(root: Path, rel: str, data: str | bytes) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    p.write_bytes(data)
    return p


def environ_bytes(env: list[tuple[str, str]]) -> bytes:
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in env)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    write(proc, "4242/stat", STAT.format(es=0, ee=0))
    write(proc, "4242/status", STATUS)
    write(proc, "4242/io", IO)
    write(proc, "4242/limits", LIMITS)
    write(proc, "4242/numa_maps", NUMA)
    write(proc, "4242/comm", "py x\n")
    write(proc, "4242/cmdline", b"python3\0-u\0train.py\0--lr\x003\0")
    write(proc, "4242/cgroup", "0::/slurm/job_7\n")
    for tid, state in ((4242, "S"), (4243, "R"), (4244, "R")):
        write(proc, f"4242/task/{tid}/stat", f"{tid} (py) {state} 1 2 3\n")
    for fd in range(5):
        write(proc, f"4242/fd/{fd}", "")
    return proc


# -- recorded trees -------------------------------------------------------------------
def test_stat_fields_after_an_odd_comm(tree: Path) -> None:
    p = Process(4242, tree)
    st = p.stat()
    assert isinstance(st, Stat)
    assert (st.comm, st.state, st.ppid, st.utime, st.stime) == ("py) x (y", "S", 1, 11, 7)
    assert (st.num_threads, st.start_time, st.rss_pages) == (3, 987654, 2500)
    assert p.start_time() == 987654 and p.ppid() == 1 and p.state() == "S"
    assert p.rss() == 2500 * procfs.PAGE_SIZE and p.num_threads() == 3
    assert p.cpu_times() == (11 / procfs.CLK_TCK, 7 / procfs.CLK_TCK)
    assert not p.is_kernel_thread()
    # a short stat (kernels before 3.5 end at field 44): no env bounds, no error
    write(tree, "7/stat", "7 (k) S 2 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 5 0 0")
    assert Process(7, tree).stat().env_start == 0
    assert Process(7, tree).is_kernel_thread()  # PF_KTHREAD (0x200000) in 2129984


def test_status_and_small_files(tree: Path) -> None:
    p = Process(4242, tree)
    with p.oneshot():
        assert p.uids() == (1000, 0) and p.tgid() == 4242 and p.ctx_switches() == (12, 3)
        assert p.cap_effective() == 1 << 24  # CAP_SYS_RESOURCE
    assert p.comm() == "py x"
    assert p.io_counters() == procfs.IoCounters(4096, 8192, 900, 800)
    assert p.nofile() == (1024, None)  # a tree: parsed from limits, never prlimit(2)
    assert p.num_fds() == 5  # a tree: counted, not the real /proc's st_size
    assert p.numa_pages() == {0: 122, 1: 185}
    assert p.numa_bytes() == {0: 122 * 4096, 1: 180 * 4096 + 5 * 2048 * 1024}
    assert p.cgroup() == "0::/slurm/job_7\n"
    assert sorted(p.tids()) == [4242, 4243, 4244] and p.runnable_threads() == 2


def test_oneshot_reads_stat_once(tree: Path) -> None:
    p = Process(4242, tree)
    with p.oneshot():
        assert p.start_time() == 987654
        write(tree, "4242/stat", STAT.format(es=0, ee=0).replace("987654", "1"))
        assert p.start_time() == 987654  # cached inside the block
    assert p.start_time() == 1  # read again outside it


def test_cmdline_prefix_says_when_it_cut(tree: Path) -> None:
    p = Process(4242, tree)
    assert p.cmdline() == ["python3", "-u", "train.py", "--lr", "3"]
    assert p.cmdline_prefix() == ("python3 -u train.py --lr 3", False)
    assert p.cmdline_prefix(10) == ("python3 -u", True)
    assert p.cmdline_text(26) == "python3 -u train.py --lr 3"  # fits exactly: not cut
    assert p.cmdline_prefix(25) == ("python3 -u train.py --lr ", True)
    assert p.cmdline(10) == ["python3", "-u"]
    write(tree, "2/cmdline", b"")  # a kernel thread
    assert Process(2, tree).cmdline() == [] and procfs.read_cmdline(2, str(tree)) == ""


def test_environ_head_and_tail(tree: Path) -> None:
    env = [("HOME", "/root"), *((f"V{i:03d}", "x" * 90) for i in range(100)),
           ("LOCAL_RANK", "3"), ("RANK", "11")]
    raw = environ_bytes(env)
    write(tree, "4242/environ", raw)
    p = Process(4242, tree)
    assert p.environ() == dict(env)
    # without the size (stat fields 50-51 are 0 without ptrace access): the start only
    cut = p.environ(2048)
    assert "HOME" in cut and "LOCAL_RANK" not in cut
    assert all(v == "x" * 90 for k, v in cut.items() if k != "HOME")  # no partial value
    # with it: the first and the last 1 KiB, whole entries only
    write(tree, "4242/stat", STAT.format(es=1000, ee=1000 + len(raw)))
    cut = p.environ(2048)
    assert cut["HOME"] == "/root" and cut["LOCAL_RANK"] == "3" and cut["RANK"] == "11"
    assert "V050" not in cut and all(len(v) == 90 for k, v in cut.items() if k[0] == "V")
    # a tail that starts right after an entry's NUL keeps that entry whole
    tail = environ_bytes([("T", "t" * 1000), ("LOCAL_RANK", "3"), ("RANK", "11")])
    assert len(tail) == 1024
    raw2 = environ_bytes(env[:-2]) + tail
    write(tree, "4242/environ", raw2)
    write(tree, "4242/stat", STAT.format(es=1000, ee=1000 + len(raw2)))
    assert p.environ(2048)["T"] == "t" * 1000
    # ...and one that starts inside an entry drops it: "U=uT=ttt..." is seen from "T="
    raw3 = environ_bytes(env[:-2]) + b"U=u" + tail
    write(tree, "4242/environ", raw3)
    write(tree, "4242/stat", STAT.format(es=1000, ee=1000 + len(raw3)))
    cut = p.environ(2048)
    assert "T" not in cut and "U" not in cut and cut["LOCAL_RANK"] == "3"


def test_one_error_boundary(tree: Path) -> None:
    gone = Process(4343, tree)
    for getter in (gone.stat, gone.status, gone.uids, gone.comm, gone.cmdline, gone.environ,
                   gone.tids, gone.io_counters, gone.num_fds, gone.nofile, gone.numa_pages):
        with pytest.raises(NoSuchProcess, match="no process with pid 4343") as exc:
            getter()
        assert exc.value.details["pid"] == 4343
    write(tree, "4242/stat", STAT.format(es=0, ee=0).replace(") S ", ") Z "))
    p = Process(4242, tree)
    assert p.stat().state == "Z"  # a zombie is still there...
    with pytest.raises(NoSuchProcess, match="process 4242 has exited"):
        p.stat(alive=True)  # ...but not alive
    write(tree, "4242/stat", "garbage")
    with pytest.raises(Failed, match=f"unexpected content in {tree}/4242"):
        p.stat()
    write(tree, "4242/status", "Name:\tpy\n")  # no Uid line
    with pytest.raises(Failed, match="'Uid'"):
        p.uids()


def test_thin_functions_return_none_for_a_gone_process(tree: Path) -> None:
    root = str(tree)
    assert procfs.read_start_time(4242, root) == 987654
    assert procfs.read_ppid(4242, root) == 1 and procfs.read_uid(4242, root) == 1000
    assert procfs.read_comm(4242, root) == "py x"
    assert procfs.read_cmdline(4242, root) == "python3 -u train.py --lr 3"
    assert procfs.read_cmdline_prefix(4242, root, 7) == ("python3", True)
    for fn in (procfs.read_start_time, procfs.read_ppid, procfs.read_uid, procfs.read_comm,
               procfs.read_cmdline, procfs.read_cmdline_prefix, procfs.read_environ):
        assert fn(4343, root) is None
    assert procfs.list_tids(4343, root) == [] and procfs.list_pids(root) == [4242]
    assert procfs.list_pids(str(tree / "nowhere")) == []


def test_children_and_descendants(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for pid, ppid in ((1, 0), (10, 1), (11, 10), (12, 10), (13, 12), (20, 1)):
        write(proc, f"{pid}/stat", f"{pid} (x) S {ppid} 0 0 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 "
                                   f"{pid * 3} 0 0\n")
    assert sorted(procfs.children_map(str(proc))[10]) == [11, 12]
    assert sorted(procfs.descendants(10, str(proc))) == [10, 11, 12, 13]
    assert sorted(procfs.descendants(10, str(proc), include_root=False)) == [11, 12, 13]
    order = procfs.descendants(1, str(proc))
    assert all(order.index(c) > order.index(p) for p, c in ((1, 10), (10, 12), (12, 13)))
    kids = {10: [12], 12: [13]}  # a map the caller has: /proc is not swept again
    assert procfs.descendants(10, str(tmp_path / "nowhere"), kids=kids) == [10, 12, 13]


def test_small_file_helpers(tmp_path: Path) -> None:
    f = write(tmp_path, "big", b"x" * 200_000)
    assert len(procfs.read_bytes(f)) == procfs.SMALL_READ
    assert len(procfs.read_bytes(f, None)) == 200_000
    assert procfs.read_bytes(f, 10) == b"x" * 10
    assert procfs.read_value(write(tmp_path, "v", " 42\n")) == "42"
    assert procfs.read_value(tmp_path / "missing") is None
    with pytest.raises(FileNotFoundError) as exc:
        procfs.read_text(tmp_path / "missing")
    assert exc.value.filename == str(tmp_path / "missing")


# -- real processes -------------------------------------------------------------------
CHILD = """
import os, resource, sys, threading, time
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 400))
fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(20)]
with open("/proc/self/exe", "rb") as f:
    f.read(1 << 20)
for _ in range(3):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_every_getter_on_a_real_process_agrees_with_psutil() -> None:
    env = {"PATH": os.environ.get("PATH", ""), "LOCAL_RANK": "1", "X": "a=b"}
    with child(CHILD, ["--lr", "3 4"], env) as c:
        p, ps = Process(c.pid), psutil.Process(c.pid)
        with ps.oneshot():
            assert p.ppid() == ps.ppid() == os.getpid()
            assert p.uids() == (ps.uids().real, ps.uids().effective)
            assert p.num_threads() == ps.num_threads() == 4
            assert sorted(p.tids()) == sorted(t.id for t in ps.threads())
            assert p.cmdline() == ps.cmdline() == [sys.executable, "-c", CHILD, "--lr", "3 4"]
            assert p.environ() == ps.environ() == env
            assert p.comm() == ps.name()
            assert p.nofile() == ps.rlimit(resource.RLIMIT_NOFILE) == (300, 400)
            assert p.num_fds() == ps.num_fds() == len(os.listdir(f"/proc/{c.pid}/fd"))
            assert p.io_counters().read_bytes == ps.io_counters().read_bytes
            assert p.io_counters().rchar == ps.io_counters().read_chars >= 1 << 20
            # stat and statm read the same per-CPU-batched counters a moment apart
            assert abs(p.rss() - ps.memory_info().rss) < 1 << 20
            # a live process: its threads may switch between our read and psutil's
            ours, theirs = p.ctx_switches(), tuple(ps.num_ctx_switches())
            assert all(abs(a - b) <= 3 for a, b in zip(ours, theirs, strict=True)), (ours, theirs)
            boot = psutil.boot_time()
            assert abs(boot + p.start_time() / procfs.CLK_TCK - ps.create_time()) < 0.05
            user, system = p.cpu_times()
            assert abs(user - ps.cpu_times().user) < 0.05
            assert abs(system - ps.cpu_times().system) < 0.05
        assert sum(p.numa_pages().values()) > 0 and p.runnable_threads() >= 0
        assert p.state() in ("S", "R") and not p.is_kernel_thread()
        assert p.cgroup().startswith("0::/") or ":cpuset:" in p.cgroup()


def test_a_real_exited_process() -> None:
    proc = subprocess.Popen(["/bin/true"])
    deadline = time.monotonic() + 10
    while Process(proc.pid).stat().state != "Z":  # exited, not reaped yet
        assert time.monotonic() < deadline
        time.sleep(0.01)
    zombie = Process(proc.pid)
    with pytest.raises(NoSuchProcess, match=f"process {proc.pid} has exited"):
        zombie.stat(alive=True)
    assert zombie.cmdline() == [] and procfs.read_start_time(proc.pid) is not None
    proc.wait()
    with pytest.raises(NoSuchProcess, match=f"no process with pid {proc.pid}"):
        zombie.stat()
    assert procfs.read_start_time(proc.pid) is None


def test_a_kernel_thread() -> None:
    if procfs.read_comm(2) != "kthreadd":
        pytest.skip("kthreadd is not visible here (a PID namespace)")
    assert Process(2).is_kernel_thread() and Process(2).comm() == "kthreadd"
    assert procfs.read_cmdline(2) == ""


def test_a_huge_environment_keeps_what_launchers_append() -> None:
    """torchrun appends LOCAL_RANK after a copy of its own environment."""
    env = {"FIRST": "1", **{f"BIG{i}": "z" * 4000 for i in range(100)}, "LOCAL_RANK": "5"}
    with child("print('ready', flush=True)\nimport time\ntime.sleep(60)", env=env) as c:
        p = Process(c.pid)
        assert p.environ() == env  # 400 KiB: under the default bound
        cut = p.environ(64 << 10)
        assert cut["FIRST"] == "1" and cut["LOCAL_RANK"] == "5"
        assert 0 < len(cut) < len(env) and all(len(v) == 4000 for k, v in cut.items()
                                               if k.startswith("BIG"))


def test_a_huge_command_line_is_cut() -> None:
    args = ["a" * 100_000] * 10 + ["--end"]
    with child("print('ready', flush=True)\nimport time\ntime.sleep(60)", args) as c:
        text, cut = Process(c.pid).cmdline_prefix(16 << 10)
        assert cut and len(text) == 16 << 10 and text.startswith(sys.executable + " -c ")
        full, cut = Process(c.pid).cmdline_prefix()
        assert not cut and full.endswith(" --end")


@pytest.mark.root
def test_permission_errors_become_permission_denied(unpriv_user: tuple[int, int]) -> None:
    def read() -> list[str]:
        out = []
        p = Process(1)
        for getter in (p.environ, p.io_counters):
            try:
                getter()
            except PermissionDenied as err:
                out.append(err.message)
        assert p.stat().ppid == 0  # stat is readable by anyone
        return out

    msgs = run_as(*unpriv_user, read)
    assert msgs == ["cannot read /proc/1/environ (pid 1): permission denied",
                    "cannot read /proc/1/io (pid 1): permission denied"]


@pytest.mark.parametrize("raw,cut_tail", [
    (b"A=1\0B=2\0A=3\0", False),  # the first one wins
    (b"PATH=/bin\0NOEQ\0=empty\0E=\0LOCAL_RANK=1\0X=LOCAL_RANK=9\0", False),
    (b"A=1\0LOCAL_RANK=0\0TAIL=par", True),  # the partial last entry is left out
    (b"LOCAL_RANK=2\0U=\xc3\xa9\xff\0LAST=whole", False),  # no NUL at the end: whole
    (b"", False),
])
def test_an_environ_view_looks_up_what_a_full_parse_finds(raw: bytes, cut_tail: bool) -> None:
    full = procfs.parse_environ_pieces([(raw, False, cut_tail)])
    view = procfs.environ_view([(raw, False, cut_tail)])
    assert isinstance(view, procfs.EnvironView)
    for key in ("A", "B", "PATH", "NOEQ", "E", "LOCAL_RANK", "X", "TAIL", "U", "LAST",
                "", "RANK", "é"):
        assert view.get(key) == full.get(key), key
        assert (key in view) == (key in full), key
    assert dict(view) == full and len(view) == len(full)
    # a head + tail read of a large environment is parsed whole
    assert isinstance(procfs.environ_view([(b"A=1\0B", False, True), (b"C=3\0", True, False)]),
                      dict)
