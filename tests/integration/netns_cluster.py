"""A small cluster of network namespaces on one machine, for tests.

Each node is a network namespace (``ip netns``) with its own hostname: every
process entered into a node runs in that namespace and in a fresh UTS
namespace named after the node (``unshare --uts``), so ``gethostname()``
differs per node and MPI counts the nodes as a real cluster would; ranks of one
node still share memory (the same /dev/shm), as on a real node. The nodes hang
on one bridge that lives in a namespace of its own (the switch): nothing of the
machine's own network is addressed or changed.

Each node's uplink is shaped with ``tc``: an ``htb`` qdisc on the node's veth
with one class per peer node (a ``u32`` filter on the destination address),
each class's leaf a ``tbf`` at the rate of that node pair (``rate_mbit``, or
``pair_rate_mbit`` for a pair set apart): traffic from node i to node j is
paced at rate(i, j) by tbf.

Names carry a fixed prefix and the creating process's id
(``ctmn<pid>x<serial>``): ``cleanup_stale`` deletes every namespace (and its
``/etc/netns`` hosts file, and the processes left in it) whose creator is gone,
so that a test killed with SIGKILL leaves nothing behind for long.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from calibrate.outputs import pid_alive

PREFIX = "ctmn"
NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
SUBNET = "10.251.0"
MTU = 9000
LATENCY = "100ms"  # tbf's queue, in time at the rate  # private, and only inside this cluster's namespaces
_serial = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _tc(ns: str, *args: str) -> None:
    r = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {r.stderr.strip()}")


def _burst(mbit: float) -> int:
    """tbf's bucket: 1 ms at the rate, at least one 64 KB GSO packet (tbf drops a packet bigger than it)."""
    return max(65536 + MTU, int(mbit * 1e6 / 8 / 1000))


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN): run the test as root"
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            return f"{tool} is not installed: apt-get install iproute2 util-linux"
    probe = f"{PREFIX}{os.getpid()}probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace ({r.stderr.strip()}): run as root outside a restricted container"
    try:
        r = _ip("-n", probe, "link", "add", "b0", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"cannot create a bridge in a namespace ({r.stderr.strip()})"
        r = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return f"cannot create a UTS namespace ({r.stderr.strip()})"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def kill_namespace(ns: str) -> None:
    """SIGKILL the processes left in namespace ``ns`` (every one was started into it by a cluster)."""
    r = _ip("netns", "pids", ns, check=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete(ns: str) -> None:
    kill_namespace(ns)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)


def cleanup_stale() -> list[str]:
    """Delete the namespaces of clusters whose creating process is gone; their names."""
    names = set()
    for d in (NETNS_DIR, ETC_NETNS):
        if d.is_dir():
            names |= {p.name for p in d.iterdir() if p.name.startswith(PREFIX)}
    stale = []
    for name in sorted(names):
        m = re.match(rf"{PREFIX}(\d+)x", name)
        if m and not pid_alive(int(m.group(1))):
            _delete(name)
            stale.append(name)
    return stale


@dataclass
class NetnsCluster:
    """``nodes`` namespaces on a shaped bridge; ``enter(i)`` is the argv prefix that runs a command on node i."""

    nodes: int
    rate_mbit: float
    pair_rate_mbit: dict[tuple[int, int], float] = field(default_factory=dict)
    name: str = ""
    up: bool = False

    def __post_init__(self):
        if not 2 <= self.nodes <= 16:
            raise ValueError(f"nodes={self.nodes}: a test cluster has 2 to 16 nodes")
        self.name = self.name or f"{PREFIX}{os.getpid()}x{next(_serial)}"

    # ---- names -------------------------------------------------------------------------
    @property
    def switch(self) -> str:
        return f"{self.name}sw"

    def ns(self, i: int) -> str:
        return f"{self.name}n{i}"

    def hostname(self, i: int) -> str:
        return f"node{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def rate(self, i: int, j: int) -> float:
        """Mbit/s from node i to node j."""
        return self.pair_rate_mbit.get((min(i, j), max(i, j)), self.rate_mbit)

    def enter(self, i: int) -> list[str]:
        """argv prefix: run the rest in node i's network namespace, under its hostname (a fresh UTS
        namespace) with its /etc/hosts (a private mount namespace; /sys and cgroups stay the machine's)."""
        hosts = ETC_NETNS / self.ns(i) / "hosts"
        return ["nsenter", f"--net={NETNS_DIR / self.ns(i)}", "unshare", "--uts", "--mount", "sh", "-c",
                f'mount --bind {hosts} /etc/hosts && hostname {self.hostname(i)} && exec "$@"', self.hostname(i)]

    # ---- life --------------------------------------------------------------------------
    def start(self) -> "NetnsCluster":
        cleanup_stale()
        try:
            self._build()
        except Exception:
            self.stop()
            raise
        self.up = True
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.addr(i)} {self.hostname(i)}\n" for i in range(self.nodes))
        for i in range(self.nodes):
            ns = self.ns(i)
            _ip("netns", "add", ns)
            # node names resolve inside the nodes (enter binds it over /etc/hosts, as ip netns exec does)
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / ns / "hosts").write_text(hosts)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            # jumbo frames as in a data centre: TCP/IP headers take 0.7% of what tbf counts (4.4% at 1500)
            _ip("-n", self.switch, "link", "set", f"p{i}", "mtu", str(MTU), "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "mtu", str(MTU), "up")
            # a lost segment is sent again after 5 ms, not Linux's 200 ms minimum: a data centre's RTO,
            # for a link whose round trip is well under a millisecond when its queue is empty
            _ip("-n", ns, "route", "replace", f"{SUBNET}.0/24", "dev", "eth0", "rto_min", "5ms")
            self._shape(i)
        self._wait_reachable()

    def _shape(self, i: int) -> None:
        """htb on node i's uplink: class 1:(k+2) for the k-th peer (a u32 filter on its address), 1:1 for
        anything else (ARP); each class's leaf is a tbf at the pair's rate, the htb classes themselves are
        far above every rate and never limit."""
        ns, peers = self.ns(i), [j for j in range(self.nodes) if j != i]
        _tc(ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
        for cls, j in [(1, None)] + [(k + 2, j) for k, j in enumerate(peers)]:
            mbit = self.rate_mbit if j is None else self.rate(i, j)
            _tc(ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", f"1:{cls}", "htb",
                "rate", "100gbit", "quantum", "65536")
            _tc(ns, "qdisc", "add", "dev", "eth0", "parent", f"1:{cls}", "handle", f"{cls + 10}:", "tbf",
                "rate", f"{mbit}mbit", "burst", str(_burst(mbit)), "latency", LATENCY)
            if j is not None:
                _tc(ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "2", "u32",
                    "match", "ip", "dst", f"{self.addr(j)}/32", "flowid", f"1:{cls}")
        # TCP's bare ACKs (IP header of 5 words, under 64 bytes, flags ACK only) take class 1:1, beside the
        # data: behind a queue of data they would stretch the round trip of the flow coming the other way
        # (two nodes exchanging at once each reached half the rate)
        _tc(ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f", "at", "0",
            "match", "u16", "0x0000", "0xffc0", "at", "2", "match", "u8", "0x10", "0xff", "at", "33",
            "flowid", "1:1")

    def set_rates(self, rate_mbit: float, pair_rate_mbit: dict[tuple[int, int], float] | None = None) -> None:
        """Reshape every link of the running cluster (tc change of each tbf)."""
        self.rate_mbit, self.pair_rate_mbit = rate_mbit, dict(pair_rate_mbit or {})
        for i in range(self.nodes):
            peers = [j for j in range(self.nodes) if j != i]
            for cls, j in [(1, None)] + [(k + 2, j) for k, j in enumerate(peers)]:
                mbit = self.rate_mbit if j is None else self.rate(i, j)
                _tc(self.ns(i), "qdisc", "change", "dev", "eth0", "parent", f"1:{cls}", "handle", f"{cls + 10}:",
                    "tbf", "rate", f"{mbit}mbit", "burst", str(_burst(mbit)), "latency", LATENCY)

    def _wait_reachable(self, timeout: float = 20.0) -> None:
        """Until node0 reaches every other node: a TCP connect to a closed port is refused once it does."""
        probe = ("import socket, sys\n"
                 "try:\n socket.create_connection((sys.argv[1], 9), 1)\n"
                 "except ConnectionRefusedError:\n sys.exit(0)\n"
                 "except OSError as e:\n sys.exit(str(e))\n")
        deadline = time.monotonic() + timeout
        for j in range(1, self.nodes):
            while True:
                r = subprocess.run(["ip", "netns", "exec", self.ns(0), sys.executable, "-c", probe, self.addr(j)],
                                   capture_output=True, text=True, timeout=30)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node{j} ({self.addr(j)}) unreachable from node0: {r.stderr.strip()}")
                time.sleep(0.2)

    def stop(self) -> None:
        """Kill what runs in the nodes, delete the namespaces (their veths go with them)."""
        for i in range(self.nodes):
            _delete(self.ns(i))
        _delete(self.switch)
        self.up = False

    def __enter__(self) -> "NetnsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
