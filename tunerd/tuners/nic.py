"""NIC MTU and transmit queue length per interface-name glob (``nic:<if>:mtu|txqueuelen``).

Written through sysfs (/sys/class/net/IF/{mtu,tx_queue_len}), which calls the
same dev_set_mtu()/dev_change_tx_queue_len() as netlink; a value the driver
refuses comes back as EINVAL and is reported with the key and value.
"""

from __future__ import annotations

from pathlib import Path

from tunerd.tuners.base import DeviceGlobTuner

# policy key -> sysfs attribute
ATTRS = {"mtu": "mtu", "txqueuelen": "tx_queue_len"}


class NicTuner(DeviceGlobTuner):
    kind = "nic"
    attrs = ATTRS

    def __init__(self, sys_root: Path | str = "/sys") -> None:
        super().__init__(Path(sys_root) / "class" / "net")
