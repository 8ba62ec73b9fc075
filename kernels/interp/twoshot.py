"""The two-shot allreduce as GC3 IR for any number of ranks (out of place): a
reduce-scatter then an allgather, each rank owning chunk r of n.

Rank r, for every other rank q (in order q_0, q_1, .., the last one l):
  S_q  sends input[q] to q;
  R_q  receives q's input[r] and reduces it into output[r] (the first with input[r]
       as the other operand, each later one after the previous, a dependency); R_l
       also sends the finished output[r] to l (rrcs);
  B_q  sends output[r] to every other q, after the last reduction;
  G_q  receives q's finished chunk into output[q].
A thread block has one channel for both its ends, and one thread block per
(peer, channel, direction): the chunk a sends to b in the first phase travels on
channel chan(a, b) = 0 if a < b else 1, the second phase on the other channel.
Per direction this moves (n-1)/n of the buffer twice (one-shot: all of it once), and
the reduction of each rank is 1/n of the buffer: on 2 ranks the same bytes as the
one-shot program, half the reduction work per rank, one hop more.
``python -m kernels check`` and the reference executor verify it (tests, n = 2, 4, 8).
"""
from __future__ import annotations

from calibrate.errors import UserError
from kernels.gc3.ir import Buffer, Gpu, Program, Protocol, Step, StepType, ThreadBlock

I, O = Buffer.INPUT, Buffer.OUTPUT


def twoshot_allreduce(nranks: int, protocol: Protocol = Protocol.SIMPLE) -> Program:
    if nranks < 2:
        raise UserError(f"a two-shot allreduce needs at least 2 ranks, got {nranks}")
    prog = Program(f"twoshot_allreduce_{nranks}r", "allreduce", nranks, nranks, 2, protocol, inplace=False)
    for r in range(nranks):
        others = [(r + 1 + k) % nranks for k in range(nranks - 1)]
        last = others[-1]
        tbs: list[ThreadBlock] = []

        def add(send: int, recv: int, chan: int, step: Step) -> int:
            tbs.append(ThreadBlock(len(tbs), send, recv, chan, [step]))
            return len(tbs) - 1

        for q in others:
            add(q, -1, chan(r, q), Step(0, StepType.SEND, I, q, O, q, 1))
        prev = -1
        for q in others:
            kind = StepType.RECV_REDUCE_COPY_SEND if q == last else StepType.RECV_REDUCE_COPY
            src = I if prev < 0 else O
            deps = [(prev, 0)] if prev >= 0 else []
            tb = add(last if q == last else -1, q, chan(q, r), Step(0, kind, src, r, O, r, 1, deps=deps))
            if prev >= 0:
                tbs[prev].steps[0].has_dep = True
            prev = tb
        for q in others[:-1]:
            tbs[prev].steps[0].has_dep = True
            add(q, -1, chan(q, r), Step(0, StepType.SEND, O, r, O, r, 1, deps=[(prev, 0)]))
        for q in others:
            add(-1, q, chan(r, q), Step(0, StepType.RECV, O, q, O, q, 1))
        prog.gpus.append(Gpu(r, nranks, nranks, 0, tbs))
    return prog


def chan(a: int, b: int) -> int:
    """The channel of the first phase's chunk from rank a to rank b."""
    return 0 if a < b else 1
