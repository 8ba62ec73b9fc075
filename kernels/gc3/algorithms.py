"""The algorithm library: parameterised GC3 DSL programs behind a registry.

``ALGORITHMS[name](ranks, channels, instances, protocol, nodes=...) -> GC3Program``.
``ranks`` is the total rank count; multi-node algorithms take ``nodes`` and use
ranks // nodes GPUs per node (rank = node * G + local index). The ring,
all-pairs, hierarchical, halving-doubling, allgather and reduce-scatter programs
use the DSL's vector form (one call per step for all chunks), so that tracing
costs O(steps) Python calls, not O(ops).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from calibrate.errors import OptionError, UserError
from calibrate.run_limits import host_available_bytes
from kernels.gc3.dsl import CollectiveSpec, GC3Program
from kernels.gc3.ir import Buffer, Protocol

I, O, S = Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH


def _reduce_chain(prog: GC3Program, ranks: list, index, count: int = 1, ch=None):
    """Reduce input[index] along ``ranks``; the sum ends on the last one (ranks, index and ch may be arrays:
    one chain per element)."""
    c = prog.chunk(ranks[0], I, index, count)
    for r in ranks[1:]:
        c = prog.chunk(r, I, index, count).reduce(c, ch=ch)
    return c


def _copy_chain(c, ranks: list, buf: Buffer, index, ch=None):
    for r in ranks:
        c = c.copy(r, buf, index, ch=ch)
    return c


def _check(ranks: int, channels: int, nodes: int = 1) -> int:
    if ranks < 2:
        raise OptionError("ranks", f"must be >= 2, got {ranks}")
    if channels < 1:
        raise OptionError("channels", f"must be >= 1, got {channels}")
    if nodes < 1 or ranks % nodes:
        raise OptionError("ranks", f"{ranks} is not a multiple of {{nodes}} {nodes}")
    return ranks // nodes


def ring_allreduce(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=1) -> GC3Program:
    """Ring allreduce with ``channels`` rings (one chunk per rank per ring), in place; traced a ring step
    at a time for all chunks (chunk r ends on rank r)."""
    _check(ranks, channels)
    prog = GC3Program(f"allreduce_ring_{channels}ch", CollectiveSpec("allreduce", ranks, ranks * channels, True),
                      protocol, instances)
    r = np.arange(ranks)
    for ch in range(channels):
        index = ch * ranks + r
        order = [(r + 1 + k) % ranks for k in range(ranks)]  # ends on r
        c = _reduce_chain(prog, order, index, ch=ch)
        _copy_chain(c, order[:-1], I, index, ch=ch)
    return prog


def allpairs_allreduce(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=1) -> GC3Program:
    """All-pairs allreduce: rank r gathers and sums chunk r in scratch, then sends it to everyone (the k-th
    other rank of r is k, or k + 1 from r on). The gather and the broadcast are traced in one call each (all
    k, then all r: the ops are those of one call per k); the sums, which all write chunk r of rank r, one
    call per k for all ranks."""
    _check(ranks, channels)
    prog = GC3Program("allreduce_allpairs", CollectiveSpec("allreduce", ranks, ranks, True), protocol, instances)
    r = np.arange(ranks)
    k = np.repeat(np.arange(ranks - 1), ranks)     # every (k, r), k-major
    rk = np.tile(r, ranks - 1)
    q = np.where(k < rk, k, k + 1)                 # the k-th other rank of r
    prog.chunk(q, I, rk).copy(rk, S, k, ch=k % channels)
    for j in range(ranks - 1):
        prog.chunk(r, I, r).reduce(prog.chunk(r, S, j))
    prog.chunk(rk, I, rk).copy(q, I, rk, ch=k % channels)
    return prog


def hierarchical_allreduce(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=2) -> GC3Program:
    """Intra-node ring reduce-scatter, inter-node ring allreduce per local index, intra-node allgather;
    traced for all chunks (and nodes) at once."""
    g = _check(ranks, channels, nodes)
    if nodes < 2 or g < 2:
        raise OptionError("nodes", ">= 2 and >= 2 GPUs per node are what the hierarchical allreduce needs")
    prog = GC3Program("hierarchical_allreduce", CollectiveSpec("allreduce", ranks, ranks, True), protocol, instances)
    # chunk `index` uses channel index // g within nodes and nodes + index // g across them: different
    # directives keep the compiler from fusing across phases, and each ring then carries one chunk per
    # GPU, so no thread block sends twice on a connection before it receives (one FIFO slot suffices)
    index = np.arange(ranks)
    owner, home = index % g, (index // g) % nodes
    # every (chunk, node) pair, chunk by chunk
    e_index, e_node = np.repeat(index, nodes), np.tile(np.arange(nodes), ranks)
    e_owner = e_index % g
    # 1. on every node, reduce chunk `index` onto local GPU `owner`
    _reduce_chain(prog, [e_node * g + (e_owner + 1 + k) % g for k in range(g)], e_index, ch=e_index // g)
    # 2. across nodes, reduce onto node `home`, then broadcast back (GPUs with local index `owner`)
    across = [((home + 1 + k) % nodes) * g + owner for k in range(nodes)]
    c = _reduce_chain(prog, across, index, ch=nodes + index // g)
    _copy_chain(c, across[:-1], I, index, ch=nodes + index // g)
    # 3. on every node, broadcast from `owner` to the other GPUs
    src = prog.chunk(e_node * g + e_owner, I, e_index)
    _copy_chain(src, [e_node * g + (e_owner + 1 + k) % g for k in range(g - 1)], I, e_index, ch=e_index // g)
    return prog


def rdh_allreduce(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=1) -> GC3Program:
    """Recursive halving reduce-scatter then recursive doubling allgather (ranks a power of 2); each round
    traced for all ranks at once."""
    _check(ranks, channels)
    if ranks & (ranks - 1):
        raise OptionError("ranks", f"{ranks}: recursive halving-doubling needs a power-of-2 count")
    prog = GC3Program("allreduce_recursive_doubling_halving", CollectiveSpec("allreduce", ranks, ranks, True),
                      protocol, instances)
    r = np.arange(ranks)
    d = ranks // 2
    while d >= 1:
        p = r ^ d
        keep_p = (r // (2 * d)) * 2 * d + (p & d)  # the half the partner keeps
        prog.chunk(p, I, keep_p, d).reduce(prog.chunk(r, I, keep_p, d))
        d //= 2
    d = 1
    while d < ranks:
        lo = (r // d) * d
        prog.chunk(r, I, lo, d).copy(r ^ d, I, lo)
        d *= 2
    return prog


def ring_allgather(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=1) -> GC3Program:
    """Ring allgather, in place, with ``channels`` rings each moving 1/channels of every input."""
    _check(ranks, channels)
    prog = GC3Program(f"allgather_ring_{channels}ch", CollectiveSpec("allgather", ranks, ranks * channels, True),
                      protocol, instances)
    r = np.arange(ranks)
    for ch in range(channels):
        c = prog.chunk(r, I, ch)
        _copy_chain(c, [(r + 1 + k) % ranks for k in range(ranks - 1)], O, r * channels + ch, ch=ch)
    return prog


def ring_reducescatter(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=1) -> GC3Program:
    """Ring reduce-scatter, in place: chunk r is summed along the ring and ends on rank r."""
    _check(ranks, channels)
    prog = GC3Program(f"reducescatter_ring_{channels}ch",
                      CollectiveSpec("reducescatter", ranks, ranks * channels, True), protocol, instances)
    r = np.arange(ranks)
    for ch in range(channels):
        _reduce_chain(prog, [(r + 1 + k) % ranks for k in range(ranks)], r * channels + ch, ch=ch)
    return prog


def twostep_alltoall(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=2) -> GC3Program:
    """Two-step alltoall: gather what goes to GPU h of another node on local GPU h, then one send per node."""
    g = _check(ranks, channels, nodes)
    prog = GC3Program("alltoall_twostep", CollectiveSpec("alltoall", ranks, ranks), protocol, instances)
    for n in range(nodes):
        for a in range(g):
            src = n * g + a
            for b in range(g):
                prog.chunk(src, I, n * g + b).copy(n * g + b, O, src)  # same node: direct
                for m in range(nodes):
                    if m != n:
                        prog.chunk(src, I, m * g + b).copy(n * g + b, S, m * g + a)
    for n in range(nodes):
        for b in range(g):
            for k, m in enumerate(x for x in range(nodes) if x != n):
                prog.chunk(n * g + b, S, m * g, g).copy(m * g + b, O, n * g, ch=k % channels)
    return prog


def alltonext(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=2) -> GC3Program:
    """AllToNext: rank r's buffer (G chunks) goes to rank r+1; across nodes it is spread over all G links."""
    g = _check(ranks, channels, nodes)
    pre = {(r, I, k): frozenset({(r, k)}) for r in range(ranks) for k in range(g)}
    post = {(r, O, k): frozenset({(r - 1, k)}) for r in range(1, ranks) for k in range(g)}
    spec = CollectiveSpec("custom", ranks, g, True, pre, post, "alltonext",
                          input_sizes=[g] * ranks, output_sizes=[0] + [g] * (ranks - 1))
    prog = GC3Program("alltonext", spec, protocol, instances)
    for r in range(ranks - 1):
        n, nxt = r // g, r + 1
        if nxt // g == n:
            prog.chunk(r, I, 0, g).copy(nxt, O, 0, ch=0)
            continue
        for j in range(g):
            c = prog.chunk(r, I, j)
            out_fwd, in_fwd = n * g + j, (n + 1) * g + j
            if out_fwd != r:
                c = c.copy(out_fwd, S, 0, ch=j % channels)   # scratch 0: outgoing
            c = c.copy(in_fwd, S, 1, ch=j % channels)         # scratch 1: incoming
            c.copy(nxt, O, j, ch=j % channels)
    return prog


