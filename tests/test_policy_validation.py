"""Bad policy files: each is refused with a message naming file, key path and value."""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import write_policy
from tunerd.policy import NodeFacts, PolicyError, load_policy_dir
from tunerd.policy.loader import MAX_FILE_BYTES, NotRegularFile, read_policy_bytes

HEAD = '[policy]\nname = "bad"\n\n'

# (id, file body, key path (or line) that must be named, bad value that must be quoted)
BAD_POLICIES: list[tuple[str, str, str, str]] = [
    ("negative-nofile", "[limits]\nnofile = -1\n", "limits.nofile", "-1"),
    ("nofile-string", '[limits]\nnofile = "lots"\n', "limits.nofile", '"lots"'),
    ("nofile-huge", "[limits]\nnofile = 99999999999\n", "limits.nofile", "99999999999"),
    ("nofile-datetime", "[limits]\nnofile = 1979-05-27\n", "limits.nofile", "1979-05-27"),
    ("mtu-too-big", '[[nic]]\nmatch = "eth*"\nmtu = 1500\n[[nic]]\nmatch = "ens*"\n'
     "mtu = 100000\n", "nic[1].mtu", "100000"),
    ("mtu-too-small", '[[nic]]\nmatch = "ens*"\nmtu = 67\n', "nic[0].mtu", "67"),
    ("mtu-float", '[[nic]]\nmatch = "ens*"\nmtu = 9000.0\n', "nic[0].mtu", "9000.0"),
    ("nic-unknown-key", '[[nic]]\nmatch = "ens*"\nmtuu = 9000\n', "nic[0].mtuu", '"mtuu"'),
    ("nic-missing-match", "[[nic]]\nmtu = 9000\n", "nic[0].match", "missing"),
    ("nic-glob-path", '[[nic]]\nmatch = "../x"\nmtu = 9000\n', "nic[0].match", '"../x"'),
    ("nic-duplicate-match", '[[nic]]\nmatch = "ens*"\n[[nic]]\nmatch = "ens*"\n',
     "nic[1].match", '"ens*"'),
    ("txqueuelen-negative", '[[nic]]\nmatch = "ens*"\ntxqueuelen = -1\n',
     "nic[0].txqueuelen", "-1"),
    ("unknown-section", "[sysctls]\nx = 1\n", "sysctls", '"sysctls"'),
    ("nic-not-array", '[nic]\nmatch = "ens*"\n', "nic", "table"),
    ("housekeeping-malformed", '[cpu]\nhousekeeping = "0-"\n', "cpu.housekeeping", '"0-"'),
    ("governor-unknown", '[cpu]\ngovernor = "turbo"\n', "cpu.governor", '"turbo"'),
    ("job-cpus-backwards", '[[job]]\nname = "j"\nmatch.cmdline = ["*x*"]\ncpus = "3-1"\n',
     "job[0].cpus", '"3-1"'),
    ("job-placement-unknown", '[[job]]\nname = "j"\nmatch.cmdline = ["*x*"]\n'
     'placement = "gpu-near"\n', "job[0].placement", '"gpu-near"'),
    ("job-missing-name", '[[job]]\nmatch.cmdline = ["*x*"]\n', "job[0].name", "missing"),
    ("job-empty-match", '[[job]]\nname = "j"\nmatch = {}\n', "job[0].match", "every process"),
    ("job-env-name", '[[job]]\nname = "j"\nmatch.env = { "1X" = "*" }\n',
     "job[0].match.env.1X", '"1X"'),
    ("job-scope", '[[job]]\nname = "j"\nmatch.user = "alice"\n'
     'exclusive_scope = "container:x"\n', "job[0].exclusive_scope", '"container:x"'),
    ("job-gpus-bool", '[[job]]\nname = "j"\nmatch.user = ["alice"]\ngpus = true\n',
     "job[0].gpus", "true"),
    ("job-duplicate-name", '[[job]]\nname = "j"\nmatch.user = "a"\n[[job]]\nname = "j"\n'
     'match.user = "b"\n', "job[1].name", '"j"'),
    ("sysctl-name-dots", '[sysctl]\n"net..core" = 1\n', 'sysctl."net..core"', '"net..core"'),
    ("sysctl-name-root", '[sysctl]\n"foo.bar" = 1\n', 'sysctl."foo.bar"', '"foo.bar"'),
    ("sysctl-name-slash", '[sysctl]\n"net/../../etc" = 1\n', 'sysctl."net/../../etc"',
     '"net/../../etc"'),
    ("sysctl-bool", '[sysctl]\n"vm.swappiness" = true\n', 'sysctl."vm.swappiness"', "true"),
    ("sysctl-newline", '[sysctl]\n"kernel.x" = "1\\nkernel.y=2"\n', 'sysctl."kernel.x"',
     '"1\\nkernel.y=2"'),
    ("sysctl-unquoted-bad", "[sysctl]\nnet.core.rmem_max = [1]\n",
     'sysctl."net.core.rmem_max"', "[1]"),
    ("nccl-prefix", "[nccl]\nIB_DISABLE = 1\n", "nccl.IB_DISABLE", '"IB_DISABLE"'),
    ("nccl-float", "[nccl]\nNCCL_BUFFSIZE = 1.5\n", "nccl.NCCL_BUFFSIZE", "1.5"),
    ("thp-unknown", '[vm]\ntransparent_hugepage = "sometimes"\n', "vm.transparent_hugepage",
     '"sometimes"'),
    ("thp-defrag-unknown", '[vm]\ntransparent_hugepage_defrag = "eager"\n',
     "vm.transparent_hugepage_defrag", '"eager"'),
    ("numa-balancing-string", '[vm]\nnuma_balancing = "off"\n', "vm.numa_balancing", '"off"'),
    ("compute-mode", '[gpu]\ncompute_mode = "exclusive"\n', "gpu.compute_mode", '"exclusive"'),
    ("power-limit-zero", "[gpu]\npower_limit_w = 0\n", "gpu.power_limit_w", "0"),
    ("block-scheduler", '[[block]]\nmatch = "sd*"\nscheduler = "cfq"\n', "block[0].scheduler",
     '"cfq"'),
    ("block-read-ahead", '[[block]]\nmatch = "nvme*"\nread_ahead_kb = -5\n',
     "block[0].read_ahead_kb", "-5"),
    ("block-nr-requests", '[[block]]\nmatch = "nvme*"\nnr_requests = 2\n',
     "block[0].nr_requests", "2"),
    ("job-workers-negative", '[[job]]\nname = "j"\nmatch.user = "a"\nworkers = -1\n',
     "job[0].workers", "-1"),
    ("job-workers-huge", '[[job]]\nname = "j"\nmatch.user = "a"\nworkers = 5000\n',
     "job[0].workers", "5000"),
    ("job-workers-string", '[[job]]\nname = "j"\nmatch.user = "a"\nworkers = "8"\n',
     "job[0].workers", '"8"'),
    ("torch-not-table", '[[job]]\nname = "j"\nmatch.user = "a"\ntorch = "bf16"\n',
     "job[0].torch", '"bf16"'),
    ("torch-amp", '[[job]]\nname = "j"\nmatch.user = "a"\ntorch = { amp = "fp32" }\n',
     "job[0].torch.amp", '"fp32"'),
    ("torch-unknown-key", '[[job]]\nname = "j"\nmatch.user = "a"\n'
     "torch = { num_worker = 2 }\n", "job[0].torch.num_worker", '"num_worker"'),
    ("torch-num-workers", '[[job]]\nname = "j"\nmatch.user = "a"\n'
     "torch = { num_workers = 2000 }\n", "job[0].torch.num_workers", "2000"),
    ("torch-prefetch-zero", '[[job]]\nname = "j"\nmatch.user = "a"\n'
     "torch = { prefetch_factor = 0 }\n", "job[0].torch.prefetch_factor", "0"),
    ("torch-pin-string", '[[job]]\nname = "j"\nmatch.user = "a"\n'
     'torch = { pin_memory = "yes" }\n', "job[0].torch.pin_memory", '"yes"'),
    ("torch-compile-int", '[[job]]\nname = "j"\nmatch.user = "a"\n[job.torch]\ncompile = 1\n',
     "job[0].torch.compile", "1"),
    ("torch-persistent-no-workers", '[[job]]\nname = "j"\nmatch.user = "a"\n'
     "torch = { num_workers = 0, persistent_workers = true }\n",
     "job[0].torch.persistent_workers", "true"),
    ("torch-prefetch-no-workers", '[[job]]\nname = "j"\nmatch.user = "a"\n'
     "torch = { num_workers = 0, prefetch_factor = 2 }\n",
     "job[0].torch.prefetch_factor", "2"),
    ("leases-max-negative", "[leases]\nmax_per_user = -1\n", "leases.max_per_user", "-1"),
    ("leases-ttl-string", '[leases]\nalloc_ttl = "1d"\n', "leases.alloc_ttl", '"1d"'),
    ("leases-ttl-huge", "[leases]\nalloc_ttl = 99999999999\n", "leases.alloc_ttl",
     "99999999999"),
    ("leases-user-exclusive-int", "[leases]\nuser_exclusive = 1\n", "leases.user_exclusive",
     "1"),
    ("leases-unknown-key", "[leases]\nttl = 60\n", "leases.ttl", '"ttl"'),
]

