"""``python -m kernels peers``: the interpreter against the strongest peers, under
``mpirun -np N`` (one process per GPU).

One timer for all, the measurement engine (``calibrate.measure.engine``): each peer
an arm, its calls captured in a CUDA graph of N calls, replays of all peers
interleaved, CUDA events, median, max over ranks; before timing and again after
the timed replays, every peer's result is checked on fresh random data against
the sum computed locally from every rank's input (no library in the reference).
A target judged over the peers is unknown when a peer did not run.

    mpirun -np 2 python -m kernels peers --out peers.json             # interp, nccl, nccl-symm, torch-*
    NCCL_MIN_NCHANNELS=64 NCCL_MAX_NCHANNELS=64 NCCL_PROTO=LL128 \\
      mpirun -np 2 python -m kernels peers --peers nccl --label ch64/LL128 --out nccl_ch64_LL128.json
    python -m kernels peers --merge peers.json nccl_*.json --out merged.json   # table, best peer, ratio
    python -m kernels peers --nccl-settings      # the environment sweep, one line per setting
    python -m kernels peers --declare heldout.json   # before the sweep: held-out sizes (no GPU)
    mpirun -np 2 python -m kernels peers --heldout heldout.json --peers interp,nccl --candidates h200x2 \
      --preset retuned.json --out evaluate.json      # the chosen preset against the base one and NCCL

A preset chosen from a sweep (``--retune``) is confirmed by ``--heldout``: in a fresh
process, at sizes declared before the sweep (``--declare``: off its grid, hashed), the
chosen preset (``interp``) against the base one (``interp[BASE]``) and NCCL, medians;
its record's ``basis`` is ``evaluation`` (the figures to quote).

NCCL reads its channel limits once per process, so each setting of the sweep is
its own process and communicator (the GPU script runs them); ``--merge`` takes
NCCL's best setting per size from them. The record is rewritten after every size.
"""
from __future__ import annotations

import datetime as _dt
import sys
from pathlib import Path

from calibrate.cli import command_parser, finite_float
from calibrate.device.gpu import device_name, mpi_gpu
from calibrate.device.timing import time_graph
from calibrate.errors import UserError
from calibrate.measure.engine import Arm, MpiGroup, Options, Status, TimingMode, compare
from calibrate.records import header
from calibrate.sizes import parse_size, sweep
from calibrate.jsonfile import write_json

from kernels.interp import peer_table
from kernels.interp.bench import count_for, ncalls_for

DEFAULT_PEERS = ("interp", "nccl", "nccl-symm", "torch-oneshot", "torch-twoshot", "torch-rs", "torch-lowcontention")
TIMING = ("measurement engine: CUDA graph of N calls per peer (200 small, about 20 ms of work large), replays "
          "of all peers interleaved, CUDA events, median of replays, max over ranks; every peer checked on fresh "
          "random data before timing and after its timed replays")


def build_parser():
    p = command_parser("python -m kernels peers", __doc__.split("\n\n")[0])
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS), help="comma-separated peers to measure")
    p.add_argument("--label", default="",
                   help="name the nccl peer's rows nccl[LABEL] (the sweep's setting; none: nccl)")
    p.add_argument("--collectives", default="allreduce,allgather,reducescatter", help="comma-separated")
    p.add_argument("--min-bytes", type=parse_size, default=1 << 10, help="smallest size (whole buffer), e.g. 1K")
    p.add_argument("--max-bytes", type=parse_size, default=1 << 30, help="largest size, e.g. 1G")
    p.add_argument("--factor", type=int, default=4, help="size step factor")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="element type")
    p.add_argument("--reps", type=int, default=7, help="timed replays per peer (median taken)")
    p.add_argument("--preset", default="h200x2", help="the interpreter's preset (its tuned table)")
    p.add_argument("--candidates", default="", help="comma-separated candidate presets, each measured as peer "
                   "interp[PRESET] (a path the selection may take only once a GPU run has validated it)")
    p.add_argument("--out", default="", help="JSON record, rewritten after every size (none: not written)")
    p.add_argument("--merge", nargs="+", metavar="RECORD", help="merge records and print the peer table (no GPU)")
    p.add_argument("--nccl-settings", action="store_true", help="print the NCCL environment sweep, one per line")
    p.add_argument("--retune", metavar="RECORD", help="write the table --preset with the bands of RECORD's fastest "
                   "correct tables (the shipped one or a --candidates one) to --out (no GPU)")
    p.add_argument("--margin", type=finite_float, default=0.03, help="--retune: a candidate must be this much faster")
    p.add_argument("--declare", metavar="FILE", help="before the development sweep: draw --heldout-count sizes per "
                   "collective between --min-bytes and --max-bytes, off the sweep, and write them to FILE (no GPU)")
    p.add_argument("--heldout-count", type=int, default=4, help="--declare: sizes held out per collective")
    p.add_argument("--seed", type=int, default=0, help="--declare: the draw's seed")
    p.add_argument("--heldout", metavar="FILE", help="the confirmatory evaluation of a preset: measure only the sizes "
                   "FILE declares held out (the chosen --preset as interp, the base one as --candidates, nccl)")
    return p