def _others(ranks: int):
    """Every (k, r) pair, k-major, and q, the k-th other rank of r (k, or k + 1 from r on)."""
    r = np.arange(ranks)
    k = np.repeat(np.arange(ranks - 1), ranks)
    rk = np.tile(r, ranks - 1)
    return r, k, rk, np.where(k < rk, k, k + 1)


def direct_allreduce(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=1) -> GC3Program:
    """One-shot allreduce, out of place: every rank copies its input to its output, then adds every
    other rank's whole input, received directly (one hop; n - 1 receives reduce into the output)."""
    _check(ranks, channels)
    prog = GC3Program("allreduce_direct", CollectiveSpec("allreduce", ranks, 1, False), protocol, instances)
    r, k, rk, q = _others(ranks)
    prog.chunk(r, I, 0).copy(r, O, 0)
    for j in range(ranks - 1):
        sel = k == j
        prog.chunk(rk[sel], O, 0).reduce(prog.chunk(q[sel], I, 0), ch=j % channels)
    return prog


def direct_allgather(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=1) -> GC3Program:
    """One-shot allgather, out of place: every rank copies its input into its own output chunk and sends
    it straight to every other rank's."""
    _check(ranks, channels)
    prog = GC3Program("allgather_direct", CollectiveSpec("allgather", ranks, ranks, False), protocol, instances)
    r, k, rk, q = _others(ranks)
    prog.chunk(r, I, 0).copy(r, O, r)
    prog.chunk(rk, I, 0).copy(q, O, rk, ch=k % channels)
    return prog


