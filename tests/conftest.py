from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import DaemonProc, write_policy

MINIMAL_POLICY = '[policy]\nname = "test"\n\n[limits]\nnofile = 65536\n'


def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile the checkout's Python once, before anything runs. With
    PYTHONDONTWRITEBYTECODE set (as in CI) nothing else writes .pyc files, and every
    daemon, tunerctl and helper child the tests start (thousands) would compile the
    modules it imports from source again: ~0.3 s more for each daemon start. Python
    still reads .pyc files that exist; the code run is the same."""
    import compileall

    from tests.helpers import REPO

    for part in ("tunerd", "tests", "bench", "contrib", "scripts"):
        compileall.compile_dir(REPO / part, quiet=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


TEST_USER = "tunerd-test"


@pytest.fixture(scope="session")
def unpriv_user() -> tuple[int, int]:
    """(uid, gid) of an unprivileged user created for the tests (root only)."""
    import pwd
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("creating a test user needs root")
    try:
        pw = pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        TEST_USER], check=True)
        pw = pwd.getpwnam(TEST_USER)
    return pw.pw_uid, pw.pw_gid


@pytest.fixture
def nvml_backend() -> Iterator[object]:
    """Yields tunerd.adapters.nvml.set_backend; the NVML backend a test sets is undone after it."""
    from tunerd.adapters import nvml

    with nvml.restoring_backend():
        yield nvml.set_backend


@pytest.fixture(scope="module")
def host_untouched() -> Iterator[None]:
    """Fails the module if it changed any of a few host values (tests/host_helpers)."""
    from tests.host_helpers import host_fingerprint

    before = host_fingerprint()
    yield
    assert host_fingerprint() == before


@pytest.fixture
def daemons() -> Iterator[list[object]]:
    """Namespaced daemons (tests/host_helpers.NsDaemonProc) a test starts; cleaned up after."""
    made: list[object] = []
    yield made
    for d in made:
        d.cleanup()  # type: ignore[attr-defined]


@pytest.fixture
def policy_dir(tmp_path: Path) -> Path:
    d = tmp_path / "policies"
    write_policy(d, "00-test.toml", MINIMAL_POLICY)
    return d


@pytest.fixture
def daemon_factory() -> Iterator[object]:
    """Build (not start) real daemons in tmp dirs; all are stopped at teardown.

    The dirs live in a world-traversable /tmp/tunerd-test-* (pytest's tmp_path is 0700),
    so tests acting as an unprivileged user can reach the control socket.
    """
    import shutil
    import tempfile

    made: list[DaemonProc] = []
    root = Path(tempfile.mkdtemp(prefix="tunerd-test-"))
    root.chmod(0o755)

    def make(policy_dir: Path | None = None, args: list[str] | None = None,
             env: dict[str, str] | None = None, name: str = "d") -> DaemonProc:
        base = root / name
        base.mkdir(exist_ok=True)
        pdir = policy_dir
        if pdir is None:
            pdir = base / "policies"
            write_policy(pdir, "00-test.toml", MINIMAL_POLICY)
        d = DaemonProc(tmp=base, policy_dir=pdir, extra_args=args or [], env=env or {})
        made.append(d)
        return d

    yield make
    for d in made:
        try:
            d.stop()
        except Exception:
            pass
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory) -> DaemonProc:  # type: ignore[no-untyped-def]
    """A running real tunerd with a minimal policy."""
    return daemon_factory().start()  # type: ignore[no-any-return]


@contextlib.contextmanager
def own_daemon(extra_args: list[str] | None = None,
               env: dict[str, str] | None = None) -> Iterator[DaemonProc]:
    """A running real tunerd with a minimal policy in its own world-traversable temp
    dir (users' tests reach its socket), stopped and removed after the block."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="tunerd-test-"))
    root.chmod(0o755)
    d = DaemonProc(tmp=root, policy_dir=write_policy(root / "policies", "00-test.toml",
                                                     MINIMAL_POLICY).parent,
                   extra_args=extra_args or [], env=env or {})
    try:
        yield d.start()
    finally:
        try:
            d.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def module_daemon() -> Iterator[DaemonProc]:
    """A running real tunerd with a minimal policy, as ``daemon``, shared by the tests of
    a module that use it: only for tests that leave it as they found it (nothing bound,
    leased or reloaded; each such test asserts that), so that the next one finds it as a
    fresh one would be. A daemon start costs ~0.5 s."""
    with own_daemon() as d:
        yield d