HELDOUT_KIND, HELDOUT_VERSION = "commtune.interp-heldout", 1
HELDOUT_UNIT = 1024   # held-out sizes are whole KiB: every rank count and element size divides them


def declare_main(args, colls: list[str]) -> int:
    """Held-out sizes per collective off the sweep of ``args`` (``calibrate.measure.heldout``), written
    to ``args.declare`` with the command and commit."""
    from calibrate.measure import heldout, provenance

    sweep_sizes = sweep(args.min_bytes, args.max_bytes, args.factor)
    stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    dec = heldout.declare("interp presets", {c: sweep_sizes for c in colls}, args.min_bytes, args.max_bytes,
                          args.heldout_count, args.seed, HELDOUT_UNIT, stamp)
    write_json(args.declare, {**header(HELDOUT_KIND, HELDOUT_VERSION), "command": provenance.command(),
                              "commit": provenance.commit(), "heldout": dec.to_dict()}, "held-out declaration")
    for c, sizes in dec.evaluation.items():
        print(f"{c}: held out {', '.join(map(str, sizes))} B")
    print(f"declared in {args.declare} (sha256 {dec.sha256[:12]})")
    return 0


def heldout_sizes(path: str, colls: list[str]) -> tuple[dict, dict[str, list[int]]]:
    """(the declaration of ``path``, hash checked, as a dict; its evaluation sizes of each of ``colls``)."""
    from calibrate.measure import heldout
    from calibrate.records import load_record

    d = load_record(path, HELDOUT_KIND, HELDOUT_VERSION, "held-out declaration",
                    "write one with python -m kernels peers --declare FILE")
    dec = heldout.Declaration.from_dict(d.get("heldout"), repr(path)) if isinstance(d.get("heldout"), dict) else None
    if dec is None:
        raise UserError(f"{path!r} has no held-out declaration: write one with python -m kernels peers --declare FILE")
    missing = [c for c in colls if c not in dec.evaluation]
    if missing:
        raise UserError(f"{path!r} holds out no sizes of {', '.join(missing)}: pass --collectives "
                        f"{','.join(dec.evaluation)} or declare them")
    return dec.to_dict(), {c: dec.evaluation[c] for c in colls}


def record_header(device: str, nranks: int, dtype: str, preset: str) -> dict:
    return {**header(peer_table.RESULT_KIND, peer_table.RESULT_VERSION),
            "date": _dt.date.today().isoformat(), "device": device, "nranks": nranks, "dtype": dtype,
            "preset": preset, "timing": TIMING, "peers": {}, "rows": []}


def _parse_list(text: str, allowed, what: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in allowed]
    if bad or not out:
        raise UserError(f"unknown {what} {', '.join(bad) or '(none)'}; use some of {', '.join(allowed)}")
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.nccl_settings:
        for env, label in peer_table.nccl_settings():
            print(f"{env} {label}")
        return 0
    if args.retune:
        return retune_main(args)
    colls = _parse_list(args.collectives, ("allreduce", "allgather", "reducescatter"), "collective")
    if args.declare:
        return declare_main(args, colls)
    if args.merge:
        merged = peer_table.merge([peer_table.load(Path(f)) for f in args.merge])
        summary = peer_table.summarize(merged["rows"])
        merged["summary"] = summary
        merged["targets"] = peer_table.targets(summary, merged["peers"], int(merged.get("nranks") or 2))
        print(peer_table.table(summary))
        print(peer_table.targets_text(merged["targets"]))
        if args.out:
            write_json(args.out, merged, "peer table")
        return 0
    from kernels.interp.peer_impls import PEERS

    peers = _parse_list(args.peers, PEERS, "peer")
    return run(args, peers, colls)