def direct_reducescatter(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=1) -> GC3Program:
    """One-shot reduce-scatter, out of place: rank r copies its input chunk r to its output, then adds
    chunk r of every other rank's input, received directly."""
    _check(ranks, channels)
    prog = GC3Program("reducescatter_direct", CollectiveSpec("reducescatter", ranks, ranks, False), protocol,
                      instances)
    r, k, rk, q = _others(ranks)
    prog.chunk(r, I, r).copy(r, O, 0)
    for j in range(ranks - 1):
        sel = k == j
        prog.chunk(rk[sel], O, 0).reduce(prog.chunk(q[sel], I, rk[sel]), ch=j % channels)
    return prog


def oneshot_allreduce(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=1) -> GC3Program:
    """One-shot allreduce through scratch, out of place: every rank sends its whole input to a scratch
    chunk of every other rank (n - 1 receives that wait on nothing, as the all-gather's), then adds
    them to its own input locally. ``direct_allreduce`` reduces each receive into the output in turn,
    so its n - 1 receives wait on one another (a chain of thread blocks)."""
    _check(ranks, channels)
    prog = GC3Program("allreduce_oneshot", CollectiveSpec("allreduce", ranks, 1, False), protocol, instances)
    r, k, rk, q = _others(ranks)
    prog.chunk(rk, I, 0).copy(q, S, rk - (rk > q), ch=k % channels)
    prog.chunk(r, I, 0).copy(r, O, 0)
    for j in range(ranks - 1):
        prog.chunk(r, O, 0).reduce(prog.chunk(r, S, j))
    return prog


