"""Cost simulation: predict an IR's time from an alpha-beta profile, to rank schedules before measuring.

Model (derived from first principles, not from a formula of the papers):
- ``nbytes`` is nccl-tests' size of the collective (the output for allgather,
  the input otherwise); a chunk is nbytes / nchunksperloop bytes.
- Tiling: like the MSCCL runtime, the program runs once per tile; a tile moves
  at most ``TILE_CHUNK_BYTES[protocol]`` bytes per chunk (about the connection
  buffer of the protocol), so ntiles = ceil(chunk bytes / that).
- Each thread block runs its steps in order, tile after tile (pipelining over
  tiles comes from different thread blocks working on different tiles).
- A message of b bytes from rank a to rank c costs alpha + b * beta / eff,
  where alpha and beta are the profile's ``sendrecv`` fit on the intra tier if a
  and c are on the same node (``gpus_per_node``), else the inter tier, and eff
  is the protocol's payload efficiency (``PROTOCOL_EFFICIENCY``: LL sends a
  flag with every 8 bytes of data, LL128 with every 120 of 128). Its b * beta
  part occupies the directed link (a, c): thread blocks on different channels
  sharing a link share its bandwidth (they serialise on it).
- A receiving step ends when its message has arrived; a step that also sends
  then sends the result (store and forward within a tile). ``cpy`` and ``re``
  cost b * beta_local with beta_local = ``LOCAL_BETA_FRACTION`` of the intra beta.
- Simulating more than ``MAX_SIMULATED_TILES`` tiles is replaced by the
  steady-state extrapolation T(n) = T(m) + (n - m) * (T(m) - T(m/2)) / (m/2).
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict

from calibrate.collectives import Collective
from calibrate.errors import UserError
from calibrate.profile import Group, Profile
from kernels.gc3.ir import Program, Protocol, StepType

TILE_CHUNK_BYTES = {Protocol.SIMPLE: 512 * 1024, Protocol.LL128: 256 * 1024, Protocol.LL: 64 * 1024}
PROTOCOL_EFFICIENCY = {Protocol.SIMPLE: 1.0, Protocol.LL128: 120 / 128, Protocol.LL: 0.5}
LOCAL_BETA_FRACTION = 0.25
MAX_SIMULATED_TILES = 16


def _link_params(profile: Profile, a: int, c: int, gpus_per_node: int, nbytes: float) -> tuple[float, float]:
    nodes = 1 if a // gpus_per_node == c // gpus_per_node else 2
    model, _ = profile.model(Collective.SENDRECV, Group(2, nodes))
    seg = model.segment_for(nbytes)
    return seg.alpha, seg.beta


def message_partners(program: Program) -> dict[tuple[int, int, int], tuple[int, int, int]]:
    """Each receiving step (gpu, tb, step) mapped to its matching sending step: the k-th send on a
    connection (sender, receiver, channel) meets the k-th receive on it."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for g in program.gpus:
        for tb in g.threadblocks:
            for i, st in enumerate(tb.steps):
                if st.type.sends:
                    sends[(g.id, tb.send, tb.chan)].append((g.id, tb.id, i))
                if st.type.receives:
                    recvs[(tb.recv, g.id, tb.chan)].append((g.id, tb.id, i))
    return {r: snd for key, ss in sends.items() for snd, r in zip(ss, recvs.get(key, []))}


def _simulate_tiles(program: Program, ntiles: int, tile_chunk: float, profile: Profile, gpus_per_node: int) -> float:
    eff = PROTOCOL_EFFICIENCY[program.protocol]
    partner = message_partners(program)
    intra_alpha, intra_beta = _link_params(profile, 0, 0, gpus_per_node, tile_chunk)
    tbs = {(g.id, tb.id): tb for g in program.gpus for tb in g.threadblocks}
    # node: (tile, rank, tb, step); predecessors and successors
    preds: dict[tuple, list[tuple]] = {}
    succ: dict[tuple, list[tuple]] = defaultdict(list)
    for t in range(ntiles):
        for (r, tid), tb in tbs.items():
            for i, st in enumerate(tb.steps):
                n = (t, r, tid, i)
                p = []
                if i > 0:
                    p.append((t, r, tid, i - 1))
                elif t > 0 and tb.steps:
                    p.append((t - 1, r, tid, len(tb.steps) - 1))
                p += [(t, r, d[0], d[1]) for d in st.deps]
                if st.type.receives:
                    if (r, tid, i) not in partner:
                        raise UserError(f"gpu {r} tb {tid} step {i} has no matching send; run kernels check first")
                    p.append((t, *partner[(r, tid, i)]))
                preds[n] = p
                for q in p:
                    succ[q].append(n)
    finish: dict[tuple, float] = {}
    depart: dict[tuple, float] = {}   # when a sending step's message has arrived at its peer
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    missing = {n: len(p) for n, p in preds.items()}
    ready = [(0.0, n) for n, k in missing.items() if k == 0]
    heapq.heapify(ready)
    while ready:
        t0, n = heapq.heappop(ready)
        _, r, tid, i = n
        tb = tbs[(r, tid)]
        st = tb.steps[i]
        b = st.cnt * tile_chunk
        now = t0
        if st.type.receives:
            now = max(now, depart[(n[0], *partner[(r, tid, i)])])
        if st.type in (StepType.COPY, StepType.REDUCE) or st.type.reduces:
            now += b * intra_beta * LOCAL_BETA_FRACTION
        if st.type.sends:
            alpha, beta = _link_params(profile, r, tb.send, gpus_per_node, b)
            link = (r, tb.send)
            start = max(now, link_free[link])
            link_free[link] = start + b * beta / eff
            depart[n] = link_free[link] + alpha
            now = link_free[link]
        finish[n] = now
        for s in succ[n]:
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(ready, (max(finish[q] for q in preds[s]), s))
    if len(finish) != len(preds):
        raise UserError("the program cannot run to completion (a dependency cycle); run kernels check on it")
    return max(max(finish.values(), default=0.0), max(depart.values(), default=0.0))


def simulate(program: Program, nbytes: float, profile: Profile, gpus_per_node: int) -> float:
    """Predicted seconds for ``program`` moving a collective of ``nbytes`` with ``profile``."""
    if nbytes <= 0:
        raise UserError(f"message size must be > 0 bytes, got {nbytes}")
    if gpus_per_node < 1:
        raise UserError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    chunk = nbytes / program.nchunksperloop
    ntiles = max(1, math.ceil(chunk / TILE_CHUNK_BYTES[program.protocol]))
    tile_chunk = chunk / ntiles
    if ntiles <= MAX_SIMULATED_TILES:
        return _simulate_tiles(program, ntiles, tile_chunk, profile, gpus_per_node)
    m = MAX_SIMULATED_TILES
    full = _simulate_tiles(program, m, tile_chunk, profile, gpus_per_node)
    half = _simulate_tiles(program, m // 2, tile_chunk, profile, gpus_per_node)
    return full + (ntiles - m) * (full - half) / (m // 2)
