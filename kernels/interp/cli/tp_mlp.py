"""``python -m kernels tp-mlp``: one tensor-parallel MLP layer (Megatron's column- then
row-parallel split of the feed-forward block), forward and backward on every GPU of
``mpirun -np N``, with the interpreter's allreduce against torch's NCCL allreduce.

Per step: Y = allreduce(gelu(X W1_r) W2_r) forward, and the allreduce of dX in the
backward pass (two allreduces of tokens x hidden elements). Both variants run the
same step on the same weights and inputs, as arms of the measurement engine
(``calibrate.measure.engine``): each step captured in a torch CUDA graph (the
interpreter inside torch's capture), replays interleaved variant by variant and timed
with CUDA events (median, max over ranks), and in a second comparison the same steps
eagerly (``interp_eager``, ``nccl_eager``). Every arm's output and gradients are
checked on fresh random data before timing and after its timed steps, against the
same step with the allreduce summed on the host; an arm that fails is a row saying
why, and the verdict "interp at least as fast as NCCL" is then unknown.
Writes a versioned record (kind commtune.interp-tp-mlp).
"""
from __future__ import annotations

import datetime as _dt
import sys

from calibrate.cli import command_parser
from calibrate.device import dtypes
from calibrate.device.gpu import device_name, mpi_gpu
from calibrate.errors import UserError
from calibrate.measure import engine
from calibrate.measure.verdict import judge, overall
from calibrate.records import header
from calibrate.jsonfile import write_json
from calibrate.outputs import check_output_path

RESULT_KIND = "commtune.interp-tp-mlp"
RESULT_VERSION = 2


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


def host_allreduce(torch, world):
    """The check's allreduce, in neither library under test: the tensor summed in float32 on the
    host through MPI communicator ``world``, handed back in its own type on its own device."""
    import numpy as np
    from mpi4py import MPI

    def allreduce(t):
        mine = np.ascontiguousarray(t.detach().float().cpu().numpy())
        out = np.empty_like(mine)
        world.Allreduce(mine, out, op=MPI.SUM)
        return torch.from_numpy(out).to(device=t.device, dtype=t.dtype)

    return allreduce


def tolerance(dtype: str, nranks: int) -> float:
    """Largest error relative to |reference| + 1e-2 of a step whose allreduce rounds differently from
    the host's float32 sum: that of a sum over ``nranks`` ranks rounded in ``dtype``
    (``calibrate.device.dtypes``), and never below 1e-5 (float32) or 2e-2 (16-bit types)."""
    return max(1e-5 if dtype == "float32" else 2e-2, dtypes.tolerance(dtype, nranks))


class StepArm(engine.Arm):
    """One variant's training step of the layer as an arm of the engine.

    A call is one step (forward and backward) on the row's X and dY, eagerly; ``graph(calls)``
    captures ``calls`` steps in a torch CUDA graph on ``stream`` (the interpreter inside torch's
    capture), each replay timed by CUDA events. ``check(seed)``: fresh X and dY from ``seed`` (the
    same on every rank: the layer's input is replicated), the step and the reference step (the same
    layer with ``reference``'s allreduce) each on fresh outputs and gradients; the wrong elements
    of Y, dX, dW1 and dW2 (not finite, or beyond ``tol``)."""

    def __init__(self, torch, step, reference, x, w1, w2, dy, tol: float, stream=None):
        self.torch, self.step, self.reference, self.tol, self.stream = torch, step, reference, tol, stream
        self.x, self.w1, self.w2, self.dy = x, w1, w2, dy
        self.max_rel_err = 0.0
        self._graph = None

    def call(self) -> None:
        self.step(self.x, self.w1, self.w2, self.dy)

    def synchronize(self) -> None:
        if self.x.is_cuda:
            self.torch.cuda.synchronize(self.x.device)

    def _outputs(self, step, x, dy) -> list:
        for p in (self.w1, self.w2):
            p.grad = None
        x = x.clone().requires_grad_()
        y = step(x, self.w1, self.w2, dy)
        out = [t.detach().float().clone() for t in (y, x.grad, self.w1.grad, self.w2.grad)]
        for p in (self.w1, self.w2):
            p.grad = None
        return out

    def check(self, seed: int) -> int:
        torch = self.torch
        gen = torch.Generator(device=self.x.device).manual_seed(seed)
        x, dy = (torch.randn(t.shape, device=t.device, generator=gen).to(t.dtype) for t in (self.x, self.dy))
        got, want = self._outputs(self.step, x, dy), self._outputs(self.reference, x, dy)
        wrong = 0
        for g, w in zip(got, want):
            err = (g - w).abs() / (w.abs() + 1e-2)
            wrong += int((~(err <= self.tol)).sum())
            self.max_rel_err = max(self.max_rel_err, float(torch.nan_to_num(err, nan=float("inf")).max()))
        return wrong

    def graph(self, calls: int):
        torch = self.torch
        torch.cuda.synchronize()
        for p in (self.x, self.w1, self.w2):
            p.grad = None
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, stream=self.stream):
            for _ in range(calls):
                self.call()
        self._graph.replay()
        torch.cuda.synchronize()

        def replay() -> float:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            self._graph.replay()
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1) / 1e3
        return replay

    def close(self) -> None:
        for p in (self.x, self.w1, self.w2):   # gradients the graph's replays wrote in its memory pool
            p.grad = None
        self._graph = None


def graph_options(args) -> engine.Options:
    """Each variant's ``--steps`` steps captured in a CUDA graph, ``--reps`` replays interleaved."""
    return engine.Options(engine.TimingMode.GRAPH, rounds=args.reps, calls=args.steps, min_batch_s=0.0, warmup=1,
                          seed=1)


