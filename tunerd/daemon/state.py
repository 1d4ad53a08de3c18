"""The daemon's state, split by lifetime into two JSON files of sections.

* ``RuntimeStore`` -- RUNTIME_DIR/state.json (tmpfs under /run): per-process state
  (``bindings``, ``leases`` with the exclusive ``moved`` threads). It must
  survive a daemon crash, which the page cache gives without fsync; a reboot
  ends those processes anyway. So its writes are atomic (temp file + rename)
  but not fsync'd: nothing on the bind path waits for a disk. A damaged file is
  kept aside, the error is reported in ``tunerctl status``, and the daemon goes
  on without it.
* ``DurableStore`` -- STATE_DIR/state.json: the original value of every host
  setting the daemon changed (``host``), written before the change with fsync,
  rename and a dir fsync, and then copied to ``state.json.bak``. A damaged
  file is recovered from that copy; if both are unusable the daemon refuses to
  start with one line naming the file and how to recover, because starting
  without them would drop the originals silently (``revert`` would say "nothing
  to restore" while the host stays tuned).

Each section is validated on load (shape and the fields the daemon indexes),
so a hand-edited or damaged file is an error message, never a traceback. Files
are opened with ``tunerd.base.safefs`` rules: no symlinks, no FIFOs, regular files only.

An older daemon kept everything in STATE_DIR/state.json; ``RuntimeStore.load``
takes ``bindings`` and ``leases`` over from it (``legacy=``) and the durable
file is rewritten without them.
"""

from __future__ import annotations

import bisect
import copy
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tunerd.base.cpulist import CpuListError, parse_cpulist
from tunerd.base.errors import Failed
from tunerd.base.safefs import FileWriteError, read_regular, write_atomic

__all__ = ["DurableStore", "RuntimeStore", "StateDamaged"]

log = logging.getLogger("tunerd.state")

SCHEMA_VERSION = 1
MAX_STATE_BYTES = 256 << 20  # a state file larger than this is damaged, not read


class StateDamaged(Failed):
    """The durable state file and its backup are both unusable: the daemon must not start."""


