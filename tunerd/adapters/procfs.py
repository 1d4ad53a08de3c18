"""The one reader of /proc/PID, plus the small-file helpers for /proc and /sys.

In the spirit of psutil's ``_pslinux.py``: one class, :class:`Process`, with typed
getters over an injectable proc root (tests point it at a recorded tree), and ONE
error boundary that turns what the kernel says about a process into tunerd's
errors:

* the process is gone (``ENOENT``/``ESRCH``: its /proc/PID vanished or was being torn
  down) -> :class:`~tunerd.base.errors.NoSuchProcess` naming the pid;
* a zombie, where the caller asks for a live process (``alive=True``): it has
  exited, only its pid and exit status are left -> ``NoSuchProcess``;
* ``EACCES``/``EPERM`` -> :class:`~tunerd.base.errors.PermissionDenied`;
* any other ``OSError``, or a file that does not parse -> :class:`~tunerd.base.errors.Failed`.

Hot paths that treat an exited process as the normal case (the exec watcher,
leases, the pid watcher) use the thin module functions at the end instead
(``read_start_time``, ``read_cmdline``, ...): they return ``None`` when the process
is gone or unreadable.

Why not psutil for all of it: psutil has no per-object proc root (only a global),
reports start time as float seconds where binding needs the exact clock ticks of
stat field 22 for pid identity, reads all of a command line where the exec path
wants a bounded prefix, and its ``oneshot()`` of the job sampler's fields costs
two to four times this reader (bench/procfs_readers.py measures both side by side).

Small files. :func:`read_bytes`/:func:`read_text` read a /proc or /sys file and
raise ``OSError`` as the kernel gave it (errno and file name); :func:`read_value`
is for single-value sysfs/procfs files that may be missing on some machines and
returns ``None`` for any ``OSError`` ("reads degrade", DESIGN.md). That is the one
documented error behaviour: raise, or ``None`` only where the name says so.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import resource
import stat as _stat
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

from tunerd.base.errors import Failed, NoSuchProcess, PermissionDenied, TunerdError

__all__ = [
    "ARG_READ_MAX",
    "CLK_TCK",
    "O_ACCMODE",
    "O_PATH",
    "PAGE_SIZE",
    "PF_KTHREAD",
    "PROC",
    "Creds",
    "EnvPieces",
    "EnvironView",
    "IoCounters",
    "OpenDevice",
    "Process",
    "Stat",
    "children_map",
    "descendants",
    "environ_view",
    "in_initial_pid_namespace",
    "list_pids",
    "list_tids",
    "lock_holders",
    "open_char_devices",
    "parse_io",
    "parse_limits_nofile",
    "parse_numa_maps",
    "parse_stat",
    "parse_status",
    "pid_namespace",
    "read_bytes",
    "read_cmdline",
    "read_cmdline_prefix",
    "read_comm",
    "read_creds",
    "read_environ",
    "read_environ_raw",
    "read_environ_view",
    "read_maps",
    "read_ppid",
    "read_start_time",
    "read_text",
    "read_uid",
    "read_value",
]

PROC = "/proc"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
PF_KTHREAD = 0x00200000  # include/linux/sched.h
SMALL_READ = 1 << 16  # stat, status, io, limits, cgroup: far below this
# cmdline/environ: the kernel allows up to stack-limit/4 (2 MiB by default) of both;
# readers that do not pass a bound get at most this much
ARG_READ_MAX = 1 << 20
_CHUNK = 1 << 16

PathLike = str | os.PathLike[str]


# -- small files ------------------------------------------------------------------
def read_bytes(path: PathLike, limit: int | None = SMALL_READ) -> bytes:
    """At most ``limit`` bytes of ``path`` (all of it with ``limit=None``).

    Raises ``OSError`` (``FileNotFoundError``, ``PermissionError``, ...) with the
    file name. Reads until end of file: seq_file-backed files such as numa_maps
    return short reads before the end when the next line does not fit.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        first = os.read(fd, _CHUNK if limit is None else limit)
        if not first or (limit is not None and len(first) >= limit):
            return first
        chunks = [first]
        total = len(first)
        while limit is None or total < limit:
            b = os.read(fd, _CHUNK if limit is None else min(_CHUNK, limit - total))
            if not b:
                break
            chunks.append(b)
            total += len(b)
        return b"".join(chunks)
    except OSError as err:
        if err.filename is None:
            err.filename = os.fspath(path)
        raise
    finally:
        os.close(fd)


