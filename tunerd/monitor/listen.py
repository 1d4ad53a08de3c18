"""Parse ``metrics_listen``: "host:port", "[v6addr]:port", or "off"; port 0 = any free port."""

from __future__ import annotations

import ipaddress

from tunerd.base.errors import UsageError


def parse_listen(value: str) -> tuple[str, int] | None:
    """(host, port), or None for "off"; anything else is a UsageError naming the value."""
    v = value.strip()
    if v.lower() == "off":
        return None
    bad = UsageError(f"metrics_listen must be HOST:PORT, [IPv6]:PORT or off, got {value!r}")
    if v.startswith("["):
        host, sep, rest = v[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise bad
        port_s = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as err:
            raise UsageError(f"metrics_listen: {host!r} is not an IPv6 address") from err
    else:
        host, sep, port_s = v.rpartition(":")
        if not sep or not host or ":" in host:
            raise bad
    # port 0: the kernel picks a free port; the daemon logs it and status reports it
    if not port_s.isdigit() or not 0 <= int(port_s) < 65536:
        raise UsageError(f"metrics_listen: port must be 0-65535 (0: any free port), "
                         f"got {port_s!r} in {value!r}")
    return host, int(port_s)
