"""``python -m kernels peers``: the interpreter against the strongest peers, under
``mpirun -np N`` (one process per GPU).

One timer for all: each peer's calls captured in a CUDA graph of N calls, replays
of all peers interleaved, CUDA events, median, max over ranks; before timing,
every peer's result is checked on fresh random data against the sum computed
locally from every rank's input (no library in the reference).

    mpirun -np 2 python -m kernels peers --out peers.json             # interp, nccl, nccl-symm, torch-*
    NCCL_MIN_NCHANNELS=64 NCCL_MAX_NCHANNELS=64 NCCL_PROTO=LL128 \\
      mpirun -np 2 python -m kernels peers --peers nccl --label ch64/LL128 --out nccl_ch64_LL128.json
    python -m kernels peers --merge peers.json nccl_*.json --out merged.json   # table, best peer, ratio
    python -m kernels peers --nccl-settings      # the environment sweep, one line per setting

NCCL reads its channel limits once per process, so each setting of the sweep is
its own process and communicator (the GPU script runs them); ``--merge`` takes
NCCL's best setting per size from them. The record is rewritten after every size.
"""
from __future__ import annotations

import datetime as _dt
import statistics
import sys
from pathlib import Path

from calibrate.cli import command_parser, finite_float
from calibrate.device.gpu import device_name, mpi_gpu
from calibrate.device.timing import time_graph
from calibrate.errors import UserError
from calibrate.records import header
from calibrate.sizes import parse_size, sweep
from calibrate.jsonfile import write_json

from kernels.interp import peer_table
from kernels.interp.bench import count_for, ncalls_for

DEFAULT_PEERS = ("interp", "nccl", "nccl-symm", "torch-oneshot", "torch-twoshot", "torch-rs", "torch-lowcontention")
TIMING = ("CUDA graph of N calls per peer (200 small, about 20 ms of work large), replays of all peers "
          "interleaved, CUDA events, median of replays, max over ranks")


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
    return p


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
    if args.merge:
        merged = peer_table.merge([peer_table.load(Path(f)) for f in args.merge])
        summary = peer_table.summarize(merged["rows"])
        merged["summary"] = summary
        merged["targets"] = peer_table.targets(summary)
        print(peer_table.table(summary))
        print(peer_table.targets_text(merged["targets"]))
        if args.out:
            write_json(args.out, merged, "peer table")
        return 0
    from kernels.interp.peer_impls import PEERS

    peers = _parse_list(args.peers, PEERS, "peer")
    colls = _parse_list(args.collectives, ("allreduce", "allgather", "reducescatter"), "collective")
    return run(args, peers, colls)


def retune_main(args) -> int:
    from kernels.interp.retune import load_tables, retune

    if not args.out:
        raise UserError("--retune writes a preset: give --out FILE")
    record = peer_table.load(Path(args.retune))
    base, cands, programs = load_tables(args.preset, [c.strip() for c in args.candidates.split(",") if c.strip()])
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

    world, cp, local = mpi_gpu("the peer benchmark")
    from mpi4py import MPI
    size_list = sweep(args.min_bytes, args.max_bytes, args.factor)
    ctx = Ctx(world, cp, Communicator(world, args.preset), args.dtype, max(size_list), local)
    device = device_name(cp, local)
    record = record_header(f"{world.size} x {device}", world.size, args.dtype, args.preset)
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
            for nbytes in size_list:
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
        print(peer_table.table(peer_table.summarize(record["rows"])))
    return 1 if peer_table.failures(record["rows"]) else 0


def _row_name(name: str, label: str) -> str:
    return f"nccl[{label}]" if name == "nccl" and label else name


def _log(world, msg: str) -> None:
    if world.rank == 0:
        print(msg, file=sys.stderr, flush=True)


def measure_size(ctx, peers, coll: str, nbytes: int, count: int, args, stream) -> list[dict]:
    """One row per peer: checked on fresh random data, then timed with the others."""
    from mpi4py import MPI

    from kernels.interp import gpudata, pack

    cp, world, dtype, esize = ctx.cp, ctx.world, ctx.dtype, ctx.esize
    in_n, out_n = pack.buffer_elems(coll, count, world.size)
    mine, want, scale = gpudata.reference(cp, coll, dtype, count, world.rank, world.size, seed=nbytes % 65521)
    n = ncalls_for(nbytes)
    graphs, rows = {}, {}
    for peer in peers:
        name = _row_name(peer.name, args.label)
        row = {"collective": coll, "bytes": nbytes, "count": count, "dtype": dtype, "peer": name, "detail": "",
               "calls_per_graph": n, "us": float("nan"), "busbw_gbs": float("nan"), "correct": False,
               "max_rel_err": float("nan"), "error": ""}
        rows[name] = row
        try:
            row["detail"] = peer.prepare(coll, count)
            sptr, rptr = peer.buffers(coll, count)
            cp.cuda.runtime.memcpyAsync(sptr, mine.data.ptr, in_n * esize, 3, stream.ptr)
            cp.cuda.runtime.memsetAsync(rptr, 0xFF, out_n * esize, stream.ptr)
            stream.synchronize()
            got = peer.launch(coll, count, stream)
            stream.synchronize()
            ok, err = gpudata.compare_float(cp, gpudata.view(cp, got, out_n, dtype, peer), want, scale, dtype,
                                            world.size)
            row["max_rel_err"] = err
        except Exception as e:  # noqa: BLE001  (recorded; the other peers go on)
            ok, row["error"] = False, f"{type(e).__name__}: {e}"[:300]
        row["correct"] = bool(world.allreduce(int(ok), op=MPI.MIN))
        if not row["correct"]:
            continue
        try:
            graphs[name] = peer.capture(coll, count, stream, n)
            good = 1
        except Exception as e:  # noqa: BLE001
            row["error"], good = f"capture: {type(e).__name__}: {e}"[:300], 0
        if not world.allreduce(good, op=MPI.MIN):
            graphs.pop(name, None)
            row["correct"] = False
            row["error"] = row["error"] or "capture failed on another rank"
    del mine, want, scale
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(args.reps):   # replays of all peers interleaved: each sees the same machine state
        for name, graph in graphs.items():
            times[name].append(time_graph(cp, stream, graph, n, barrier=world.Barrier))
    from calibrate.collectives import Collective, busbw_factor

    f = busbw_factor(Collective.parse(coll), world.size)
    for name, ts in times.items():
        t = world.allreduce(statistics.median(ts), op=MPI.MAX)
        rows[name]["us"] = t * 1e6
        rows[name]["busbw_gbs"] = nbytes / t * f / 1e9
    del graphs
    cp.get_default_memory_pool().free_all_blocks()
    return list(rows.values())
