"""The host-level network model of §3 on an alpha-beta profile.

Hosts are fully connected and full duplex; the devices of a host share its NIC,
so a transfer between hosts occupies the sender host's send port and the
receiver host's receive port; a transfer inside a host runs on the intra tier
(NVLink) and occupies only the two devices. Every device takes part in one
communication at a time (one stream per device), so each device is a port too.
A hop of n bytes costs the profile's sendrecv time on the tier it crosses.
"""
from __future__ import annotations

from dataclasses import dataclass

from calibrate.collectives import Collective
from calibrate.profile import Group, Profile

Port = tuple[str, int]  # ("dev", device) | ("send", host) | ("recv", host)


@dataclass(frozen=True)
class Network:
    profile: Profile
    devices_per_host: int

    def host(self, device: int) -> int:
        return device // self.devices_per_host

    def hop(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds to move ``nbytes`` from device src to device dst (0 for a local copy)."""
        if src == dst or nbytes <= 0:
            return 0.0
        nodes = 1 if self.host(src) == self.host(dst) else 2
        return self.profile.time(Collective.SENDRECV, nbytes, Group(2, nodes))

    def inter_hop(self, nbytes: float) -> float:
        return self.profile.time(Collective.SENDRECV, nbytes, Group(2, 2)) if nbytes > 0 else 0.0

    def intra_hop(self, nbytes: float) -> float:
        return self.profile.time(Collective.SENDRECV, nbytes, Group(2, 1)) if nbytes > 0 else 0.0

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
                out.update((("send", self.host(s)), ("recv", self.host(d))))
        return frozenset(out)

    def ring(self, devices: tuple[int, ...]) -> list[tuple[int, int]]:
        """The edges of a ring over ``devices`` ordered host by host (one inter edge per host)."""
        order = sorted(devices, key=lambda d: (self.host(d), d))
        if len(order) < 2:
            return []
        return [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]
