"""The state store: runtime and durable files, validation on load, damage, full disks.

Issue 9, found 7 (a damaged state.json lost the originals), found 6 (full disk)
and found 12 (an fsync of everything on every bind). The files are real files,
FIFOs, directories and symlinks; the full disk is a real small tmpfs; crashes
are real kill -9s of the real daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DaemonProc, run_as, wait_for, write_policy
from tests.security_helpers import chown_tree, error_lines, wait_exit
from tunerd.base.safefs import FileWriteError, write_atomic
from tunerd.daemon.state import (
    DurableStore,
    RuntimeStore,
    StateDamaged,
)

ORIGINALS = {"host": {"originals": {"sysctl:vm.swappiness": {"value": "60"}},
                      "applied_once": []}}
BINDING = {"pid": 4242, "start_time": 17, "cpus": "1", "origin": "bind",
           "originals": {"pid": 4242, "start_time": 17, "process_cpus": "0-1",
                         "threads": {"0-1": [4242, 4243]}, "nofile": None}}
LEASE = {"id": "L3", "uid": 0, "user": "root", "origin": "alloc", "pid": None,
         "start_time": None, "cmd": None, "tag": None, "created": 1.0, "exclusive": False,
         "scope": None, "gpus": [], "gpu_uuids": [], "cpus": "1", "mems": "0",
         "explanation": "", "applied": True, "notes": []}


class SplitState:
    """The two stores behind the one-store API (``load``/``section``/``save``/``path``).

    Sections go to the store of their lifetime: ``host`` to the durable one,
    everything else to the runtime one. ``save`` writes the durable file only
    when its content changed, so a bind costs one un-fsync'd runtime write.
    """

    def __init__(self, runtime: RuntimeStore, durable: DurableStore) -> None:
        self.runtime = runtime
        self.durable = durable

    @property
    def path(self) -> Path:
        return self.durable.path

    @property
    def load_error(self) -> str | None:
        errs = [e for e in (self.durable.load_error, self.runtime.load_error) if e]
        return "; ".join(errs) or None

    def load(self) -> None:
        self.durable.load()
        self.runtime.load()

    def _store(self, name: str) -> Any:
        return self.durable if name in DurableStore.sections else self.runtime

    def section(self, name: str, default: Any = None) -> Any:
        return self._store(name).section(name, default)

    def save(self) -> None:
        self.durable.save()
        self.runtime.save()


def stores(tmp: Path) -> tuple[SplitState, Path, Path]:
    (tmp / "run").mkdir(exist_ok=True)
    (tmp / "state").mkdir(exist_ok=True)
    durable = DurableStore(tmp / "state" / "state.json")
    split = SplitState(RuntimeStore(tmp / "run" / "state.json", legacy=durable), durable)
    return split, tmp / "run" / "state.json", tmp / "state" / "state.json"


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if ".tmp." in p.name)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail instead of hanging (a FIFO opened for reading blocks without O_NONBLOCK)."""
    def boom(*_: object) -> None:
        raise TimeoutError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# -- layout and round trip -------------------------------------------------------------
