"""System call numbers per architecture (issue 36 item 4): the aarch64 table (the
kernel's generic one) and the x86_64 table checked against the kernel headers
installed here, and the callers asking by name on the machine they run on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tunerd.base.syscalls import NR, syscall_nr

HEADERS = {
    # arm64 (and riscv64) use the generic table: checkable on any build machine
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),
    "riscv64": Path("/usr/include/asm-generic/unistd.h"),
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
}


def _table(header: Path) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in
            re.finditer(r"^#define __NR(?:3264)?_(\w+)\s+(\d+)\s*$", header.read_text(), re.M)}


@pytest.mark.parametrize("machine", sorted(HEADERS))
def test_numbers_match_the_kernel_headers(machine: str) -> None:
    header = HEADERS[machine]
    if not header.exists():
        pytest.skip(f"{header} not installed (apt-get install linux-libc-dev)")
    kernel = _table(header)
    for name, nr in NR[machine].items():
        assert kernel.get(name) == nr, (machine, name, nr, kernel.get(name))


def test_the_arm64_numbers_the_issue_names() -> None:
    # include/uapi/asm-generic/unistd.h: mbind 235, set_mempolicy 237,
    # migrate_pages 238, pidfd_open 434 (the same everywhere since 5.3)
    assert [syscall_nr(n, "aarch64") for n in
            ("mbind", "set_mempolicy", "migrate_pages", "pidfd_open")] == [235, 237, 238, 434]
    assert syscall_nr("migrate_pages", "x86_64") == 256
    assert syscall_nr("migrate_pages", "sparc") is None  # unknown: the caller says so


def test_callers_ask_for_the_number_of_the_machine_they_run_on(monkeypatch) -> None:
    """The aarch64 path of the callers, run here: platform.machine() says aarch64."""
    import tunerd.base.syscalls as sc

    monkeypatch.setattr(sc.platform, "machine", lambda: "aarch64")
    assert sc.syscall_nr("migrate_pages") == 238 and sc.syscall_nr("set_mempolicy") == 237
    # no raw number left in the callers: each asks the table by name
    repo = Path(__file__).resolve().parent.parent
    for rel in ("tunerd/jobs/actuate.py", "tunerd/cli/cmd_leases.py"):
        text = (repo / rel).read_text()
        assert "syscall_nr(" in text, rel
        assert not re.search(r"\b(256|238|237)\b", text), rel
