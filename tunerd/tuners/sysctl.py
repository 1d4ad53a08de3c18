"""Kernel parameters under /proc/sys (``sysctl:<name>`` keys).

Values are compared with whitespace folded, because the kernel prints vectors
with tabs ("4096\\t131072\\t6291456") while policies write them with spaces.
Inside a network namespace the ``net.*`` files are that namespace's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tunerd.policy.typed import SysctlValue
from tunerd.tuners.base import FileTuner, to_setting_value


def sysctl_path(root: Path, name: str) -> Path:
    """net.ipv4.conf.eth0/1.rp_filter -> ROOT/net/ipv4/conf/eth0.1/rp_filter (sysctl(8) rules)."""
    # sysctl(8) swaps the separators: '.' divides levels, '/' stands for a '.' in a name
    parts = [p.replace("/", ".") for p in name.split(".")]
    return root.joinpath(*parts)


class SysctlTuner(FileTuner[Mapping[str, SysctlValue]]):
    kind = "sysctl"
    # a sysctl the policy names but this kernel lacks is an error (ENOENT), not "n/a"
    missing_is_error = True

    def __init__(self, proc_root: Path | str = "/proc") -> None:
        self.root = Path(proc_root) / "sys"

    def path_for(self, key: str) -> Path | None:
        name = key.partition(":")[2]
        if not name or ".." in name or name.startswith("."):
            return None
        return sysctl_path(self.root, name)

    # read() without keys gives {}: walking all of /proc/sys to list every sysctl would
    # cost far more than any caller needs; read(["sysctl:NAME", ...]) reads those.

    def wanted(self, desired: Mapping[str, SysctlValue]) -> dict[str, str]:
        return {f"sysctl:{name}": to_setting_value(v) for name, v in desired.items()}
