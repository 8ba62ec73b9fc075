"""The host-level network model of §3 on an alpha-beta profile.

Hosts are fully connected and full duplex; the devices of a host share its NIC
where the profile's inter-node bandwidth is the node's (``Profile.per``: "node", AutoDDL's
clusters), and each device has its own where it is each GPU's ("gpu": one InfiniBand NIC per GPU,
the DGX H100/H200 and A100 nodes of the embedded profiles). A transfer between hosts occupies the
sender's NIC's send port and the receiver's NIC's receive port; a transfer inside a host runs on the
intra tier (NVLink) and occupies only the two devices. Every device takes part in one
communication at a time (one stream per device), so each device is a port too.
A hop of n bytes costs the profile's sendrecv time on the tier it crosses.
"""
from __future__ import annotations

from dataclasses import dataclass

from calibrate.collectives import Collective
from calibrate.profile import Group, Profile

Port = tuple[str, int]  # ("dev", device) | ("send", nic) | ("recv", nic)


@dataclass(frozen=True)
class Network:
    profile: Profile
    devices_per_host: int

    def host(self, device: int) -> int:
        return device // self.devices_per_host

    def nic(self, device: int) -> int:
        """The NIC a device's inter-host transfers cross: its host's one, or its own where the inter tier's
        bandwidth is per GPU (module doc)."""
        return device if self.profile.per("inter") == "gpu" else self.host(device)

    @property
    def nics(self) -> int:
        """NICs a host has: one, or one a device (``nic``)."""
        return self.devices_per_host if self.profile.per("inter") == "gpu" else 1

    def hop(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds to move ``nbytes`` from device src to device dst (0 for a local copy)."""
        if src == dst or nbytes <= 0:
            return 0.0
        nodes = 1 if self.host(src) == self.host(dst) else 2
        return self.profile.time(Collective.SENDRECV, nbytes, Group(2, nodes))

    def inter_hop(self, nbytes: float) -> float:
        return self.profile.time(Collective.SENDRECV, nbytes, Group(2, 2)) if nbytes > 0 else 0.0

    def allgather(self, nbytes: float, devices: tuple[int, ...]) -> float:
        """Ring all-gather whose gathered output is ``nbytes`` on each device."""
        hosts = {self.host(d) for d in devices}
        if len(devices) < 2:
            return 0.0
        return self.profile.time(Collective.ALLGATHER, nbytes, Group(len(devices), len(hosts)))

    def ports(self, transfers, devices=()) -> frozenset[Port]:
        """Ports used by the (src, dst) device transfers, plus the devices listed."""
        out: set[Port] = {("dev", d) for d in devices}
        for s, d in transfers:
            out.update((("dev", s), ("dev", d)))
            if self.host(s) != self.host(d):
                out.update((("send", self.nic(s)), ("recv", self.nic(d))))
        return frozenset(out)

    def ring(self, devices: tuple[int, ...]) -> list[tuple[int, int]]:
        """The edges of a ring over ``devices`` ordered host by host (one inter edge per host)."""
        order = sorted(devices, key=lambda d: (self.host(d), d))
        if len(order) < 2:
            return []
        return [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]
