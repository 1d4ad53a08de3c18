"""The runtime state's records, typed: bindings and leases as the state file holds them.

The layout is the one older daemons wrote (a state file survives an upgrade); what is
read back is typed (tunerd.base.jsontypes), and a lease field that is not of its JSON
type makes the record malformed (dropped with a log line by its owner) instead of
loading a value of the wrong type.
"""

from __future__ import annotations

import json

import pytest

from tunerd.jobs.records import PUBLIC_BINDING, Binding, Hold, Lease

# as a daemon before the typed records wrote them (field order included)
OLD_BINDING = {
    "pid": 4242, "start_time": 17, "uid": 1000, "name": "python", "cmdline": "python train.py",
    "cpus": "0-3", "mems": "0", "gpus": [1], "nofile": 65536, "origin": "rule", "lease": None,
    "bound_at": 1733380000.5, "explanation": "GPU 1; CPU 0-3", "notes": ["a note"],
    "why": "LOCAL_RANK=1", "originals": {
        "pid": 4242, "start_time": 17, "process_cpus": "0-7", "threads": {"0-7": [4242, 4243]},
        "nofile": [1024, 4096], "cpuset_base": None, "cpuset_child": None,
        "affinity_set": True},
    "hold": {"group": "slurm:12.0", "job": "slurm:12", "exclusive": False, "uid": 1000}}
OLD_LEASE = {
    "id": "L3", "uid": 0, "user": "root", "origin": "run", "gpus": [0, 1], "cpus": "0-13",
    "mems": "0", "exclusive": True, "scope": "pid:1", "pid": 77, "start_time": 12,
    "cmd": ["python", "x.py"], "tag": "t", "created": 1.0, "expires": None,
    "gpu_uuids": ["GPU-a", "GPU-b"], "explanation": "e", "applied": True, "notes": ["n"],
    "cvd": "0,1", "moved": 3, "job": "slurm:12"}


def test_old_records_load_typed_refuse_wrong_types_and_write_back_the_same_layout() -> None:
    b = Binding.from_json(json.loads(json.dumps(OLD_BINDING)))
    assert (b.pid, b.gpus, b.notes, b.hold) == (4242, (1,), ("a note",),
                                                Hold("slurm:12.0", "slurm:12", False, 1000))
    assert json.dumps(b.to_json()) == json.dumps(OLD_BINDING)
    assert tuple(b.public()) == PUBLIC_BINDING
    lease = Lease.from_json(json.loads(json.dumps(OLD_LEASE)))
    assert (lease.gpus, lease.cmd, lease.moved, lease.cpus_bound) == ((0, 1), ["python", "x.py"],
                                                                      3, None)
    assert json.dumps(lease.to_json()) == json.dumps(OLD_LEASE)
    # an older lease without the optional tail, and an int where a float belongs
    short = {k: v for k, v in OLD_LEASE.items() if k not in ("cvd", "moved", "job", "tag")}
    assert Lease.from_json(dict(short, created=5)).created == 5.0
    # a field of the wrong JSON type, or a record that is no object: malformed
    for key, bad in (("created", "x"), ("uid", "0"), ("cmd", "python"), ("exclusive", 1),
                     ("moved", [1]), ("scope", 3), ("gpus", None)):
        with pytest.raises(ValueError, match="malformed lease record"):
            Lease.from_json(dict(OLD_LEASE, **{key: bad}))
    for raw in ("L3", [OLD_LEASE], None):
        with pytest.raises(ValueError, match="malformed lease record"):
            Lease.from_json(raw)
        with pytest.raises(ValueError, match="malformed binding record"):
            Binding.from_json(raw)