BAD_META: list[tuple[str, str, str, str]] = [
    ("min-gpus-negative", '[policy]\nname = "bad"\n[policy.match]\nmin_gpus = -1\n',
     "policy.match.min_gpus", "-1"),
    ("min-above-max", '[policy]\nname = "bad"\n[policy.match]\nmin_gpus = 8\nmax_gpus = 4\n',
     "policy.match.max_gpus", "4"),
    ("hostname-int", '[policy]\nname = "bad"\n[policy.match]\nhostname = 5\n',
     "policy.match.hostname", "5"),
    ("gpu-model-int", '[policy]\nname = "bad"\n[policy.match]\ngpu_model = ["*H100*", 1]\n',
     "policy.match.gpu_model[1]", "1"),
    ("match-unknown-key", '[policy]\nname = "bad"\n[policy.match]\ngpu = "*H100*"\n',
     "policy.match.gpu", '"gpu"'),
    ("policy-name", '[policy]\nname = "bad name!"\n', "policy.name", '"bad name!"'),
    ("extends-unknown", '[policy]\nname = "bad"\nextends = ["bse"]\n', "policy.extends[0]",
     '"bse"'),
    ("extends-self", '[policy]\nname = "bad"\nextends = "bad"\n', "policy.extends",
     "bad -> bad"),
    ("leases-not-table", 'leases = 5\n[policy]\nname = "bad"\n', "leases", "5"),
    ("apply-once-int", '[policy]\nname = "bad"\napply_once = 5\n', "policy.apply_once", "5"),
]