def test_sections_go_to_the_store_of_their_lifetime(tmp_path: Path) -> None:
    s, run, durable = stores(tmp_path)
    s.load()
    s.section("host").update(json.loads(json.dumps(ORIGINALS["host"])))
    s.section("bindings")["4242"] = BINDING
    s.section("leases", {"next_id": 1, "leases": {}, "moved": {}})
    s.save()
    on_disk = json.loads(durable.read_text())
    assert set(on_disk) == {"version", "host"}
    assert json.loads((durable.parent / "state.json.bak").read_text()) == on_disk
    assert set(json.loads(run.read_text())) == {"version", "bindings", "leases"}
    for p in (run, durable, durable.parent / "state.json.bak"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert leftovers(run.parent) == leftovers(durable.parent) == []
    t, _, _ = stores(tmp_path)
    t.load()
    assert t.section("host") == ORIGINALS["host"] and t.section("bindings") == {"4242": BINDING}
    assert t.load_error is None


def test_a_bind_rewrites_only_the_runtime_file(tmp_path: Path) -> None:
    s, run, durable = stores(tmp_path)
    s.load()
    s.section("host").update(json.loads(json.dumps(ORIGINALS["host"])))
    s.save()
    ino = durable.stat().st_ino
    for i in range(5):
        s.section("bindings")[str(i)] = {**BINDING, "pid": i}
        s.save()
    assert durable.stat().st_ino == ino  # not rewritten: nothing in it changed
    assert len(json.loads(run.read_text())["bindings"]) == 5


def test_incremental_saves_write_what_a_full_encoding_would(tmp_path: Path) -> None:
    """Issue 15: a save re-encodes only the records that changed (620 bindings cost
    11 ms a bind when the whole file was encoded). Whatever the services do to their
    sections -- store, delete, change a record in place after a save, replace a
    section's map -- the file is what json.dumps of the whole state gives."""
    s, run, _ = stores(tmp_path)
    s.load()
    bindings = s.section("bindings")
    leases = s.section("leases", {"next_id": 1, "leases": {}, "moved": {}})
    runtime = s.runtime

    def check() -> None:
        s.save()
        want = json.dumps(runtime.data, separators=(",", ":"), sort_keys=True).encode()
        assert run.read_bytes() == want

    for i in range(40):
        bindings[str(i)] = json.loads(json.dumps({**BINDING, "pid": i}))
    check()
    rec = bindings.get("3")  # a record handed out, then changed in place
    rec["cpus"] = "0"
    rec["originals"]["threads"]["0-1"].append(9)
    check()
    held = bindings["5"]
    check()  # a save in between: unchanged
    held["notes"] = ["bound later"]  # top-level value replaced on a held reference
    check()
    del bindings["7"]
    bindings.pop("8")
    leases["leases"]["L1"] = dict(LEASE, id="L1")
    leases["next_id"] = 2
    check()
    leases["leases"]["L1"]["applied"] = False
    leases["moved"].setdefault("k", {"scope": "0-1", "cpus": "1", "threads": {}})
    check()
    for r in bindings.values():  # top-level values changed through values()
        r["uid"] = 1000
    check()
    moved = leases["moved"]["k"]
    check()
    moved["threads"]["7"] = {"pid": 7, "start_time": 1, "orig": "0-1", "set": "0"}
    check()  # deep inside a small map (the exclusive moves): compared in full
    deep = bindings["9"]["originals"]
    check()
    deep["threads"]["0-1"].append(10)  # deep inside a held reference: the full check
    runtime._full_at = -1e9
    check()
    leases["moved"] = {"m": {"scope": "0", "cpus": "1", "threads": {}}}  # a plain dict
    check()
    t, _, _ = stores(tmp_path)
    t.load()
    assert t.section("bindings") == bindings and t.section("leases") == leases


def test_an_exact_map_saves_what_a_full_encoding_would(tmp_path: Path) -> None:
    """Issue 15: the bindings map is ``exact`` (the registry stores, replaces and
    deletes whole records): a save compares only the records touched since the last,
    and the file is still what json.dumps of the whole state gives, through stores,
    replacements, deletions, a record read and changed before the save, a reload."""
    run = tmp_path / "run" / "state.json"
    run.parent.mkdir()
    rt = RuntimeStore(run)
    rt.load()
    bindings = rt.section("bindings", {}, exact=True)

    def check() -> None:
        rt.save()
        want = json.dumps(rt.data, separators=(",", ":"), sort_keys=True).encode()
        assert run.read_bytes() == want

    for i in range(40):
        bindings[str(i)] = json.loads(json.dumps({**BINDING, "pid": i}))
    check()
    bindings["3"] = {**BINDING, "pid": 3, "cpus": "0"}  # replaced
    del bindings["7"]
    bindings.pop("8")
    bindings["100"] = {**BINDING, "pid": 100}
    check()
    bindings["4"]["cpus"] = "0-1"  # handed out and changed before the save: suspect
    check()
    for i in range(40, 60):
        bindings[str(i)] = {**BINDING, "pid": i}
        check()
    again = RuntimeStore(run)
    again.load()
    assert again.section("bindings") == bindings


def test_the_old_single_file_layout_is_migrated(tmp_path: Path) -> None:
    s, run, durable = stores(tmp_path)
    old = {"version": 1, **ORIGINALS, "bindings": {"4242": BINDING},
           "leases": {"next_id": 4, "leases": {"L3": LEASE}, "moved": {}}}
    durable.write_text(json.dumps(old))
    s.load()
    assert s.load_error is None
    assert s.section("bindings") == {"4242": BINDING} and s.section("leases")["next_id"] == 4
    assert json.loads(durable.read_text()) == {"version": 1, **ORIGINALS}
    assert set(json.loads(run.read_text())) == {"version", "bindings", "leases"}
    assert json.loads((durable.parent / "state.json.bak").read_text())["host"] == \
        ORIGINALS["host"]


# -- damaged durable file ----------------------------------------------------------------
def _empty(p: Path) -> None:
    p.write_text("")


def _truncated(p: Path) -> None:
    p.write_text(json.dumps(ORIGINALS)[:30])


def _garbage(p: Path) -> None:
    p.write_bytes(b"\x00\xff garbage \x80")


def _toplevel_list(p: Path) -> None:
    p.write_text("[1, 2, 3]")


def _originals_list(p: Path) -> None:
    p.write_text('{"host": {"originals": []}}')


def _host_string(p: Path) -> None:
    p.write_text('{"host": "x"}')


def _nan(p: Path) -> None:
    p.write_text('{"host": {"originals": {"a": {"value": NaN}}}}')


def _directory(p: Path) -> None:
    p.mkdir()


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _symlink(p: Path) -> None:
    target = p.with_name("elsewhere.json")
    target.write_text(json.dumps(ORIGINALS))
    p.symlink_to(target)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "empty": _empty, "truncated": _truncated, "garbage": _garbage,
    "top-level list": _toplevel_list, "originals list": _originals_list,
    "host string": _host_string, "NaN": _nan, "directory": _directory, "FIFO": _fifo,
    "symlink": _symlink,
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_durable_file_is_recovered_from_its_backup(tmp_path: Path, damage: str) -> None:
    s, _, durable = stores(tmp_path)
    s.load()
    s.section("host").update(json.loads(json.dumps(ORIGINALS["host"])))
    s.save()
    durable.unlink()
    DAMAGE[damage](durable)
    t, _, _ = stores(tmp_path)
    with deadline(10):
        t.load()
    assert t.section("host") == ORIGINALS["host"]
    assert t.load_error and f"recovered the host originals from {durable}.bak" in t.load_error
    assert json.loads(durable.read_text()) == {"version": 1, **ORIGINALS}  # whole again
    assert [p for p in durable.parent.iterdir() if ".corrupt-" in p.name]  # kept aside


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_durable_file_without_backup_refuses_to_start(tmp_path: Path,
                                                              damage: str) -> None:
    s, _, durable = stores(tmp_path)
    DAMAGE[damage](durable)
    with deadline(10), pytest.raises(StateDamaged) as exc:
        s.load()
    msg = exc.value.message
    assert str(durable) in msg and "\n" not in msg
    assert f"mv {durable} {durable}.damaged" in msg
    assert os.path.lexists(durable)  # nothing removed or overwritten


def test_missing_file_with_a_damaged_backup_starts_empty_and_says_so(tmp_path: Path) -> None:
    """After the operator moved a damaged file aside as the refusal told them to."""
    s, _, durable = stores(tmp_path)
    durable.with_name("state.json.bak").write_text("{")
    s.load()
    assert s.load_error and "starting with no saved originals" in s.load_error
    s.save()
    assert not durable.exists()  # nothing changed: nothing written
    assert s.section("host") == {}


def test_unreadable_durable_file_refuses_to_start(tmp_path: Path,
                                                  unpriv_user: tuple[int, int]) -> None:
    """A daemon run by a user whose state file it cannot read (root reads anything)."""
    uid, gid = unpriv_user
    base = Path(tempfile.mkdtemp(prefix="tunerd-state-"))
    try:
        base.chmod(0o755)
        (base / "state").mkdir()
        (base / "state" / "state.json").write_text(json.dumps(ORIGINALS))
        (base / "state" / "state.json").chmod(0)
        chown_tree(base, uid, gid)

        def load(b: str) -> str:
            s, _, _ = stores(Path(b))
            try:
                s.load()
            except StateDamaged as err:
                return err.message
            return "loaded"

        msg = run_as(uid, gid, load, str(base))
        assert "Permission denied" in msg and "mv " in msg
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- damaged runtime file ----------------------------------------------------------------
RUNTIME_DAMAGE: dict[str, Callable[[Path], None]] = {
    **{k: v for k, v in DAMAGE.items() if k not in ("originals list", "host string", "NaN")},
    "leases string": lambda p: p.write_text('{"leases": "x"}'),
    "bindings list": lambda p: p.write_text('{"bindings": [1, 2]}'),
}


@pytest.mark.parametrize("damage", sorted(RUNTIME_DAMAGE))
def test_damaged_runtime_file_is_kept_aside_and_reported(tmp_path: Path, damage: str) -> None:
    s, run, _ = stores(tmp_path)
    RUNTIME_DAMAGE[damage](run)
    with deadline(10):
        s.load()
    assert s.load_error and str(run) in s.load_error
    assert s.section("bindings") == {} and isinstance(s.section("leases"), dict)
    assert [p for p in run.parent.iterdir() if ".corrupt-" in p.name]
    s.section("bindings")["1"] = {**BINDING, "pid": 1}
    s.save()  # and it goes on
    assert json.loads(run.read_text())["bindings"]["1"]["pid"] == 1


def test_bad_records_are_dropped_one_by_one(tmp_path: Path) -> None:
    s, run, _ = stores(tmp_path)
    run.write_text(json.dumps({
        "version": 1,
        "bindings": {"4242": BINDING, "7": {"pid": "seven"}, "8": [8]},
        "leases": {"next_id": "x", "leases": {"L3": LEASE, "L9": {"id": "L9"}},
                   "moved": {"lease:L3": {"scope": "pid:1", "cpus": "1", "threads": {
                       "5": {"pid": 5, "start_time": 1, "orig": "0-1", "set": "0"}}},
                             "lease:L4": {"scope": "pid:1", "cpus": "1", "threads": []}}},
    }))
    s.load()
    assert s.section("bindings") == {"4242": BINDING}
    leases = s.section("leases")
    assert list(leases["leases"]) == ["L3"] and list(leases["moved"]) == ["lease:L3"]
    assert leases["next_id"] == 4
    err = s.load_error or ""
    for what in ("bindings['7'].pid", "bindings['8']: expected an object",
                 "leases.leases['L9']", "leases.moved['lease:L4']", "leases.next_id"):
        assert what in err, err


# -- writes that fail ----------------------------------------------------------------------
@pytest.fixture
def tiny_fs() -> Iterator[Path]:
    """A real 64 KiB tmpfs (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="tunerd-tinyfs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(mnt)],
                   check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        mnt.rmdir()


def fill(d: Path) -> None:
    """Fill the file system up to the last byte."""
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (65536, 4096, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"x" * size)
    finally:
        os.close(fd)


@pytest.mark.root
def test_full_disk_write_names_file_and_errno_and_leaves_no_temp_file(tiny_fs: Path) -> None:
    s, run, durable = stores(tiny_fs)
    s.load()
    s.section("host").update(json.loads(json.dumps(ORIGINALS["host"])))
    s.section("bindings")["4242"] = BINDING
    s.save()
    before = (run.read_bytes(), durable.read_bytes())
    fill(tiny_fs)
    s.section("host")["originals"]["sysctl:x"] = {"value": "y" * 20000}
    with pytest.raises(FileWriteError) as exc:
        s.save()
    assert exc.value.errno == 28 and str(durable) in exc.value.message
    assert "No space left on device (errno 28)" in exc.value.message
    assert isinstance(exc.value, OSError)  # callers guarding with `except OSError` still work
    s.section("host")["originals"].pop("sysctl:x")
    s.section("bindings")["1"] = {**BINDING, "pid": 1, "pad": "z" * 20000}
    with pytest.raises(FileWriteError, match=str(run)):
        s.save()
    assert (run.read_bytes(), durable.read_bytes()) == before
    assert leftovers(run.parent) == leftovers(durable.parent) == []


WRITER = r"""
import sys
from pathlib import Path
from tunerd.base.safefs import write_atomic
path = Path(sys.argv[1])
i = 0
while True:
    i += 1
    # ~2 MiB per version so that a kill lands inside a write most of the time
    write_atomic(path, ('{"version": %d, "pad": "%s"}' % (i, "x" * (2 << 20))).encode())
"""


def test_kill9_during_writes_never_leaves_a_torn_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomic(path, b'{"version": 0}')
    seen: set[int] = set()
    for n in range(8):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(path)],
                             cwd=Path(__file__).resolve().parent.parent)
        time.sleep(0.15 + 0.05 * n)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        data = json.loads(path.read_bytes())  # must always parse: old or new, never half
        seen.add(data["version"])
    assert max(seen) > 0  # the writer really replaced the file


def test_write_atomic_replaces_a_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("keep me")
    (tmp_path / "state.json").symlink_to(target)
    write_atomic(tmp_path / "state.json", b"{}")
    assert target.read_text() == "keep me"
    assert not (tmp_path / "state.json").is_symlink()


# -- the real daemon -------------------------------------------------------------------------
def _tree_daemon(daemon_factory: Any, tmp_path: Path) -> tuple[DaemonProc, Path]:
    tree = tmp_path / "tree"
    (tree / "proc/sys/vm").mkdir(parents=True)
    (tree / "proc/sys/vm/swappiness").write_text("60\n")
    (tree / "sys").mkdir()
    (tree / "etc").mkdir()
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text(f'proc_root = "{tree}/proc"\nsys_root = "{tree}/sys"\n'
                   f'etc_root = "{tree}/etc"\nwatch_execs = false\n')
    pol = tmp_path / "policies"
    write_policy(pol, "00.toml", '[policy]\nname = "t"\n[sysctl]\n"vm.swappiness" = 10\n')
    d = daemon_factory(policy_dir=pol, args=["--config", str(cfg)])
    return d, tree / "proc/sys/vm/swappiness"


@pytest.mark.root
def test_daemon_recovers_originals_from_the_backup_after_kill9_and_damage(
        daemon_factory, tmp_path: Path) -> None:
    d, swappiness = _tree_daemon(daemon_factory, tmp_path)
    d.start()
    assert swappiness.read_text().strip() == "10"
    d.kill9()
    (d.state_dir / "state.json").write_text("")  # what an old daemon's crash left behind
    d.start()
    st = d.ctl("--json", "status").json()
    assert any("recovered the host originals" in e["message"] for e in st["errors"])
    r = d.ctl("revert")
    assert r.rc == 0 and "nothing to restore" not in r.out, r
    assert swappiness.read_text().strip() == "60"
    assert "Traceback" not in d.log()


@pytest.mark.root
@pytest.mark.parametrize("damage", ["truncated", "originals list", "FIFO"])
def test_daemon_refuses_to_start_on_damaged_originals_without_backup(
        daemon_factory, tmp_path: Path, damage: str) -> None:
    d, swappiness = _tree_daemon(daemon_factory, tmp_path)
    d.start()
    # the originals are saved before the write: once it shows, both files are there
    wait_for(lambda: swappiness.read_text().strip() == "10", 10, "the policy applied")
    d.kill9()
    for name in ("state.json", "state.json.bak"):
        (d.state_dir / name).unlink()
    DAMAGE[damage](d.state_dir / "state.json")
    t0 = time.monotonic()
    d.start(wait=False)
    assert wait_exit(d) == 1 and time.monotonic() - t0 < 15
    errors = error_lines(d.log().split("tunerd ready")[-1])
    assert len(errors) == 1, d.log()
    assert str(d.state_dir / "state.json") in errors[0] and "mv " in errors[0]
    assert swappiness.read_text().strip() == "10"  # still tuned: and nobody pretends not
    assert "Traceback" not in d.log()


@pytest.mark.root
def test_runtime_fifo_does_not_hang_start_up(daemon_factory) -> None:
    d: DaemonProc = daemon_factory()
    d.runtime_dir.mkdir()
    os.mkfifo(d.runtime_dir / "state.json")
    d.start(timeout=15)
    st = d.ctl("--json", "status").json()
    assert any("a FIFO, not a regular file" in e["message"] for e in st["errors"]), st
    assert d.ctl("--json", "jobs").rc == 0


# -- full disk, end to end ---------------------------------------------------------------
@pytest.fixture
def tiny_state(daemon_factory, tiny_fs: Path) -> Iterator[DaemonProc]:
    """A daemon whose runtime and state dirs live on the same full 64 KiB tmpfs."""
    d: DaemonProc = daemon_factory(args=["--runtime-dir", str(tiny_fs / "run"),
                                         "--state-dir", str(tiny_fs / "state")])
    (tiny_fs / "run").mkdir()
    d.tmp.joinpath("run").symlink_to(tiny_fs / "run")  # DaemonProc.socket looks there
    d.start()
    yield d
    d.stop()


@pytest.mark.root
def test_full_disk_gives_truthful_errors_and_no_tracebacks(tiny_state: DaemonProc,
                                                           tiny_fs: Path) -> None:
    """Found 6: the parts this area owns (errors naming file and errno, no temp files,
    no tracebacks). What the callers reply after a failed save is tested below."""
    d = tiny_state
    from tests.helpers import ready_child

    with ready_child("import time\nprint('ready', flush=True)\ntime.sleep(60)\n") as p:
        fill(tiny_fs)
        r = d.ctl("--json", "bind", str(p.pid), "--cpus", "0")
        assert r.rc == 1, r
        assert "No space left on device (errno 28)" in r.err and "internal error" not in r.err
        r = d.ctl("--json", "alloc", "--ncpus", "1")
        assert "internal error" not in r.err and "OSError" not in r.err, r
    os.unlink(tiny_fs / "filler")
    assert leftovers(tiny_fs / "run") == leftovers(tiny_fs / "state") == []
    assert "Traceback" not in d.log()


def _leases(d: DaemonProc) -> list[dict[str, Any]]:
    return d.ctl("--json", "leases").json()  # type: ignore[no-any-return]


@pytest.mark.root
def test_full_disk_alloc_is_all_or_nothing(tiny_state: DaemonProc, tiny_fs: Path) -> None:
    d = tiny_state
    fill(tiny_fs)
    r = d.ctl("--json", "alloc", "--ncpus", "1")
    os.unlink(tiny_fs / "filler")
    if r.rc == 0:
        assert [x["id"] for x in _leases(d)] == [r.json()["id"]]
    else:
        assert _leases(d) == [], "the failed alloc left a lease behind"


@pytest.mark.root
def test_full_disk_release_and_unbind_replies_are_truthful(tiny_state: DaemonProc,
                                                          tiny_fs: Path) -> None:
    d = tiny_state
    from tests.helpers import ready_child

    lease = d.ctl("--json", "alloc", "--ncpus", "1").json()["id"]
    with ready_child("import time\nprint('ready', flush=True)\ntime.sleep(60)\n") as p:
        assert d.ctl("bind", str(p.pid), "--cpus", "0").rc == 0
        fill(tiny_fs)
        r_unbind = d.ctl("--json", "unbind", str(p.pid))
        r_release = d.ctl("--json", "release", lease)
        os.unlink(tiny_fs / "filler")
        unbound = [j["pid"] for j in d.ctl("--json", "jobs").json()["jobs"]] == []
        released = _leases(d) == []
    assert (r_unbind.rc == 0) == unbound and (r_release.rc == 0) == released
    assert r_unbind.rc == 0 and r_release.rc == 0


def test_saves_after_binds_unbinds_and_rebinds_write_the_whole_state(tmp_path: Path) -> None:
    """The file a save writes from its cached pieces (sorted keys kept between saves,
    only stored or deleted records looked at) is exactly the compact sorted JSON of
    everything held, through binds, rebinds, unbinds and re-binds of the same pid."""
    import random

    path = tmp_path / "state.json"
    st = RuntimeStore(path)
    st.load()
    b = st.section("bindings", exact=True)
    rng = random.Random(15)

    def rec(pid: int, n: int) -> dict[str, Any]:
        return {"pid": pid, "start_time": 100 + pid, "cpus": str(n % 2), "notes": [f"n{n}"],
                "originals": {"pid": pid, "start_time": 100 + pid, "process_cpus": "0-1",
                              "threads": {"0-1": [pid]}}}

    for n in range(600):  # more records than a small map's, which is compared in full
        pid = rng.randrange(1, 200)
        op = rng.random()
        if op < 0.6:
            b[str(pid)] = rec(pid, n)
        elif op < 0.9:
            b.pop(str(pid), None)
        else:
            st.section("other")[f"k{n % 3}"] = {"tag": n}  # a section not of records
        if n % 3 == 0 or op >= 0.9:
            st.save()
            assert path.read_bytes() == json.dumps(
                st.data, separators=(",", ":"), sort_keys=True).encode(), f"save {n}"
    st.save()
    again = RuntimeStore(path)
    again.load()
    assert again.load_error is None
    assert again.data["bindings"] == json.loads(json.dumps(st.data["bindings"]))
    assert again.data["other"] == st.data["other"]
