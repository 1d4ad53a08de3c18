"""Does a policy's ``[policy.match]`` table fit this node?"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from tunerd.policy.model import NodeFacts

__all__ = ["mismatch"]


def _any_glob(names: list[str], globs: list[str]) -> bool:
    # hostnames and GPU model strings are compared case-insensitively: NVML reports
    # "NVIDIA A100-PCIE-40GB" on one driver and "... PCIe ..." on another
    return any(fnmatchcase(n.lower(), g.lower()) for n in names for g in globs)


def mismatch(match: dict[str, Any] | None, facts: NodeFacts) -> str | None:
    """None when every key of ``match`` fits ``facts``, else why not (for `policy show`)."""
    if not match:
        return None
    globs = match.get("hostname")
    if globs is not None:
        host = facts.hostname
        # "dgx-01" should match "dgx-01.cluster.local" too: try the FQDN and the short name
        names = [host, host.split(".", 1)[0]]
        if not _any_glob(names, globs):
            return f"hostname {host!r} matches none of {globs}"
    globs = match.get("gpu_model")
    if globs is not None and not _any_glob(list(facts.gpu_models), globs):
        models = sorted(set(facts.gpu_models)) or ["no GPU"]
        return f"no GPU model matches {globs} (node has {', '.join(models)})"
    n = facts.gpu_count
    if "min_gpus" in match and n < match["min_gpus"]:
        return f"{n} GPU(s), fewer than min_gpus = {match['min_gpus']}"
    if "max_gpus" in match and n > match["max_gpus"]:
        return f"{n} GPU(s), more than max_gpus = {match['max_gpus']}"
    return None
