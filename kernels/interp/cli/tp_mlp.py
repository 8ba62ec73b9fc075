"""``python -m kernels tp-mlp``: one tensor-parallel MLP layer (Megatron's column- then
row-parallel split of the feed-forward block), forward and backward on every GPU of
``mpirun -np N``, with the interpreter's allreduce against torch's NCCL allreduce.

Per step: Y = allreduce(gelu(X W1_r) W2_r) forward, and the allreduce of dX in the
backward pass (two allreduces of tokens x hidden elements). Both variants run the
same step on the same weights and inputs; outputs and gradients are compared; each
step is captured in a torch CUDA graph (the interpreter inside torch's capture) and
timed with CUDA events (median of replays, max over ranks), and also eagerly.
Writes a versioned record (kind commtune.interp-tp-mlp).
"""
from __future__ import annotations

import datetime as _dt
import sys

from calibrate.cli import command_parser
from calibrate.device.gpu import device_name, mpi_gpu
from calibrate.errors import UserError
from calibrate.measure import stats
from calibrate.records import header
from calibrate.jsonfile import write_json
from calibrate.outputs import check_output_path

RESULT_KIND = "commtune.interp-tp-mlp"
RESULT_VERSION = 1


def build_parser():
    p = command_parser("python -m kernels tp-mlp", __doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096, help="model width (default 4096)")
    p.add_argument("--ffn", type=int, default=0, help="feed-forward width, all ranks (default 4 x hidden)")
    p.add_argument("--tokens", default="8,64,512,4096", help="tokens per step (batch x sequence), comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="element type")
    p.add_argument("--steps", type=int, default=20, help="steps per timed replay")
    p.add_argument("--reps", type=int, default=7, help="timed replays (median taken)")
    p.add_argument("--out", default="", help="JSON record (none: not written)")
    return p


def parse_tokens(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--tokens {text!r}: give comma-separated integers, e.g. 8,64,512") from None
    if not out or min(out) <= 0:
        raise UserError(f"--tokens {text!r}: give positive token counts")
    return out


def check_shape(hidden: int, ffn: int, nranks: int) -> int:
    """The feed-forward width each rank holds; it must split evenly."""
    ffn = ffn or 4 * hidden
    if hidden <= 0 or ffn <= 0 or ffn % nranks:
        raise UserError(f"--ffn {ffn} must be positive and divide over {nranks} ranks; pick a multiple of {nranks}")
    return ffn // nranks


def make_allreduces(torch, dist, interp):
    """{variant: allreduce(tensor) -> tensor}: the interpreter out of place, NCCL in place."""
    def nccl(x):
        dist.all_reduce(x)
        return x

    return {"interp": interp.all_reduce, "nccl": nccl}


def make_layer(torch, allreduce):
    """Forward g (allreduce forward, identity backward) and f (identity forward, allreduce backward)."""
    class ReduceOut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z):
            y = allreduce(z.contiguous())
            if y is z:   # NCCL reduces in place
                ctx.mark_dirty(z)
            return y

        @staticmethod
        def backward(ctx, g):
            return g

    class ReduceGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return allreduce(g.contiguous())

    def step(x, w1, w2, dy):
        h = torch.nn.functional.gelu(ReduceGrad.apply(x) @ w1)
        y = ReduceOut.apply(h @ w2)
        y.backward(dy)
        return y

    return step


def check_options(args) -> list[int]:
    """The options that need no GPU, checked before one is looked for; the token counts."""
    if args.hidden <= 0 or args.ffn < 0:
        raise UserError(f"--hidden {args.hidden} and --ffn {args.ffn}: give a positive width (--ffn 0: 4 x hidden)")
    if args.steps < 1 or args.reps < 1:
        raise UserError(f"--steps {args.steps} and --reps {args.reps} must be at least 1")
    if args.out:
        check_output_path(args.out, "tp-mlp record")
    return parse_tokens(args.tokens)


def run(args) -> int:
    tokens = check_options(args)
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise UserError(f"tp-mlp needs torch on a GPU machine ({e}); run it there under mpirun -np 2") from None
    from kernels.interp.runtime import Communicator
    from kernels.interp.torch_comm import TorchInterp, init_torch_from_mpi

    world, cp, local = mpi_gpu("tp-mlp")
    shard = check_shape(args.hidden, args.ffn, world.size)
    init_torch_from_mpi(world, local)
    interp = TorchInterp(Communicator(world))
    dev = torch.device("cuda", local)
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    gen = torch.Generator(device=dev).manual_seed(1234 + world.rank)
    w1 = (torch.randn(args.hidden, shard, device=dev, generator=gen) / args.hidden ** 0.5).to(tdt).requires_grad_()
    w2 = (torch.randn(shard, args.hidden, device=dev, generator=gen) / shard ** 0.5).to(tdt).requires_grad_()
    steps = {k: make_layer(torch, ar) for k, ar in make_allreduces(torch, dist, interp).items()}
    device = device_name(cp, local)
    record = {**header(RESULT_KIND, RESULT_VERSION), "date": _dt.date.today().isoformat(),
              "device": f"{world.size} x {device}", "nranks": world.size, "hidden": args.hidden,
              "ffn": shard * world.size, "dtype": args.dtype,
              "timing": f"torch CUDA graph of {args.steps} steps, CUDA events, median of {args.reps} replays, "
                        f"max over ranks; eager: the same steps without a graph",
              "rows": []}
    try:
        for t in tokens:
            row = measure(torch, world, steps, interp, w1, w2, t, args, dev, tdt)
            record["rows"].append(row)
            if world.rank == 0:
                print(line(row), file=sys.stderr, flush=True)
                if args.out:
                    write_json(args.out, record, "tensor-parallel MLP record")
    finally:
        torch.cuda.synchronize()
        interp.close()
        dist.destroy_process_group()
    if world.rank == 0:
        print(table(record["rows"]))
    return 0 if all(r["correct"] for r in record["rows"]) else 1


def measure(torch, world, steps, interp, w1, w2, tokens, args, dev, tdt) -> dict:
    from mpi4py import MPI

    gen = torch.Generator(device=dev).manual_seed(99 + tokens)   # the same X and dY on every rank
    x = torch.randn(tokens, args.hidden, device=dev, generator=gen).to(tdt)
    dy = torch.randn(tokens, args.hidden, device=dev, generator=gen).to(tdt)
    x.requires_grad_()
    interp.prepare("allreduce", x)
    # Everything on one side stream (the capture's too): the leaves' gradient accumulators are
    # made on the stream that first runs a backward, and one made on the legacy default stream
    # breaks a later capture (GPU run of 2026-11-23: cudaErrorStreamCaptureImplicit).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    results, times, eager, graph_error = {}, {}, {}, ""
    with torch.cuda.stream(side):
        for name, step in steps.items():
            for p in (x, w1, w2):
                p.grad = None
            y = step(x, w1, w2, dy)
            torch.cuda.synchronize()
            results[name] = [t.detach().float().clone() for t in (y, x.grad, w1.grad, w2.grad)]
            del y   # no autograd graph (and no gradient accumulator) outlives its step
        errs = [float(((a - b).abs() / (b.abs() + 1e-2)).max())
                for a, b in zip(results["interp"], results["nccl"])]
        tol = 1e-5 if tdt == torch.float32 else 2e-2
        correct = bool(world.allreduce(int(max(errs) <= tol), op=MPI.MIN))
        for name, step in steps.items():
            eager[name] = timed(torch, world, lambda: [step(x, w1, w2, dy) for _ in range(args.steps)], args)
        for name, step in steps.items():
            torch.cuda.synchronize()
            for p in (x, w1, w2):
                p.grad = None
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=side):
                    for _ in range(args.steps):
                        step(x, w1, w2, dy)
                ok = 1
            except RuntimeError as e:   # torch.AcceleratorError derives from it
                graph_error, ok = f"{name}: {type(e).__name__}: {e}"[:300], 0
            if not world.allreduce(ok, op=MPI.MIN):
                times[name] = float("nan")
                continue
            graph.replay()
            torch.cuda.synchronize()
            times[name] = timed(torch, world, lambda: graph.replay(), args)
            del graph
    return {"tokens": tokens, "allreduce_bytes": tokens * args.hidden * x.element_size(),
            "interp_choice": interp.comm.explain("allreduce", x.numel(), str(tdt).replace("torch.", "")),
            "interp_step_us": times["interp"], "nccl_step_us": times["nccl"],
            "speedup": times["nccl"] / times["interp"], "graph_error": graph_error,
            "interp_eager_step_us": eager["interp"], "nccl_eager_step_us": eager["nccl"],
            "eager_speedup": eager["nccl"] / eager["interp"], "correct": correct, "max_rel_err": max(errs)}


def timed(torch, world, replay, args) -> float:
    """Microseconds per step: median over replays of ``args.steps`` steps, max over ranks."""
    from mpi4py import MPI

    out = []
    for _ in range(args.reps):
        world.Barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        replay()
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) * 1e3 / args.steps)
    return world.allreduce(stats.median(out), op=MPI.MAX)


def line(r: dict) -> str:
    return (f"{r['tokens']:>7} {r['allreduce_bytes']:>10} {r['interp_step_us']:>10.1f} {r['nccl_step_us']:>10.1f} "
            f"{r['speedup']:>7.3f} {r['interp_eager_step_us']:>10.1f} {r['nccl_eager_step_us']:>10.1f} "
            f"{'yes' if r['correct'] else 'NO':>4}")


def table(rows: list[dict]) -> str:
    head = (f"{'tokens':>7} {'AR bytes':>10} {'interp us':>10} {'nccl us':>10} {'speedup':>7} "
            f"{'interp eag':>10} {'nccl eag':>10} {'ok':>4}")
    return "\n".join([head] + [line(r) for r in rows])


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))