def retune_main(args) -> int:
    from kernels.interp.retune import load_tables, retune

    if not args.out:
        raise UserError("--retune writes a preset: give --out FILE")
    record = peer_table.load(Path(args.retune))
    base, cands, programs = load_tables(args.preset, [c.strip() for c in args.candidates.split(",") if c.strip()],
                                        int(record.get("nranks") or 2))
    new = retune(record["rows"], base, cands, programs, args.margin)
    data = new.to_json()
    data["description"] = (f"{record.get('device', '')}: bands of the fastest correct table per size "
                           f"(shipped {args.preset} or candidates {args.candidates or 'none'}, a candidate only "
                           f"when {args.margin:.0%} faster) from python -m kernels peers, {record.get('date', '')}")
    write_json(args.out, data, "interpreter preset")
    for e in new.entries:
        print(f"{e.program:>28} {e.protocol.value if e.protocol else '-':>6} [{e.min_bytes}, {e.max_bytes or 'inf'})")
    return 0


def run(args, peer_names: list[str], colls: list[str]) -> int:
    from kernels.interp.peer_impls import PEERS, Ctx, InterpPeer, PeerUnavailable
    from kernels.interp.runtime import Communicator

    declared, sizes = heldout_sizes(args.heldout, colls) if args.heldout else \
        (None, {c: sweep(args.min_bytes, args.max_bytes, args.factor) for c in colls})
    world, cp, local = mpi_gpu("the peer benchmark")
    from mpi4py import MPI
    ctx = Ctx(world, cp, Communicator(world, args.preset), args.dtype, max(max(v) for v in sizes.values()), local)
    device = device_name(cp, local)
    record = record_header(f"{world.size} x {device}", world.size, args.dtype, args.preset)
    record["basis"] = "development" if declared is None else "evaluation"
    if declared is not None:
        record["heldout"] = declared
    out = Path(args.out) if args.out else None
    peers = []
    makers = [(name, PEERS[name]) for name in peer_names]
    makers += [(f"interp[{c}]", lambda ctx, c=c: InterpPeer(ctx, c))
               for c in (x.strip() for x in args.candidates.split(",")) if c]
    for name, make in makers:
        try:
            peer, reason = make(ctx), ""
        except (PeerUnavailable, UserError) as e:
            peer, reason = None, str(e)
        except Exception as e:  # noqa: BLE001  (a library's failure is the peer's result, kept in the record)
            peer, reason = None, f"{type(e).__name__}: {e}"
        up = bool(world.allreduce(int(peer is not None), op=MPI.MIN))
        if not up and peer is not None:
            reason = "unavailable on another rank"
        record["peers"][_row_name(name, args.label)] = {"available": up, "reason": reason}
        if up:
            peers.append(peer)
        _log(world, f"peer {name}: {'ready' if up else 'skipped: ' + reason}")
    stream = cp.cuda.Stream(non_blocking=True)
    try:
        for coll in colls:
            for nbytes in sizes[coll]:
                count = count_for(coll, nbytes, ctx.esize, world.size)
                if count == 0:
                    continue
                rows = measure_size(ctx, [p for p in peers if coll in p.collectives], coll, nbytes, count,
                                    args, stream)
                record["rows"].extend(rows)
                for r in rows:
                    _log(world, peer_table.row_line(r))
                if out is not None and world.rank == 0:
                    write_json(out, record, "peer table")
    finally:
        for p in reversed(peers):
            p.close()
        ctx.interp.close()
        if ctx._torch_group is not None:   # symmetric tensors freed while their group still exists
            import torch
            import torch.distributed as dist

            ctx.extra.clear()
            torch.cuda.synchronize()
            world.Barrier()
            dist.destroy_process_group()
    if world.rank == 0:
        summary = peer_table.summarize(record["rows"])
        print(peer_table.table(summary))
        print(peer_table.targets_text(peer_table.targets(summary, record["peers"], int(record.get("nranks") or 2))))
    return 1 if peer_table.failures(record["rows"]) else 0