def read_text(path: PathLike, limit: int | None = SMALL_READ) -> str:
    """:func:`read_bytes` decoded as UTF-8 (bad bytes replaced); raises ``OSError``."""
    return read_bytes(path, limit).decode("utf-8", "replace")


def read_value(path: PathLike) -> str | None:
    """A one-value sysfs/procfs file, stripped; ``None`` when absent or unreadable.

    Any ``OSError`` gives ``None``: besides ENOENT/EACCES, drivers answer EINVAL,
    EIO or ENODEV for a value they cannot report, which is "not available" too.
    """
    try:
        return read_text(path).strip()
    except OSError:
        return None


def _read_once(path: str, size: int = SMALL_READ) -> bytes:
    """One read(2): enough for files the kernel renders as one record (stat, status,
    io, limits, comm, cgroup), which a read of at least their size returns whole."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


# -- parsing ------------------------------------------------------------------------
class Stat(NamedTuple):
    """The fields of /proc/PID/stat that tunerd uses (proc(5) field numbers)."""

    comm: str  # (2) may hold spaces and parentheses
    state: str  # (3) R S D Z T t X I ...
    ppid: int  # (4)
    flags: int  # (9) PF_* bits
    utime: int  # (14) clock ticks
    stime: int  # (15) clock ticks
    num_threads: int  # (20)
    start_time: int  # (22) clock ticks after boot: with the pid, a unique identity
    rss_pages: int  # (24)
    env_start: int  # (50) 0 without ptrace access to the process (or before Linux 3.5)
    env_end: int  # (51)


def parse_stat(raw: bytes | str) -> Stat:
    """Parse /proc/PID/stat. The comm (field 2) may contain spaces and ')': the
    fields are counted after the LAST ')'."""
    if isinstance(raw, str):
        raw = raw.encode()
    close = raw.rindex(b")")
    comm = raw[raw.index(b"(") + 1:close].decode("utf-8", "replace")
    f = raw[close + 2:].split()
    # f[0] is field 3, so field N is f[N - 3]
    return Stat(comm, f[0].decode(), int(f[1]), int(f[6]), int(f[11]), int(f[12]),
                int(f[17]), int(f[19]), int(f[21]),
                int(f[47]) if len(f) > 48 else 0, int(f[48]) if len(f) > 48 else 0)


def parse_status(text: str) -> dict[str, str]:
    """/proc/PID/status as ``{key: raw value}`` (``"Uid": "1000\\t1000\\t1000\\t1000"``)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, val = line.partition(":")
        if sep:
            out[key] = val.strip()
    return out


class IoCounters(NamedTuple):
    """/proc/PID/io: what the process read and wrote (storage bytes and syscall bytes)."""

    read_bytes: int  # bytes fetched from storage
    write_bytes: int  # bytes sent to storage
    rchar: int  # bytes returned by read(2)-like calls, page cache and /proc included
    wchar: int


def parse_io(text: str) -> IoCounters:
    # "rchar: 900\nwchar: 800\n...": names and values alternate
    tok = text.split()
    vals = dict(zip(tok[::2], tok[1::2], strict=False))
    return IoCounters(int(vals["read_bytes:"]), int(vals["write_bytes:"]),
                      int(vals["rchar:"]), int(vals["wchar:"]))


_NUMA_NODE = re.compile(r" N(\d+)=(\d+)")


def parse_numa_maps(text: str, *, as_bytes: bool = True) -> dict[int, int]:
    """NUMA node -> resident bytes (or pages, ``as_bytes=False``) over every mapping.

    Each line lists ``N<node>=<pages>`` in units of that mapping's
    ``kernelpagesize_kB`` (huge pages count 2 MiB or 1 GiB each).
    """
    nodes: dict[int, int] = {}
    find = _NUMA_NODE.findall
    for line in text.splitlines():
        counts = find(line)
        if not counts:
            continue
        unit = 1
        if as_bytes:
            k = line.find(" kernelpagesize_kB=")
            unit = (int(line[k + 19:].split(None, 1)[0]) if k >= 0 else 4) * 1024
        for nid, npages in counts:
            n = int(nid)
            nodes[n] = nodes.get(n, 0) + int(npages) * unit
    return nodes