# -- validation -----------------------------------------------------------------
# A checker returns the cleaned value and the problems it found; a record that
# cannot be used is left out (and named in a problem), never half-kept.
Problems = list[str]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_cpulist(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    try:
        parse_cpulist(v)
    except CpuListError:
        return False
    return True


def _fields(where: str, rec: Any, spec: Mapping[str, Callable[[Any], bool]]) -> str | None:
    """None if ``rec`` is an object whose fields in ``spec`` pass; else what is wrong."""
    if not isinstance(rec, dict):
        return f"{where}: expected an object, got {type(rec).__name__}"
    for key, ok in spec.items():
        if key not in rec:
            return f"{where}: missing {key!r}"
        if not ok(rec[key]):
            return f"{where}.{key}: bad value {rec[key]!r:.60}"
    return None


def _opt(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _thread_masks(v: Any) -> bool:  # {"0-3": [tid, ...], ...}
    return isinstance(v, dict) and all(_is_cpulist(k) and _int_list(t) for k, t in v.items())


_BINDING_ORIGINALS = {"pid": _is_int, "start_time": _is_int, "process_cpus": _is_cpulist,
                      "threads": _thread_masks}
_BINDING = {"pid": _is_int, "start_time": _is_int,
            "originals": lambda v: _fields("", v, _BINDING_ORIGINALS) is None}
_LEASE = {"id": lambda v: isinstance(v, str) and v[:1] == "L" and v[1:].isdigit(),
          "uid": _is_int, "user": lambda v: isinstance(v, str), "gpus": _int_list,
          "cpus": _is_cpulist, "mems": lambda v: v == "" or _is_cpulist(v),
          "exclusive": lambda v: isinstance(v, bool), "scope": _opt(lambda v: isinstance(v, str)),
          "applied": lambda v: isinstance(v, bool), "notes": _str_list,
          "pid": _opt(_is_int), "start_time": _opt(_is_int)}
_MOVED_THREAD = {"pid": _is_int, "start_time": _is_int, "orig": _is_cpulist, "set": _is_cpulist}


def _records(where: str, value: Any, check: Callable[[str, Any], str | None]
             ) -> tuple[dict[str, Any], Problems]:
    if not isinstance(value, dict):
        return {}, [f"{where}: expected an object, got {type(value).__name__}; all dropped"]
    out: dict[str, Any] = {}
    problems: Problems = []
    for key, rec in value.items():
        bad = check(f"{where}[{key!r}]", rec)
        if bad is None:
            out[key] = rec
        else:
            problems.append(bad + "; dropped")
    return out, problems


def _check_bindings(value: Any) -> tuple[Any, Problems]:
    return _records("bindings", value, lambda w, r: _fields(w, r, _BINDING))


def _check_moved_entry(where: str, rec: Any) -> str | None:
    bad = _fields(where, rec, {"scope": lambda v: isinstance(v, str), "cpus": _is_cpulist,
                               "threads": lambda v: isinstance(v, dict)})
    if bad is not None:
        return bad
    for tid, t in rec["threads"].items():
        bad = _fields(f"{where}.threads[{tid!r}]", t, _MOVED_THREAD)
        if bad is not None or not str(tid).isdigit():
            return bad or f"{where}.threads: bad thread id {tid!r}"
    return None


def _check_leases(value: Any) -> tuple[Any, Problems]:
    if not isinstance(value, dict):
        return {}, [f"leases: expected an object, got {type(value).__name__}; all dropped"]
    problems: Problems = []
    leases, p = _records("leases.leases", value.get("leases", {}),
                         lambda w, r: _fields(w, r, _LEASE))
    problems += p
    moved, p = _records("leases.moved", value.get("moved", {}), _check_moved_entry)
    problems += p
    next_id = value.get("next_id", 1)
    top = max((int(k[1:]) for k in leases if k[1:].isdigit()), default=0)
    if not _is_int(next_id) or next_id <= top:
        if "next_id" in value and not (_is_int(next_id) and next_id > 0):
            problems.append(f"leases.next_id: bad value {next_id!r:.40}; set to {top + 1}")
        next_id = max(top + 1, next_id if _is_int(next_id) else 1)
    return {**value, "next_id": next_id, "leases": leases, "moved": moved}, problems


def _check_host(value: Any) -> tuple[Any, Problems]:
    """Durable: anything wrong makes the whole file unusable (originals are never dropped)."""
    if not isinstance(value, dict):
        return None, [f"host: expected an object, got {type(value).__name__}"]
    originals = value.get("originals", {})
    if not isinstance(originals, dict):
        return None, [f"host.originals: expected an object, got {type(originals).__name__}"]
    for key, rec in originals.items():
        if not isinstance(rec, dict):
            return None, [f"host.originals[{key!r}]: expected an object, "
                          f"got {type(rec).__name__}"]
    if not _str_list(value.get("applied_once", [])):
        return None, ["host.applied_once: expected a list of strings"]
    return value, []


# -- the stores -------------------------------------------------------------------
class _JsonStore:
    """One JSON state file of top-level sections, each owned by one component.

    ``sections`` maps the names this file holds to their checkers; other
    top-level keys are kept as they are (``foreign``: a newer daemon's, or an old
    single-file layout's). Subclasses decide what a damaged file means.
    """

    sections: dict[str, Callable[[Any], tuple[Any, Problems]]] = {}
    sync = True  # fsync file and dir on save

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {"version": SCHEMA_VERSION}
        self.load_error: str | None = None

    # -- reading -----------------------------------------------------------------
    def _read(self, path: Path) -> tuple[dict[str, Any] | None, str | None]:
        """(data, None), (None, None) for a missing file, or (None, what is wrong)."""
        try:
            raw = read_regular(path, MAX_STATE_BYTES)
        except FileNotFoundError:
            return None, None
        except Failed as err:
            return None, err.message
        if not raw.strip():
            return None, f"{path} is empty"
        try:
            data = json.loads(raw, parse_constant=_no_constant)
        except RecursionError:
            return None, f"{path}: nested too deeply"
        except ValueError as err:
            return None, f"{path}: not valid JSON ({err})"
        if not isinstance(data, dict):
            return None, f"{path}: top level is a {type(data).__name__}, not an object"
        if not _is_int(data.get("version", SCHEMA_VERSION)):
            return None, f"{path}: bad version {data.get('version')!r:.40}"
        return data, None

    def _validate(self, data: dict[str, Any]) -> tuple[dict[str, Any], Problems]:
        out = dict(data)
        problems: Problems = []
        for name, check in self.sections.items():
            if name in data:
                out[name], p = check(data[name])
                problems += [f"{self.path}: {x}" for x in p]
        return out, problems

    def _set_aside(self, path: Path) -> Path | None:
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
                               f"-{os.getpid()}")
        try:
            os.rename(path, aside)
        except OSError as err:
            log.error("cannot move %s aside: %s", path, err.strerror)
            return None
        return aside

    def load(self) -> None:
        raise NotImplementedError

    # -- the API the services use ------------------------------------------------
    def section(self, name: str, default: Any = None) -> Any:
        """The component-owned section ``name``, created from ``default`` if absent."""
        if name not in self.data:
            self.data[name] = {} if default is None else default
        return self.data[name]

    def payload(self) -> bytes:
        # compact and sorted: json.dumps with indent= uses the pure-Python encoder,
        # ~5x slower (jq . state.json reads it fine)
        return json.dumps(self.data, separators=(",", ":"), sort_keys=True,
                          allow_nan=False).encode()

    def save(self) -> None:
        """Write atomically; raises FileWriteError (a Failed and an OSError) naming the
        file and errno, with no temp file left behind (fsync'ed where ``sync``)."""
        write_atomic(self.path, self.payload(), sync=self.sync)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# Where the runtime file holds one record per key: its encoding is cached per record
# (``_Fragments``), so a save re-encodes only the records that changed.
_RECORD_MAPS: dict[str, Any] = {"bindings": None, "leases": {"leases": None, "moved": None}}
FULL_CHECK_S = 5.0  # every record is compared in full at a save at least this often
SMALL_MAP = 16  # maps of records this small are compared in full at every save


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


class _Records(dict[Any, Any]):
    """A dict of records that notes which records its users may have changed.

    A record stored, deleted or handed out (``[]``, ``get``, ``setdefault``, ``pop``)
    since a save is *suspect*: the next save compares it in full with what it wrote.
    The others get a shallow check (the same object, the same top-level values):
    iterating (``values``, ``items``: the job list, read every monitor cycle and by
    the cpuset watch) marks nothing. A map of at most SMALL_MAP records (the
    exclusive moves, whose entries are changed deep inside) is always compared in
    full, and every map is at a save at least every FULL_CHECK_S. An ``exact`` map
    (``section(..., exact=True)``: its owner only stores, replaces and deletes whole
    records) gets no shallow check: only its suspect records are compared.
    """

    __slots__ = ("exact", "suspect")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.suspect: set[Any] | None = None  # None: every record
        self.exact = False

    def _mark(self, key: Any) -> None:
        if self.suspect is not None:
            self.suspect.add(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._mark(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._mark(key)
        super().__delitem__(key)

    def __getitem__(self, key: Any) -> Any:
        self._mark(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._mark(key)
        return super().get(key, default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._mark(key)
        return super().setdefault(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self._mark(key)
        return super().pop(key, *default)

    def popitem(self) -> tuple[Any, Any]:
        self.suspect = None
        return super().popitem()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.suspect = None
        super().update(*args, **kwargs)

    def clear(self) -> None:
        self.suspect = None
        super().clear()


    def __ior__(self, other: Any) -> _Records:  # type: ignore[misc]
        self.update(other)
        return self


class _Fragments:
    """The JSON text of one dict of records, kept per record between saves.

    ``encode(records)`` gives exactly ``_dumps(records)``, re-encoding only the records
    that differ from a private copy of what was encoded last time. With 620 bindings a
    save used to spend ~10 ms in json.dumps of the whole file (issue 15). For a
    ``_Records`` map only its suspect records are compared in full.
    """

    def __init__(self) -> None:
        self._copy: dict[str, Any] = {}  # key -> a deep copy of the record last encoded
        self._frag: dict[str, bytes] = {}  # key -> b',"key":{...}' (a comma first)
        self._shallow: dict[str, Any] = {}  # key -> (the record object, its top values)
        # the sorted keys at the last call, and their set: an exact map's suspect keys
        # are the only ones that can have come or gone, so a save sorts no 620 keys
        self._keys: list[str] = []
        self._keyset: set[str] = set()

    def encode(self, records: dict[str, Any], full: bool) -> bytes:
        return b"".join(self.parts(records, full))

    def parts(self, records: dict[str, Any], full: bool) -> list[bytes]:
        """``encode``'s text in pieces (one join at the end: no big copies between)."""
        if len(self._copy) > 2 * len(records) + 64:  # forget records deleted long ago
            for d in (self._copy, self._frag, self._shallow):
                for k in [k for k in d if k not in records]:
                    del d[k]
        tracked = records if isinstance(records, _Records) else None
        suspect = (tracked.suspect if tracked is not None and not full
                   and len(records) > SMALL_MAP else None)
        get = dict.__getitem__
        exact = suspect is not None and tracked is not None and tracked.exact
        keys = self._keys
        if exact and self._known(records, suspect):  # type: ignore[arg-type]
            # only stored or deleted records can be new or changed
            keyset = self._keyset
            check = [k for k in suspect if k in keyset]  # type: ignore[union-attr]
        else:
            keys = self._keys = sorted(dict.keys(records))
            self._keyset = set(keys)
            if suspect is None:
                check = keys
            else:
                # the same object with the same top-level values: not changed (a record
                # changed deep inside is found by the full check every FULL_CHECK_S)
                shallow = self._shallow
                frags = self._frag
                check = ([k for k in keys if k in suspect or k not in frags]
                         if exact
                         else [k for k in keys
                               if k in suspect or shallow.get(k) != _top(get(records, k))])
        copies, frags = self._copy, self._frag
        for key in check:
            rec = get(records, key)
            old = copies.get(key, _MISSING)
            if old is _MISSING or type(old) is not type(rec) or old != rec:
                frags[key] = b"," + _dumps(key) + b":" + _dumps(rec)
                copies[key] = copy.deepcopy(rec)
            self._shallow[key] = _top(rec)
        if tracked is not None:
            tracked.suspect = set()
        if not keys:
            return [b"{}"]
        # the pieces as they are (the caller joins the file once); no comma before the first
        return [b"{", frags[keys[0]][1:], *map(frags.__getitem__, keys[1:]), b"}"]

    def _known(self, records: dict[str, Any], suspect: set[str]) -> bool:
        """Bring the sorted keys of the last call up to date from the suspect keys (the
        only ones an exact map can have gained or lost); False where they cannot be."""
        keys, keyset = self._keys, self._keyset
        if not keyset and records:
            return False  # the first call
        for k in suspect:
            there = dict.__contains__(records, k)
            if there and k not in keyset:
                if not isinstance(k, str):
                    return False
                bisect.insort(keys, k)
                keyset.add(k)
            elif not there and k in keyset:
                del keys[bisect.bisect_left(keys, k)]
                keyset.discard(k)
        return len(keys) == len(records)


_MISSING = object()


def _top(rec: Any) -> Any:
    """What the shallow check compares: the object and its top-level values, by identity
    first (tuple == tries ``is`` before ``==`` for each element)."""
    return (rec, tuple(dict.values(rec))) if type(rec) is dict else (rec,)


class RuntimeStore(_JsonStore):
    """RUNTIME_DIR/state.json: bindings, leases and exclusive moves (no fsync).

    The file is rewritten whole on every save (temp file + rename: a reader or a
    crash sees the old or the new file, never a torn one), but its text is put
    together from per-record pieces cached since the last save: only the records
    that changed are encoded again (bench/many_bindings.py).
    """

    sections = {"bindings": _check_bindings, "leases": _check_leases}
    sync = False

    def __init__(self, path: Path, legacy: DurableStore | None = None) -> None:
        super().__init__(path)
        self.legacy = legacy
        self._fragments: dict[tuple[str, ...], _Fragments] = {}
        self._full_at = -FULL_CHECK_S  # monotonic time of the last full comparison

    def section(self, name: str, default: Any = None, *, exact: bool = False) -> Any:
        """The section ``name``; its maps of records note what their users may change.

        ``exact`` (a map of records): its owner only stores, replaces and deletes whole
        records, never changes one in place through a reference kept across a save (the
        JobRegistry makes a binding's JSON afresh at each bind). A save then compares
        only the records stored or handed out since the last one, not all of them."""
        sec = super().section(name, default)
        spec = _RECORD_MAPS.get(name, ...)
        if spec is None and isinstance(sec, dict) and not isinstance(sec, _Records):
            sec = self.data[name] = _Records(sec)
        if spec is None and isinstance(sec, _Records) and exact:
            sec.exact = True
        elif isinstance(spec, dict) and isinstance(sec, dict):
            for sub, subspec in spec.items():
                if subspec is None and not isinstance(sec.get(sub), _Records):
                    sec[sub] = _Records(sec.get(sub) or {})
        return sec

    def payload(self) -> bytes:
        """``_dumps(self.data)``, reusing the encoding of every record that did not change."""
        now = time.monotonic()
        full = now - self._full_at >= FULL_CHECK_S
        if full:
            self._full_at = now
        out: list[bytes] = []
        self._encode(self.data, _RECORD_MAPS, (), full, out)
        return b"".join(out)

    def _encode(self, value: dict[str, Any], spec: dict[str, Any], path: tuple[str, ...],
                full: bool, out: list[bytes]) -> None:
        """Append the text of ``value`` to ``out``, in pieces."""
        if not all(isinstance(k, str) for k in value):
            out.append(_dumps(value))  # json.dumps' own rules for odd keys (never here)
            return
        out.append(b"{")
        for i, key in enumerate(sorted(value)):
            v = value[key]
            sub = spec.get(key, ...)
            out += (b"," if i else b"", _dumps(key), b":")
            if sub is ... or not isinstance(v, dict):
                out.append(_dumps(v))
            elif sub is None:  # a dict of records
                where = (*path, key)
                frags = self._fragments.get(where)
                if frags is None:
                    frags = self._fragments[where] = _Fragments()
                out += frags.parts(v, full)
            else:
                self._encode(v, sub, (*path, key), full, out)
        out.append(b"}")

    def load(self) -> None:
        """Read the file (a missing one is an empty state); never raises for its content.

        A damaged file is kept aside as ``state.json.corrupt-TIME-PID`` and reported in
        ``load_error``; records that fail validation are dropped and named there.
        """
        errors: list[str] = []
        data, err = self._read(self.path)
        if err is not None:
            aside = self._set_aside(self.path)
            errors.append(f"{err}; kept as {aside}" if aside else err)
            errors.append("bindings and leases recorded in it were dropped")
            data = None
        migrated = self._take_legacy(data)
        if data is None and migrated is None:
            self.data = {"version": SCHEMA_VERSION}
        else:
            merged = {**(migrated or {}), **(data or {})}
            merged.setdefault("version", SCHEMA_VERSION)
            self.data, problems = self._validate(merged)
            if problems and data is not None:
                aside = self._copy_aside()
                problems.append(f"the file as it was is kept as {aside}")
            errors += problems
        if migrated is not None or errors:
            try:
                self.save()
                if migrated is not None and self.legacy is not None:
                    self.legacy.drop_foreign()
            except FileWriteError as werr:
                errors.append(werr.message)
        if errors:
            self.load_error = "; ".join(errors)
            log.error("%s", self.load_error)

    def _take_legacy(self, data: dict[str, Any] | None) -> dict[str, Any] | None:
        if self.legacy is None or not self.legacy.foreign:
            return None
        moved = {k: v for k, v in self.legacy.foreign.items()
                 if data is None or k not in data}
        log.info("moving %s from %s to %s", ", ".join(sorted(moved)) or "nothing",
                 self.legacy.path, self.path)
        return moved

    def _copy_aside(self) -> Path | None:
        aside = self.path.with_name(f"{self.path.name}.corrupt-"
                                    f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        try:
            write_atomic(aside, read_regular(self.path, MAX_STATE_BYTES), sync=False)
        except (Failed, OSError):
            return None
        return aside


class DurableStore(_JsonStore):
    """STATE_DIR/state.json (+ state.json.bak): original values of host settings."""

    sections = {"host": _check_host}
    sync = True

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.backup = self.path.with_name(self.path.name + ".bak")
        self.foreign: dict[str, Any] = {}  # sections of the old single-file layout
        self._saved: bytes | None = None  # what the files hold now (saves are skipped
        # when nothing changed: every bind used to rewrite the originals too)

    def _usable(self, path: Path) -> tuple[dict[str, Any] | None, str | None]:
        data, err = self._read(path)
        if data is None:
            return None, err
        checked, problems = self._validate(data)
        if problems:
            return None, "; ".join(problems)
        return checked, None

    def load(self) -> None:
        """Read the file, or its backup; raises StateDamaged when neither is usable."""
        data, err = self._usable(self.path)
        if data is None and err is not None:
            bak, bak_err = self._usable(self.backup)
            if bak is None:
                why = bak_err or "it does not exist"
                raise StateDamaged(
                    f"{err}, and its backup {self.backup} cannot replace it "
                    f"({why}). It may hold the original values of host settings tunerd "
                    f"changed: repair it, or move it aside (mv {self.path} "
                    f"{self.path}.damaged) to start without them and check the host "
                    "settings by hand", path=str(self.path))
            aside = self._set_aside(self.path)
            self.load_error = (f"{err}; recovered the host originals from {self.backup}"
                               + (f"; the damaged file is kept as {aside}" if aside else ""))
            log.error("%s", self.load_error)
            self._install(bak)
            self._saved = None
            self.save()  # the main file is whole again
            return
        if data is None:  # no main file, but maybe a backup (the main one was removed)
            bak, bak_err = self._usable(self.backup)
            if bak is not None:
                self.load_error = (f"{self.path} is missing; recovered the host originals "
                                   f"from {self.backup}")
                log.error("%s", self.load_error)
                self._install(bak)
                self.save()
            elif bak_err is not None:  # moved aside by an operator, and no good copy
                self.load_error = (f"{self.path} is missing and {bak_err}: starting with no "
                                   "saved originals of host settings")
                log.error("%s", self.load_error)
            self._saved = self.payload()  # nothing to write until something changes
            return
        self._install(data)
        self._saved = self.payload()

    def _install(self, data: dict[str, Any]) -> None:
        self.foreign = {k: v for k, v in data.items()
                        if k not in self.sections and k != "version"}
        self.data = {k: v for k, v in data.items() if k not in self.foreign}
        self.data.setdefault("version", SCHEMA_VERSION)

    def drop_foreign(self) -> None:
        """Forget the old layout's sections (now in the runtime store) and rewrite."""
        if self.foreign:
            self.foreign = {}
            self._saved = None
            self.save()

    def payload(self) -> bytes:
        return json.dumps({**self.foreign, **self.data}, separators=(",", ":"),
                          sort_keys=True, allow_nan=False).encode()

    def save(self) -> None:
        """Write the file, then its backup copy, each durably; no-op when unchanged.

        Two copies of the same generation (not the previous one): if the newest
        write were only in the damaged file, restoring an older one would lose
        the originals recorded for the change that followed it.
        """
        payload = self.payload()
        if payload == self._saved:
            return
        write_atomic(self.path, payload, sync=True)
        self._saved = payload
        try:
            write_atomic(self.backup, payload, sync=True)
        except FileWriteError as err:  # the main file is whole: a stale backup is no loss
            log.error("%s (the backup copy; %s is up to date)", err.message, self.path)