def _row_name(name: str, label: str) -> str:
    return f"nccl[{label}]" if name == "nccl" and label else name


def _log(world, msg: str) -> None:
    if world.rank == 0:
        print(msg, file=sys.stderr, flush=True)


class PeerArm(Arm):
    """A peer's call of one size as an arm of the measurement engine: checked on fresh random data
    against the sum computed here from every rank's input, its CUDA graph replayed."""

    def __init__(self, ctx, peer, coll: str, count: int, stream):
        self.ctx, self.peer, self.coll, self.count, self.stream = ctx, peer, coll, count, stream
        self.detail = peer.prepare(coll, count)
        self.sptr, self.rptr = peer.buffers(coll, count)
        self.max_rel_err = 0.0

    def call(self) -> None:
        self.peer.launch(self.coll, self.count, self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def check(self, seed: int) -> int:
        from kernels.interp import gpudata, pack

        ctx, cp = self.ctx, self.ctx.cp
        in_n, out_n = pack.buffer_elems(self.coll, self.count, ctx.world.size)
        mine, want, scale = gpudata.reference(cp, self.coll, ctx.dtype, self.count, ctx.world.rank, ctx.world.size,
                                              seed)
        cp.cuda.runtime.memcpyAsync(self.sptr, mine.data.ptr, in_n * ctx.esize, 3, self.stream.ptr)
        cp.cuda.runtime.memsetAsync(self.rptr, 0xFF, out_n * ctx.esize, self.stream.ptr)
        self.stream.synchronize()
        got = self.peer.launch(self.coll, self.count, self.stream)
        self.stream.synchronize()
        wrong, err = gpudata.count_wrong(cp, gpudata.view(cp, got, out_n, ctx.dtype, self.peer), want, scale,
                                         ctx.dtype, ctx.world.size)
        self.max_rel_err = max(self.max_rel_err, err)
        return wrong

    def graph(self, calls: int):
        g = self.peer.capture(self.coll, self.count, self.stream, calls)
        return lambda: time_graph(self.ctx.cp, self.stream, g, calls) * calls


def measure_size(ctx, peers, coll: str, nbytes: int, count: int, args, stream) -> list[dict]:
    """One row per peer, all arms of one engine comparison: checked on fresh random data before timing
    and after the timed replays, CUDA graphs of N calls, replays of all peers interleaved, median, max
    over ranks. A peer wrong before or after is ``correct`` False without ``error`` (a failure); one
    that could not prepare or capture carries its ``error`` (skipped)."""
    from calibrate.collectives import Collective, busbw_factor

    n = ncalls_for(nbytes)
    made: dict[str, PeerArm] = {}

    def factory(peer):
        def make():
            made[peer.name] = PeerArm(ctx, peer, coll, count, stream)
            return made[peer.name]
        return make

    opts = Options(TimingMode.GRAPH, rounds=args.reps, calls=n, min_batch_s=0.0, warmup=2, seed=nbytes % 65521)
    res = compare(MpiGroup(ctx.world), [(_row_name(p.name, args.label), factory(p)) for p in peers], opts)
    f = busbw_factor(Collective.parse(coll), ctx.world.size)
    rows = []
    for p in peers:
        name = _row_name(p.name, args.label)
        a, arm = res[name], made.get(p.name)
        t = a.median_s
        err = max(ctx.world.allgather(arm.max_rel_err if arm else float("nan")))
        rows.append({"collective": coll, "bytes": nbytes, "count": count, "dtype": ctx.dtype, "peer": name,
                     "detail": arm.detail if arm else "", "calls_per_graph": a.calls or n,
                     "us": t * 1e6 if t else float("nan"), "busbw_gbs": nbytes / t * f / 1e9 if t else float("nan"),
                     "correct": a.ok, "max_rel_err": err,
                     "error": "" if a.status is Status.WRONG or a.ok else a.reason[:300],
                     "check": a.reason if a.status is Status.WRONG else "before timing and after the timed replays",
                     "wrong_before": a.wrong_before, "wrong_after": a.wrong_after})
    del made
    ctx.cp.get_default_memory_pool().free_all_blocks()
    return rows