SYNTAX: list[tuple[str, str, str, str]] = [
    ("double-equals", "[limits]\nnofile = = 3\n", "line 2", "nofile = = 3"),
    ("duplicate-key", "[limits]\nnofile = 1\nnofile = 2\n", "line 3", "nofile = 2"),
    ("unclosed-string", '[policy]\nname = "x\n', "line 2", "name"),
    ("unclosed-table", "[limits\nnofile = 1\n", "line 1", "[limits"),
]


def _load_error(tmp_path: Path, body: str) -> tuple[Path, str]:
    d = tmp_path / "pol"
    f = write_policy(d, "10-bad.toml", body)
    with pytest.raises(PolicyError) as exc:
        load_policy_dir(d, NodeFacts(hostname="n1"))
    return f, exc.value.message


@pytest.mark.parametrize(("body", "path", "value"),
                         [c[1:] for c in BAD_POLICIES], ids=[c[0] for c in BAD_POLICIES])
def test_bad_value_names_file_key_and_value(tmp_path: Path, body: str, path: str,
                                            value: str) -> None:
    f, msg = _load_error(tmp_path, HEAD + body)
    assert str(f) in msg
    assert f": {path}:" in msg or f": {path} " in msg, msg
    assert value in msg.split(path, 1)[1], msg


@pytest.mark.parametrize(("body", "path", "value"),
                         [c[1:] for c in BAD_META], ids=[c[0] for c in BAD_META])
def test_bad_policy_table(tmp_path: Path, body: str, path: str, value: str) -> None:
    f, msg = _load_error(tmp_path, body)
    assert str(f) in msg
    assert path in msg, msg
    assert value in msg.split(path, 1)[1], msg