def parse_limits_nofile(text: str) -> tuple[int | None, int | None]:
    """(soft, hard) "Max open files" from /proc/PID/limits; None means unlimited."""
    for line in text.splitlines():
        if line.startswith("Max open files"):
            soft, hard = line[26:].split()[:2]
            return (None if soft == "unlimited" else int(soft),
                    None if hard == "unlimited" else int(hard))
    raise ValueError("no 'Max open files' line")


def _parse_environ(raw: bytes, cut_head: bool, cut_tail: bool,
                   into: dict[str, str]) -> None:
    """Add the NUL-separated ``KEY=value`` entries of ``raw`` to ``into`` (first one
    wins, as getenv(3) finds it). ``cut_head``/``cut_tail``: ``raw`` starts/ends in the
    middle of the environment, so its first/last entry may be partial: dropped."""
    items = raw.split(b"\0")
    if cut_tail:
        items = items[:-1]
    if cut_head:
        items = items[1:]
    for item in items:
        k, sep, v = item.partition(b"=")
        if sep and k:
            into.setdefault(k.decode("utf-8", "replace"), v.decode("utf-8", "replace"))


# (bytes, cut_head, cut_tail) read from /proc/PID/environ: one piece for an environment
# within the bound, the head and the tail of a larger one
EnvPieces = list[tuple[bytes, bool, bool]]


def parse_environ_pieces(pieces: EnvPieces) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw, cut_head, cut_tail in pieces:
        _parse_environ(raw, cut_head, cut_tail, out)
    return out


class EnvironView(Mapping[str, str]):
    """An environment as read (one piece from its start), looked up in the bytes: a
    rule match and the intake ask for a dozen variables of environments of hundreds,
    so nothing is decoded until asked for; the whole is parsed once when iterated.
    Lookups give what :func:`parse_environ_pieces` would: the first ``KEY=`` entry,
    a partial last entry (``cut_tail``) left out."""

    __slots__ = ("_all", "_cut_tail", "_raw")

    def __init__(self, raw: bytes, cut_tail: bool) -> None:
        self._raw = raw
        self._cut_tail = cut_tail
        self._all: dict[str, str] | None = None

    def _whole(self) -> dict[str, str]:
        if self._all is None:
            self._all = {}
            _parse_environ(self._raw, False, self._cut_tail, self._all)
        return self._all

    def __getitem__(self, key: str) -> str:
        if self._all is not None or not key or not key.isascii():
            return self._whole()[key]
        raw = self._raw
        needle = key.encode() + b"="
        if raw.startswith(needle):
            start = len(needle)
        else:
            at = raw.find(b"\0" + needle)
            if at < 0:
                raise KeyError(key)
            start = at + 1 + len(needle)
        end = raw.find(b"\0", start)
        if end < 0:
            if self._cut_tail:  # the partial last entry
                raise KeyError(key)
            end = len(raw)
        return raw[start:end].decode("utf-8", "replace")

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        try:
            self[key]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._whole())

    def __len__(self) -> int:
        return len(self._whole())

    def __repr__(self) -> str:
        return f"EnvironView({len(self)} variables)"


def environ_view(pieces: EnvPieces) -> Mapping[str, str]:
    """The environment of ``pieces`` as a Mapping: an :class:`EnvironView` where it was
    read from its start in one piece (most), else parsed (a large one's head + tail)."""
    if len(pieces) == 1 and not pieces[0][1]:
        return EnvironView(pieces[0][0], pieces[0][2])
    return parse_environ_pieces(pieces)


def _environ_pieces(fd: int, limit: int, bounds: Callable[[], tuple[int, int]]
                    ) -> EnvPieces:
    """At most ``limit`` bytes of an environment (Process.environ): the first half
    first (most environments fit, and a larger one never costs more than ``limit``
    bytes of reading in all); ``bounds()`` gives (env_start, env_end) from stat."""
    half = limit // 2
    raw = os.read(fd, half + 1)
    if len(raw) <= half:
        return [(raw, False, False)]
    start, end = bounds()
    size = end - start
    if start == 0:  # size unknown: the start, up to the limit
        raw += os.read(fd, limit + 1 - len(raw))
        return [(raw[:limit], False, len(raw) > limit)]
    if size <= limit:
        return [(raw + os.pread(fd, max(size - len(raw), 0), len(raw)), False, False)]
    # one byte more in front: if it is the NUL ending an entry, the first entry of
    # the tail is whole
    tail = os.pread(fd, half + 1, size - half - 1)
    head = (raw[:half], False, True)
    return [head, (tail[1:], False, False)] if tail[:1] == b"\0" else [head, (tail, True, False)]


