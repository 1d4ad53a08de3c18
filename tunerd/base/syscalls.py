"""System call numbers the stdlib has no wrapper for, per architecture.

x86_64 has its own table (arch/x86/entry/syscalls/syscall_64.tbl); arm64 uses the
generic one (include/uapi/asm-generic/unistd.h), as do riscv64 and loongarch64.
``tests/test_syscalls.py`` checks both against the kernel headers installed here
(/usr/include/asm-generic/unistd.h is arm64's table on any architecture), so the
aarch64 numbers are checked on an x86 build machine too. pidfd_open is 434 on every
architecture since 5.3 (the unified numbering); ``os.pidfd_open`` wraps it.
"""

from __future__ import annotations

import platform

__all__ = ["NR", "syscall_nr"]

_GENERIC = {"getcpu": 168, "mbind": 235, "get_mempolicy": 236, "set_mempolicy": 237,
            "migrate_pages": 238, "move_pages": 239, "pidfd_open": 434,
            "process_madvise": 440}
NR: dict[str, dict[str, int]] = {
    "x86_64": {"getcpu": 309, "mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239,
               "migrate_pages": 256, "move_pages": 279, "pidfd_open": 434,
               "process_madvise": 440},
    "aarch64": _GENERIC,
    "riscv64": _GENERIC,
    # only what tunerd had before, unchecked here (no headers for these on the build host)
    "ppc64le": {"set_mempolicy": 261, "pidfd_open": 434},
    "s390x": {"set_mempolicy": 270, "pidfd_open": 434},
}


def syscall_nr(name: str, machine: str | None = None) -> int | None:
    """The number of system call ``name`` on ``machine`` (default: this one's
    ``platform.machine()``); None where it is not known here."""
    return NR.get(machine or platform.machine(), {}).get(name)