@pytest.mark.parametrize(("body", "line", "near"),
                         [c[1:] for c in SYNTAX], ids=[c[0] for c in SYNTAX])
def test_syntax_error_names_file_and_line(tmp_path: Path, body: str, line: str,
                                          near: str) -> None:
    f, msg = _load_error(tmp_path, body)
    assert msg.startswith(f"{f}: {line}"), msg
    assert "TOML syntax error" in msg
    assert near in msg


def test_every_problem_is_listed(tmp_path: Path) -> None:
    d = tmp_path / "pol"
    write_policy(d, "a.toml", '[limits]\nnofile = -1\n[vm]\nnuma_balancing = "no"\n')
    write_policy(d, "b.toml", "[gpu]\npower_limit_w = 0\n")
    with pytest.raises(PolicyError) as exc:
        load_policy_dir(d, NodeFacts())
    errors = exc.value.details["errors"]
    assert len(errors) == 3
    assert "(and 2 more problem(s); `tunerctl policy check` lists them)" in exc.value.message
    assert any("a.toml: limits.nofile" in e for e in errors)
    assert any("a.toml: vm.numa_balancing" in e for e in errors)
    assert any("b.toml: gpu.power_limit_w" in e for e in errors)


def test_bad_file_that_does_not_apply_still_rejects_the_set(tmp_path: Path) -> None:
    """Nothing is applied from a set with a bad file, even one meant for other nodes."""
    d = tmp_path / "pol"
    write_policy(d, "00-good.toml", "[limits]\nnofile = 4096\n")
    write_policy(d, "50-other.toml", '[policy.match]\nhostname = "elsewhere-*"\n'
                                     '[[nic]]\nmatch = "ens*"\nmtu = 1\n')
    with pytest.raises(PolicyError, match=r"50-other\.toml: nic\[0\]\.mtu"):
        load_policy_dir(d, NodeFacts(hostname="here"))


def test_not_utf8_and_unreadable(tmp_path: Path) -> None:
    d = tmp_path / "pol"
    d.mkdir()
    (d / "a.toml").write_bytes(b'[policy]\nname = "\xff"\n')
    with pytest.raises(PolicyError, match=r"a\.toml: line 2: not UTF-8"):
        load_policy_dir(d, NodeFacts())
    (d / "a.toml").unlink()
    (d / "b.toml").mkdir()  # a directory named like a policy
    with pytest.raises(PolicyError, match=r"b\.toml: not a regular file \(a directory\)"):
        load_policy_dir(d, NodeFacts())
    (d / "b.toml").rmdir()
    big = d / "c.toml"
    big.write_bytes(b"# " + b"x" * MAX_FILE_BYTES + b"\n")
    with pytest.raises(PolicyError, match=r"c\.toml: larger than 1048576 bytes"):
        load_policy_dir(d, NodeFacts())
    big.unlink()
    (d / "d.toml").symlink_to(d / "nowhere.toml")  # dangling
    with pytest.raises(PolicyError, match=r"d\.toml: cannot read: No such file"):
        load_policy_dir(d, NodeFacts())
    if os.geteuid() != 0:  # root reads anything
        (d / "d.toml").unlink()
        (d / "e.toml").write_text("")
        (d / "e.toml").chmod(0)
        with pytest.raises(PolicyError, match=r"e\.toml: cannot read: Permission denied"):
            load_policy_dir(d, NodeFacts())


# -- files that are not regular files: refused without being opened for reading ----------
def _fifo(d: Path, name: str) -> Path:
    p = d / name
    os.mkfifo(p)
    return p


def _socket(d: Path, name: str) -> Path:
    p = d / name
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()  # the socket file stays
    return p


def _link(d: Path, name: str, target: Path) -> Path:
    p = d / name
    p.symlink_to(target)
    return p


NOT_REGULAR: dict[str, tuple[Callable[[Path], Path], str]] = {
    "fifo": (lambda d: _fifo(d, "50-x.toml"), "a FIFO"),
    "symlink-to-fifo": (lambda d: _link(d, "50-x.toml", _fifo(d.parent, "elsewhere")),
                        "a symlink to a FIFO"),
    "socket": (lambda d: _socket(d, "50-x.toml"), "a socket"),
    # /dev/zero would never end, /dev/watchdog would arm the watchdog if opened
    "symlink-to-device": (lambda d: _link(d, "50-x.toml", Path("/dev/zero")),
                          "a symlink to a character device"),
    "symlink-to-dir": (lambda d: _link(d, "50-x.toml", d.parent), "a symlink to a directory"),
}