def oneshot_reducescatter(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=1) -> GC3Program:
    """One-shot reduce-scatter through scratch, out of place: chunk q of every rank's input goes to a
    scratch chunk of rank q (receives that wait on nothing), which adds them to its own chunk q locally
    (``direct_reducescatter`` chains its receive-reduces, as ``direct_allreduce`` does)."""
    _check(ranks, channels)
    prog = GC3Program("reducescatter_oneshot", CollectiveSpec("reducescatter", ranks, ranks, False), protocol,
                      instances)
    r, k, rk, q = _others(ranks)
    prog.chunk(rk, I, q).copy(q, S, rk - (rk > q), ch=k % channels)
    prog.chunk(r, I, r).copy(r, O, 0)
    for j in range(ranks - 1):
        prog.chunk(r, O, 0).reduce(prog.chunk(r, S, j))
    return prog


def direct_alltoall(ranks, channels=1, instances=1, protocol=Protocol.SIMPLE, nodes=1) -> GC3Program:
    """One-shot alltoall, out of place: chunk q of rank r goes straight to chunk r of rank q."""
    _check(ranks, channels)
    prog = GC3Program("alltoall_direct", CollectiveSpec("alltoall", ranks, ranks, False), protocol, instances)
    r, k, rk, q = _others(ranks)
    prog.chunk(r, I, r).copy(r, O, r)
    prog.chunk(rk, I, q).copy(q, O, rk, ch=k % channels)
    return prog


AlgorithmFn = Callable[..., GC3Program]

ALGORITHMS: dict[str, AlgorithmFn] = {
    "ring_allreduce": ring_allreduce,
    "allpairs_allreduce": allpairs_allreduce,
    "hierarchical_allreduce": hierarchical_allreduce,
    "rdh_allreduce": rdh_allreduce,
    "ring_allgather": ring_allgather,
    "ring_reducescatter": ring_reducescatter,
    "twostep_alltoall": twostep_alltoall,
    "alltonext": alltonext,
    "direct_allreduce": direct_allreduce,
    "direct_allgather": direct_allgather,
    "direct_reducescatter": direct_reducescatter,
    "direct_alltoall": direct_alltoall,
    "oneshot_allreduce": oneshot_allreduce,
    "oneshot_reducescatter": oneshot_reducescatter,
}