def eager_options(args) -> engine.Options:
    """The same steps without a graph: ``--steps`` back-to-back steps per batch, host clock."""
    return engine.Options(engine.TimingMode.HOST, rounds=args.reps, calls=args.steps, min_batch_s=0.0, warmup=1,
                          seed=2)


EAGER = "_eager"   # the eager arm of a variant is named variant + EAGER


def compare_steps(group, steps: dict, make_arm, args) -> tuple[engine.Comparison, engine.Comparison, dict]:
    """(the graphs' comparison, the eager comparison, {arm: its StepArm}) of the variants' ``steps``:
    ``make_arm(step)`` builds a variant's arm (an exception: the arm fails to start; its row says why)."""
    made: dict = {}

    def factory(name, step):
        def make():
            made[name] = make_arm(step)
            return made[name]
        return make

    graph = engine.compare(group, [(n, factory(n, s)) for n, s in steps.items()], graph_options(args))
    eager = engine.compare(group, [(n + EAGER, factory(n + EAGER, s)) for n, s in steps.items()],
                           eager_options(args))
    return graph, eager, made


def row_from(tokens: int, nbytes: int, choice: str, graph: engine.Comparison, eager: engine.Comparison,
             max_rel_err: float) -> dict:
    """A row of the table and the record: the variants' medians, the ratios, every arm's status and
    the verdicts "interp at least as fast as NCCL" (unknown where an arm has no median)."""
    def us(cmp, name) -> float:
        a = cmp.arms.get(name)
        return a.median_s * 1e6 if a is not None and a.median_s is not None else float("nan")

    def ratio(cmp, base, ours) -> float:
        r = cmp.ratio(base, ours)
        return float("nan") if r is None else r

    pairs = (("graph", graph, "nccl", "interp"), ("eager", eager, "nccl" + EAGER, "interp" + EAGER))
    verdicts = [judge(f"interp step >= NCCL's speed ({kind})", cmp.ratio(b, o), lambda v: v >= 1.0,
                      cmp.missing([o, b])) for kind, cmp, b, o in pairs]
    arms = list(graph.arms.values()) + list(eager.arms.values())
    why = "; ".join(f"{a.name}: {a.status.value} ({a.reason})" for a in arms if not a.ok)
    return {"tokens": tokens, "allreduce_bytes": nbytes, "interp_choice": choice,
            "interp_step_us": us(graph, "interp"), "nccl_step_us": us(graph, "nccl"),
            "speedup": ratio(graph, "nccl", "interp"), "graph_error": why,
            "interp_eager_step_us": us(eager, "interp" + EAGER), "nccl_eager_step_us": us(eager, "nccl" + EAGER),
            "eager_speedup": ratio(eager, "nccl" + EAGER, "interp" + EAGER),
            "correct": all(a.ok for a in arms), "max_rel_err": max_rel_err,
            "checked": "before timing and after the timed steps, against the step with a host allreduce",
            "verdict": overall(verdicts), "verdicts": [v.to_dict() for v in verdicts],
            "arms": [a.to_dict() for a in arms]}


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
              "timing": f"graphs: {graph_options(args).describe()}; eager: {eager_options(args).describe()}",
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
        for r in record["rows"]:
            if r["graph_error"]:
                print(f"tokens {r['tokens']}: {r['graph_error']}")
    return 0 if all(r["correct"] for r in record["rows"]) else 1


def measure(torch, world, steps, interp, w1, w2, tokens, args, dev, tdt) -> dict:
    """One row: the variants' steps compared by the engine (``compare_steps``), graphs and eager."""
    gen = torch.Generator(device=dev).manual_seed(99 + tokens)   # the same X and dY on every rank
    x = torch.randn(tokens, args.hidden, device=dev, generator=gen).to(tdt)
    dy = torch.randn(tokens, args.hidden, device=dev, generator=gen).to(tdt)
    x.requires_grad_()
    interp.prepare("allreduce", x)
    reference = make_layer(torch, host_allreduce(torch, world))
    # Everything on one side stream (the capture's too): the leaves' gradient accumulators are
    # made on the stream that first runs a backward, and one made on the legacy default stream
    # breaks a later capture (GPU run of 2026-11-23: cudaErrorStreamCaptureImplicit).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph, eager, made = compare_steps(
            engine.MpiGroup(world), steps,
            lambda step: StepArm(torch, step, reference, x, w1, w2, dy, tolerance(args.dtype, world.size), side), args)
    err = max(world.allgather(max((a.max_rel_err for a in made.values()), default=float("nan"))))
    choice = interp.comm.explain("allreduce", x.numel(), str(tdt).replace("torch.", ""))
    return row_from(tokens, tokens * args.hidden * x.element_size(), choice, graph, eager, err)


def line(r: dict) -> str:
    return (f"{r['tokens']:>7} {r['allreduce_bytes']:>10} {r['interp_step_us']:>10.1f} {r['nccl_step_us']:>10.1f} "
            f"{r['speedup']:>7.3f} {r['interp_eager_step_us']:>10.1f} {r['nccl_eager_step_us']:>10.1f} "
            f"{'yes' if r['correct'] else 'NO':>4} {r['verdict']:>8}")


def table(rows: list[dict]) -> str:
    head = (f"{'tokens':>7} {'AR bytes':>10} {'interp us':>10} {'nccl us':>10} {'speedup':>7} "
            f"{'interp eag':>10} {'nccl eag':>10} {'ok':>4} {'verdict':>8}")
    return "\n".join([head] + [line(r) for r in rows])


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))