def _load_in_thread(d: Path, timeout: float = 20.0) -> BaseException | None:
    """load_policy_dir in a daemon thread: a test that blocked in open() fails, not hangs."""
    box: list[BaseException | None] = []

    def run() -> None:
        try:
            load_policy_dir(d, NodeFacts())
            box.append(None)
        except BaseException as err:
            box.append(err)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert box, f"load_policy_dir({d}) still blocked after {timeout} s"
    return box[0]


@pytest.mark.parametrize("kind", sorted(NOT_REGULAR))
def test_non_regular_policy_file_is_refused_without_blocking(tmp_path: Path, kind: str) -> None:
    d = tmp_path / "pol"
    write_policy(d, "00-good.toml", "[limits]\nnofile = 4096\n")
    make, what = NOT_REGULAR[kind]
    bad = make(d)
    err = _load_in_thread(d)
    # a FIFO read with O_NONBLOCK gives b"" (an empty, valid policy): the error proves
    # the loader looked at the type instead of reading it
    assert isinstance(err, PolicyError), err
    assert err.message.startswith(f"{bad}: not a regular file ({what}); "), err.message
    assert err.details["file"] == str(bad)
    if kind == "fifo":
        # nothing holds it open for reading: a writer finds no reader
        with pytest.raises(OSError) as ei:
            os.open(bad, os.O_WRONLY | os.O_NONBLOCK)
        assert ei.value.errno == errno.ENXIO


def test_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    shared = write_policy(tmp_path / "shared", "site.toml", "[limits]\nnofile = 4242\n")
    d = tmp_path / "pol"
    d.mkdir()
    link = _link(d, "10-site.toml", shared)
    # a relative link through another symlinked directory, as package managers make them
    (tmp_path / "alias").symlink_to(tmp_path / "shared")
    rel = _link(d, "20-rel.toml", Path("../alias/site.toml"))
    p = load_policy_dir(d, NodeFacts())
    assert p.model.limits.nofile == 4242
    assert p.sources == [str(link), str(rel)]


def test_read_policy_bytes_is_bounded(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"a" * 200_000)
    assert read_policy_bytes(f, 70_000) == b"a" * 70_000
    assert read_policy_bytes(f, 1 << 20) == b"a" * 200_000
    with pytest.raises(NotRegularFile, match=r"not a regular file \(a FIFO\)"):
        read_policy_bytes(_fifo(tmp_path, "p"), 10)


def test_valid_values_are_normalized(tmp_path: Path) -> None:
    d = tmp_path / "pol"
    write_policy(d, "a.toml", '[cpu]\nhousekeeping = "1,0,2-3"\n[sysctl]\n'
                              "net.core.somaxconn = 4096\n"
                              '[[job]]\nname = "j"\nmatch.cmdline = "*x*"\ncpus = "5,4"\n')
    data = load_policy_dir(d, NodeFacts()).data
    assert data["cpu"]["housekeeping"] == "0-3"
    assert data["sysctl"] == {"net.core.somaxconn": 4096}  # unquoted dotted key folded
    assert data["job"] == [{"name": "j", "placement": "gpu-local", "cpus": "4-5",
                            "match": {"cmdline": ["*x*"], "env": {}, "user": []}}]


def test_documented_example_policy_is_valid(tmp_path: Path) -> None:
    from tests.helpers import REPO

    page = (REPO / "docs" / "policies.md").read_text()  # the first example of the page
    example = page.split("```toml\n", 1)[1].split("```", 1)[0]
    write_policy(tmp_path, "example.toml", example)
    p = load_policy_dir(tmp_path, NodeFacts("dgx-01", ("NVIDIA H100 80GB HBM3",) * 8))
    assert p.data["policy"]["names"] == ["base", "h100-training"]
    assert p.data["nic"] == [{"match": "en*np*", "mtu": 9000}]