# traced ops of each algorithm (before the compiler splits them over instances), as closed forms
OP_COUNTS: dict[str, Callable[[int, int, int], int]] = {   # (ranks, channels, nodes) -> ops
    "ring_allreduce": lambda r, c, n: c * r * 2 * (r - 1),
    "allpairs_allreduce": lambda r, c, n: 3 * r * (r - 1),
    "hierarchical_allreduce": lambda r, c, n: r * (2 * r - 2),
    "rdh_allreduce": lambda r, c, n: 2 * r * max(1, r.bit_length() - 1),
    "ring_allgather": lambda r, c, n: c * r * (r - 1),
    "ring_reducescatter": lambda r, c, n: c * r * (r - 1),
    "twostep_alltoall": lambda r, c, n: r * r + r * (n - 1),
    "alltonext": lambda r, c, n: 3 * r * max(1, r // max(n, 1)),
    "direct_allreduce": lambda r, c, n: r * r,
    "direct_allgather": lambda r, c, n: r * r,
    "direct_reducescatter": lambda r, c, n: r * r,
    "direct_alltoall": lambda r, c, n: r * r,
    "oneshot_allreduce": lambda r, c, n: 2 * r * r - r,
    "oneshot_reducescatter": lambda r, c, n: 2 * r * r - r,
}
# peak memory of tracing, compiling and verifying: BYTES_PER_OP + ranks / 16 bytes per traced op (the
# symbolic state of a slot is R / 8 bytes, and a rank holds about R / 2 slots per op it takes part in)
# plus the interpreter's own; 10 to 25% over the peaks measured for the ring and all-pairs programs at
# 512 to 2048 ranks (reports/records/gc3.md, "Scale")
BYTES_PER_OP = 640
BASE_BYTES = 100 << 20
DEFAULT_MAX_MEMORY_GIB = 8.0


def predicted_bytes(name: str, ranks: int, channels: int = 1, instances: int = 1, nodes: int = 1) -> int:
    """Predicted peak memory of compiling and verifying ``name`` with these settings."""
    ops = OP_COUNTS[name](ranks, channels, nodes) * instances
    return BASE_BYTES + ops * (BYTES_PER_OP + ranks // 16)


def check_size(name: str, ranks: int, channels: int = 1, instances: int = 1, nodes: int = 1,
               max_memory_gib: float = DEFAULT_MAX_MEMORY_GIB, available: int | None = None) -> int:
    """The ops the compiler would handle (traced ops x instances); raise ``UserError`` before any work if
    its predicted memory is over ``max_memory_gib`` or over ``available`` bytes (default: what this machine
    has available)."""
    if name not in ALGORITHMS:
        raise UserError(f"unknown algorithm {name!r}; choose one of {', '.join(sorted(ALGORITHMS))}")
    _check(ranks, channels, nodes)
    if instances < 1:
        raise OptionError("instances", f"must be >= 1, got {instances}")
    if not max_memory_gib > 0:
        raise OptionError("max_memory", f"must be > 0 GiB, got {max_memory_gib}")
    ops = OP_COUNTS[name](ranks, channels, nodes) * instances
    avail = host_available_bytes() if available is None else available
    limit = int(max_memory_gib * 2**30) if avail is None else min(int(max_memory_gib * 2**30), avail)
    why = "{max_memory}" if avail is None or limit < avail else "the memory this machine has available"
    need = predicted_bytes(name, ranks, channels, instances, nodes)
    if need > limit:
        lo, hi = 2, ranks  # the most ranks within the limit (same nodes per rank), by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if predicted_bytes(name, mid, channels, instances, max(1, nodes * mid // ranks)) <= limit:
                lo = mid
            else:
                hi = mid - 1
        raise OptionError("ranks", f"{ranks}: {name} on {ranks} ranks ({channels} channel(s), {instances} "
                                   f"instance(s)) means about {ops:,} ops and {need / 2**30:.1f} GiB of memory, over "
                                   f"the compiler's limit of {limit / 2**30:.1f} GiB ({why}; about {lo} ranks fit "
                                   f"with these settings); use fewer ranks, channels or instances, or a larger "
                                   f"{{max_memory}} if the machine has it")
    return ops


def build(name: str, ranks: int, channels: int = 1, instances: int = 1, protocol: Protocol | str = Protocol.SIMPLE,
          nodes: int = 1) -> GC3Program:
    if name not in ALGORITHMS:
        raise UserError(f"unknown algorithm {name!r}; choose one of {', '.join(sorted(ALGORITHMS))}")
    try:
        protocol = Protocol(protocol)
    except ValueError:
        raise UserError(f"unknown protocol {protocol!r}; choose one of Simple, LL, LL128") from None
    return ALGORITHMS[name](ranks, channels, instances, protocol, nodes=nodes)