def _env_bounds(st: Stat) -> tuple[int, int]:
    return st.env_start, st.env_end


def _cmdline_text(raw: bytes, limit: int) -> tuple[str, bool]:
    cut = len(raw) > limit
    raw = raw[:limit] if cut else raw.rstrip(b"\0")
    return raw.replace(b"\0", b" ").decode("utf-8", "replace"), cut


# -- the error boundary ---------------------------------------------------------------
class _Exited(ProcessLookupError):
    """A zombie where a live process is needed (mapped like a vanished one)."""


_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


def _boundary(method: _F) -> _F:
    """Map what the kernel says about a process to tunerd's errors (module docstring)."""

    @functools.wraps(method)
    def wrapper(self: Process, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except TunerdError:
            raise
        except OSError as err:
            raise self._error(err) from err
        except (ValueError, IndexError, KeyError) as err:
            raise Failed(f"unexpected content in {self._base} ({method.__name__}): {err}",
                         pid=self.pid) from err

    return wrapper  # type: ignore[return-value]


class Process:
    """One process, read from ``PROC_ROOT/PID`` (a thread id works too, as in /proc).

    Getters raise :class:`~tunerd.base.errors.NoSuchProcess`,
    :class:`~tunerd.base.errors.PermissionDenied` or :class:`~tunerd.base.errors.Failed`
    (see the module docstring). Inside ``with p.oneshot():`` stat and status are
    read once and reused, as psutil does, for callers that want many fields.
    """

    __slots__ = ("_base", "_cache", "_real_proc", "pid", "root")

    def __init__(self, pid: int, proc_root: PathLike = PROC) -> None:
        self.pid = pid
        self.root = os.fspath(proc_root)
        # str joins: pathlib's cost more than the reads on the exec and sampler paths
        self._base = f"{self.root}/{pid}"
        self._real_proc = self.root == PROC
        self._cache: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"Process(pid={self.pid}, proc_root={self.root!r})"

    def _error(self, err: OSError) -> TunerdError:
        pid = self.pid
        if isinstance(err, _Exited):
            return NoSuchProcess(f"process {pid} has exited", pid=pid)
        if isinstance(err, (FileNotFoundError, ProcessLookupError, NotADirectoryError)) \
                or err.errno == errno.ESRCH:
            return NoSuchProcess(f"no process with pid {pid}", pid=pid)
        what = err.filename or self._base
        if isinstance(err, PermissionError):
            return PermissionDenied(f"cannot read {what} (pid {pid}): permission denied",
                                    pid=pid, path=str(what))
        return Failed(f"reading {what} (pid {pid}) failed: "
                      f"{errno.errorcode.get(err.errno or 0, err.errno)} {err.strerror}",
                      pid=pid, path=str(what))

    @contextlib.contextmanager
    def oneshot(self) -> Iterator[Process]:
        """Read stat and status at most once inside the block."""
        outer = self._cache is None
        if outer:
            self._cache = {}
        try:
            yield self
        finally:
            if outer:
                self._cache = None

    def _file(self, name: str) -> bytes:
        """A file the kernel renders as one record (stat, status, io, ...): one read."""
        return _read_once(f"{self._base}/{name}")

    # -- /proc/PID/stat ---------------------------------------------------------------
    @_boundary
    def stat(self, *, alive: bool = False) -> Stat:
        """/proc/PID/stat. ``alive=True``: a zombie raises NoSuchProcess ("has exited")."""
        c = self._cache
        st: Stat | None = c.get("stat") if c is not None else None
        if st is None:
            st = parse_stat(self._file("stat"))
            if c is not None:
                c["stat"] = st
        if alive and st.state in ("Z", "X"):
            raise _Exited(errno.ESRCH, "exited")
        return st

    def state(self) -> str:
        return self.stat().state

    def ppid(self) -> int:
        return self.stat().ppid

    def start_time(self, *, alive: bool = False) -> int:
        """Start time in clock ticks after boot (stat field 22): with the pid, an identity."""
        return self.stat(alive=alive).start_time

    def is_kernel_thread(self) -> bool:
        """PF_KTHREAD in the flags (stat field 9): kernel threads are not jobs to bind."""
        return bool(self.stat().flags & PF_KTHREAD)

    def num_threads(self) -> int:
        return self.stat().num_threads

    def cpu_times(self) -> tuple[float, float]:
        """(user, system) CPU seconds of the whole process (all threads)."""
        st = self.stat()
        return st.utime / CLK_TCK, st.stime / CLK_TCK

    def rss(self) -> int:
        """Resident memory in bytes (stat field 24 times the page size)."""
        return self.stat().rss_pages * PAGE_SIZE

    # -- /proc/PID/status ---------------------------------------------------------------
    @_boundary
    def status(self) -> dict[str, str]:
        """/proc/PID/status as raw strings. The kernel builds the whole file for every
        read (~2x the cost of stat): read it for the fields only it has."""
        c = self._cache
        s: dict[str, str] | None = c.get("status") if c is not None else None
        if s is None:
            s = parse_status(self._file("status").decode("utf-8", "replace"))
            if c is not None:
                c["status"] = s
        return s

    @_boundary
    def uids(self) -> tuple[int, int]:
        """(real, effective) uid. Not the owner of /proc/PID: that is the effective
        uid, and root for a process that is not dumpable (setuid, prctl)."""
        parts = self.status()["Uid"].split()
        return int(parts[0]), int(parts[1])

    @_boundary
    def tgid(self) -> int:
        """Thread group id: the process a thread id belongs to (== pid for a process)."""
        return int(self.status()["Tgid"])

    @_boundary
    def ctx_switches(self) -> tuple[int, int]:
        """(voluntary, involuntary) context switches of the main thread."""
        s = self.status()
        return int(s["voluntary_ctxt_switches"]), int(s["nonvoluntary_ctxt_switches"])

    @_boundary
    def cap_effective(self) -> int:
        """The effective capability set (bit N = capability N, linux/capability.h)."""
        return int(self.status()["CapEff"], 16)

    # -- names and arguments ------------------------------------------------------------
    @_boundary
    def comm(self) -> str:
        """The command name (at most 15 bytes, settable by the process itself)."""
        return self._file("comm").decode("utf-8", "replace").rstrip("\n")

    @_boundary
    def cmdline_prefix(self, limit: int = ARG_READ_MAX) -> tuple[str, bool]:
        """The command line as ``ps`` shows it (NULs between arguments turned into
        spaces), cut after ``limit`` bytes, and whether it was cut.

        One read of at most ``limit + 1`` bytes: the kernel copies /proc/PID/cmdline
        out of the process's memory page by page, so the cost grows with what is read.
        """
        fd = os.open(f"{self._base}/cmdline", os.O_RDONLY | os.O_CLOEXEC)
        try:
            raw = os.read(fd, limit + 1)  # cmdline reads loop over pages: one read is all
        finally:
            os.close(fd)
        return _cmdline_text(raw, limit)

    def cmdline_text(self, limit: int = ARG_READ_MAX) -> str:
        """:meth:`cmdline_prefix` without the flag."""
        return self.cmdline_prefix(limit)[0]

    @_boundary
    def cmdline(self, limit: int = ARG_READ_MAX) -> list[str]:
        """The arguments (the last one cut short if the command line is longer than
        ``limit`` bytes). Empty for a kernel thread or a zombie."""
        raw = read_bytes(f"{self._base}/cmdline", limit)
        if not raw:
            return []
        return [a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0")]

    @_boundary
    def environ(self, limit: int = ARG_READ_MAX) -> dict[str, str]:
        """The environment the process was exec'd with, reading at most ``limit`` bytes.

        A larger environment is read as its first and last ``limit / 2`` bytes (entries
        cut at either edge are dropped): launchers add their variables at the end
        (torchrun copies os.environ and appends LOCAL_RANK, RANK, ...), so the end is
        what must not be lost. The size comes from stat fields 50-51, which need
        ptrace access (root has it); without them only the start is read.
        """
        return parse_environ_pieces(self.environ_raw(limit))

    @_boundary
    def environ_raw(self, limit: int = ARG_READ_MAX) -> EnvPieces:
        """What :meth:`environ` parses: the bytes read, unparsed (see EnvPieces)."""
        fd = os.open(f"{self._base}/environ", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _environ_pieces(fd, limit, lambda: _env_bounds(self.stat()))
        finally:
            os.close(fd)

    # -- threads, files, limits, memory ---------------------------------------------------
    @_boundary
    def tids(self) -> list[int]:
        """Thread ids, from /proc/PID/task."""
        return [int(t) for t in os.listdir(f"{self._base}/task") if t.isdigit()]

    @_boundary
    def children(self) -> list[int]:
        """Child processes, from /proc/PID/task/TID/children (no scan of every process).

        The kernel lists a task's children there (CONFIG_PROC_CHILDREN, on in every
        distribution kernel); DataLoader workers are children of the rank's main thread
        (fork) or of a thread that started them. Empty where the file is missing.
        """
        out: list[int] = []
        base = f"{self._base}/task"
        for tid in os.listdir(base):
            try:
                raw = _read_once(f"{base}/{tid}/children")
            except (FileNotFoundError, ProcessLookupError):
                continue
            out += [int(x) for x in raw.split()]
        return out

    @_boundary
    def runnable_threads(self) -> int:
        """Threads in state R now (one task/TID/stat read per thread)."""
        n = 0
        base = f"{self._base}/task"
        for tid in os.listdir(base):
            try:
                raw = _read_once(f"{base}/{tid}/stat")
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread exited meanwhile
            if raw[raw.rindex(b")") + 2:raw.rindex(b")") + 3] == b"R":
                n += 1
        return n

    @_boundary
    def io_counters(self) -> IoCounters:
        """/proc/PID/io (needs ptrace access: another user's process is PermissionDenied)."""
        return parse_io(self._file("io").decode())

    @_boundary
    def num_fds(self) -> int:
        """Open file descriptors."""
        fd_dir = f"{self._base}/fd"
        if self._real_proc:
            # Linux >= 6.2 reports the count as the size of /proc/PID/fd (commit
            # f1f1f2569901): one stat() instead of a listing; 0 on older kernels
            n = os.stat(fd_dir).st_size
            if n > 0:
                return n
        return len(os.listdir(fd_dir))

    @_boundary
    def nofile(self) -> tuple[int | None, int | None]:
        """RLIMIT_NOFILE (soft, hard); None means unlimited.

        prlimit(2) on the real /proc (no parsing), /proc/PID/limits where that is
        refused (another user's process without CAP_SYS_RESOURCE) or on a recorded tree.
        """
        if self._real_proc:
            try:
                soft, hard = resource.prlimit(self.pid, resource.RLIMIT_NOFILE)
                inf = resource.RLIM_INFINITY
                return (None if soft == inf else soft, None if hard == inf else hard)
            except PermissionError:
                pass
        return parse_limits_nofile(self._file("limits").decode())

    @_boundary
    def numa_pages(self) -> dict[int, int]:
        """NUMA node -> pages (of any size) of this process, from /proc/PID/numa_maps.

        The kernel walks the page tables of the whole process to build numa_maps:
        costly for a large process. A kernel without CONFIG_NUMA has no numa_maps,
        which reads as NoSuchProcess like a process that is gone: call it only where
        /sys/devices/system/node lists nodes."""
        raw = read_bytes(f"{self._base}/numa_maps", None)
        return parse_numa_maps(raw.decode(), as_bytes=False)

    @_boundary
    def numa_bytes(self) -> dict[int, int]:
        """NUMA node -> resident bytes of this process (huge pages at their size); see
        :meth:`numa_pages` for the cost and a kernel without CONFIG_NUMA."""
        return parse_numa_maps(read_bytes(f"{self._base}/numa_maps", None).decode())

    @_boundary
    def cgroup(self) -> str:
        """/proc/PID/cgroup as text (``hierarchy:controllers:path`` lines)."""
        return self._file("cgroup").decode("utf-8", "replace")


# -- thin functions for hot paths: None when the process is gone ------------------------
def _or_none(fn: Callable[[], _T]) -> _T | None:
    try:
        return fn()
    except TunerdError:
        return None


def read_cmdline(pid: int, proc: str = PROC, limit: int = ARG_READ_MAX) -> str | None:
    """The command line as ``ps`` shows it (at most ``limit`` bytes), or None."""
    p = Process(pid, proc)
    return _or_none(lambda: p.cmdline_prefix(limit)[0])


# The exec watcher calls these two for every exec on the host: no Process object, no
# error mapping (any OSError is "gone or unreadable"), the fewest syscalls.
def read_cmdline_prefix(pid: int, proc: str = PROC,
                        limit: int = ARG_READ_MAX) -> tuple[str, bool] | None:
    """(command line cut after ``limit`` bytes, whether it was cut), or None."""
    try:
        fd = os.open(f"{proc}/{pid}/cmdline", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return _cmdline_text(raw, limit)


def read_environ_raw(pid: int, proc: str = PROC, limit: int = ARG_READ_MAX
                     ) -> EnvPieces | None:
    """The bytes :func:`read_environ` parses (at most ``limit``), or None if gone."""
    try:
        fd = os.open(f"{proc}/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _environ_pieces(fd, limit, lambda: _env_bounds(parse_stat(
            _read_once(f"{proc}/{pid}/stat"))))
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)


def read_environ_view(pid: int, proc: str = PROC, limit: int = ARG_READ_MAX
                      ) -> Mapping[str, str] | None:
    """:func:`read_environ` as looked up, not parsed whole (:func:`environ_view`)."""
    pieces = read_environ_raw(pid, proc, limit)
    return None if pieces is None else environ_view(pieces)


def read_environ(pid: int, proc: str = PROC, limit: int = ARG_READ_MAX
                 ) -> dict[str, str] | None:
    """The environment the process was exec'd with (see Process.environ), or None."""
    pieces = read_environ_raw(pid, proc, limit)
    return None if pieces is None else parse_environ_pieces(pieces)


def read_maps(pid: int, limit: int | None = SMALL_READ, proc: str = PROC) -> str:
    """/proc/PID/maps, at most ``limit`` bytes; ``OSError`` when it cannot be read."""
    return read_text(f"{proc}/{pid}/maps", limit)


def read_comm(pid: int, proc: str = PROC) -> str | None:
    p = Process(pid, proc)
    return _or_none(p.comm)


def read_start_time(pid: int, proc: str = PROC) -> int | None:
    """Start time in clock ticks since boot (stat field 22): with the PID, a unique id."""
    p = Process(pid, proc)
    return _or_none(p.start_time)


def read_ppid(pid: int, proc: str = PROC) -> int | None:
    p = Process(pid, proc)
    return _or_none(p.ppid)


def read_uid(pid: int, proc: str = PROC) -> int | None:
    """Real uid of the process (the Uid line of /proc/PID/status), or None. The exec
    watcher's path: that one line is looked up in the bytes, nothing else parsed."""
    try:
        raw = _read_once(f"{proc}/{pid}/status")
    except OSError:
        return None
    i = raw.find(b"\nUid:")
    if i < 0:
        return None
    field = raw[i + 5:raw.find(b"\n", i + 5)].split(None, 1)
    return int(field[0]) if field and field[0].isdigit() else None


def list_pids(proc: str = PROC) -> list[int]:
    try:
        return [int(n) for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        return []


def list_tids(pid: int, proc: str = PROC) -> list[int]:
    p = Process(pid, proc)
    return _or_none(p.tids) or []


def children_map(proc: str = PROC) -> dict[int, list[int]]:
    """ppid -> [pid, ...] for every process on the host (one stat read per process)."""
    out: dict[int, list[int]] = {}
    for pid in list_pids(proc):
        ppid = read_ppid(pid, proc)
        if ppid is not None:
            out.setdefault(ppid, []).append(pid)
    return out


def descendants(root: int, proc: str = PROC, include_root: bool = True,
                kids: dict[int, list[int]] | None = None) -> list[int]:
    """``root`` and every process below it, each listed after its parent (depth first).

    ``kids``: a ``children_map`` the caller already has (it reads the stat of every
    process on the host), for several trees from one sweep.
    """
    if kids is None:
        kids = children_map(proc)
    out = [root] if include_root else []
    todo = [root]
    while todo:
        p = todo.pop()
        for c in kids.get(p, ()):
            out.append(c)
            todo.append(c)
    return out


def lock_holders(dev: int, ino: int, proc: str = PROC) -> list[tuple[str, int]]:
    """Who holds a lock on the file (``dev``, ``ino``): (kind, pid) from the kernel's
    lock table, ``/proc/locks`` (``1: FLOCK ADVISORY WRITE 812 fd:01:1234 0 EOF``;
    waiters, the ``->`` lines, are left out). The pid is as this PID namespace sees it:
    0 or -1 when the kernel cannot name one (outside our namespace, or an OFD lock)."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    try:
        text = read_text(f"{proc}/locks", limit=4 << 20)
    except OSError:
        return []
    out: list[tuple[str, int]] = []
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 6 and f[1] != "->" and f[5] == want:
            with contextlib.suppress(ValueError):
                out.append((f[1], int(f[4])))
    return out


# the initial PID namespace's inode number, fixed by the kernel (include/linux/proc_ns.h)
PROC_PID_INIT_INO = 0xEFFFFFFC


def pid_namespace(proc: str = PROC) -> int | None:
    """The inode of our active PID namespace (``/proc/PID/ns/pid``), None if unreadable.
    NSpid cannot tell where it is: under a /proc mounted for the namespace (``unshare
    --mount-proc``, a container without hostPID) it shows one level."""
    try:
        return os.stat(f"{proc}/{os.getpid()}/ns/pid").st_ino
    except OSError:
        return None


def in_initial_pid_namespace(proc: str = PROC) -> bool:
    """Whether we run in the host's own PID namespace (True when it cannot be read)."""
    ns = pid_namespace(proc)
    return ns is None or ns == PROC_PID_INIT_INO


# -- open device nodes (GPU use proved from outside: tunerd.jobs.gate) ----------------
O_PATH = 0o10000000  # include/uapi/asm-generic/fcntl.h: a handle that reads nothing
O_ACCMODE = 0o3


class OpenDevice(NamedTuple):
    """One fd of a process on a character device of the major asked for."""

    fd: int
    rdev: int  # the device number (os.major / os.minor)
    flags: int  # the open's flags as /proc/PID/fdinfo/FD says (octal there)
    mode: int  # the device node's st_mode, uid and gid (its permissions)
    uid: int
    gid: int


class Creds(NamedTuple):
    """What the kernel checks an open against: fs uid, fs gid, supplementary groups."""

    fsuid: int
    fsgid: int
    groups: frozenset[int]


def open_char_devices(pid: int, majors: frozenset[int], proc: str = PROC,
                      max_entries: int = 1024) -> tuple[list[OpenDevice], int, bool]:
    """fds of ``pid`` on character devices of one of ``majors``: at most ``max_entries`` of its
    fd table's entries are looked at (listed lazily, in the kernel's ascending order).
    Returns (found, entries looked at, whether the table was cut there); an unreadable
    or vanished process gives ([], 0, False)."""
    found: list[OpenDevice] = []
    seen = 0
    try:
        dfd = os.open(f"{proc}/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return found, seen, False
    try:  # names relative to the open directory: no path walk per fd
        with os.scandir(dfd) as it:
            for entry in it:
                if seen >= max_entries:
                    return found, seen, True
                seen += 1
                hit = _char_device(dfd, entry.name, majors)
                if hit is not None:
                    flags = _fd_flags(f"{proc}/{pid}/fdinfo/{entry.name}")
                    if flags is not None:
                        found.append(OpenDevice(int(entry.name), hit.st_rdev,
                                                flags, hit.st_mode, hit.st_uid, hit.st_gid))
    except OSError:
        return found, seen, False
    finally:
        os.close(dfd)
    return found, seen, False


def _char_device(dfd: int, name: str, majors: frozenset[int]) -> os.stat_result | None:
    try:
        st = os.stat(name, dir_fd=dfd)
    except OSError:
        return None
    if _stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) in majors:
        return st
    return None


def _fd_flags(path: str) -> int | None:
    """The ``flags:`` line of an fdinfo file (octal), or None."""
    try:
        raw = _read_once(path, 4096)
    except OSError:
        return None
    i = raw.find(b"flags:")
    if i < 0:
        return None
    field = raw[i + 6:raw.find(b"\n", i + 6)].strip()
    try:
        return int(field, 8)
    except ValueError:
        return None


def read_creds(pid: int, proc: str = PROC) -> Creds | None:
    """The fs uid/gid and supplementary groups of ``pid`` (/proc/PID/status), or None."""
    try:
        st = Process(pid, proc).status()
        uid = int(st["Uid"].split()[3])
        gid = int(st["Gid"].split()[3])
        groups = frozenset(int(g) for g in st.get("Groups", "").split())
    except (TunerdError, KeyError, IndexError, ValueError):
        return None
    return Creds(uid, gid, groups)
