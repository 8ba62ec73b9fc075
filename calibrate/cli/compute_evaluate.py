"""``python -m calibrate compute declare`` and ``... compute evaluate``: the compute model's
confirmatory evaluation (``calibrate.computeeval`` says what and why).

    python -m calibrate compute declare --out heldout.json                    # before development
    python -m calibrate compute evaluate --heldout heldout.json --profile my.json --out eval.json

``declare`` draws the held-out shapes off development's grid and writes them, hashed.
``evaluate`` measures each of them in this fresh process through the measurement engine
(``calibrate.measure``): the matmuls of all shapes as arms of one comparison, each SDPA
shape's forward and forward + backward as two arms (the backward their difference), each
layer size's pieces (``calibrate.layers``) forward and forward + backward (on a GPU between long
matmuls, as development times them: ``calibrate.cli.compute.layer_piece_arm``); interleaved
rounds of back-to-back batches (on a GPU a 256 MiB copy after each matmul and SDPA call,
as development times them, and CUDA events around each call), medians. Matmul and SDPA
results are checked before and after the timed calls against a float64 (matmul) or
float32 single-head (SDPA) reference on fresh random data; the layer pieces are timed
unchecked. ``--device cpu`` runs the same path on the CPU (a stand-in for tests: its
figures say nothing of a GPU profile).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import sys

from calibrate.cli import command_parser, seed_int
from calibrate.cli import compute
from calibrate.cli.compute import (DTYPES, LAYER_QUEUE, copy_256mib, development_grid, fresh_backward,
                                  layer_piece_arm, sdpa_call)
from calibrate.computeeval import EvaluateRecord, HeldoutRecord, Row, declare, draw_shapes, pct, shapes_of, summary
from calibrate.errors import UserError
from calibrate.layers import pieces as layer_pieces
from calibrate.measure import provenance
from calibrate.measure.engine import Options, Solo, TimingMode, compare
from calibrate.measure.torcharm import TorchArm
from calibrate.optional import require_torch
from calibrate.profile import DEFAULT_PROFILE, Profile


def _pair(text: str, flag: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text!r}: give two whole numbers LO,HI, e.g. 512,8192") from None
    if not 0 < lo < hi:
        raise UserError(f"{flag} {text!r}: needs 0 < LO < HI")
    return lo, hi


def _sizes(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s.strip()]
    except ValueError:
        out = []
    if not out or any(len(x) != 2 or min(x) < 1 for x in out):
        raise UserError(f"--layers {text!r}: give TOKENSxHIDDEN sizes separated by commas, e.g. 8192x3072")
    return out


def declare_parser():
    ap = command_parser("python -m calibrate compute declare", __doc__)
    ap.add_argument("--out", required=True, help="the declaration JSON to write")
    ap.add_argument("--count", type=int, default=6, help="matmul and SDPA shapes held out, each")
    ap.add_argument("--seed", type=seed_int, default=0)
    ap.add_argument("--matmul-range", default="512,8192", help="LO,HI of each matmul dimension")
    ap.add_argument("--unit", type=int, default=128, help="matmul dimensions are multiples of it")
    ap.add_argument("--seq-range", default="512,16384", help="LO,HI of the SDPA sequence lengths")
    ap.add_argument("--tokens", type=int, default=16384, help="batch x sequence of each SDPA shape")
    ap.add_argument("--layers", default="8192x3072,32768x5120", help="TOKENSxHIDDEN sizes of the layer pieces")
    return ap


def declare_main(argv) -> int:
    args = declare_parser().parse_args(argv)
    if args.unit < 1 or args.tokens < 1:
        raise UserError("--unit and --tokens must be at least 1")
    mm, seq, layers = _pair(args.matmul_range, "--matmul-range"), _pair(args.seq_range, "--seq-range"), \
        _sizes(args.layers)
    grid = development_grid()
    shapes = draw_shapes(grid, args.seed, args.count, mm, seq, args.tokens, layers, args.unit)
    how = (f"{args.count} matmul shapes (dimensions log-uniform in {mm}, multiples of {args.unit}) and {args.count} "
           f"SDPA shapes (sequences log-uniform in {seq}, {args.tokens} tokens) off the development grid, seed "
           f"{args.seed}; layer sizes {args.layers}")
    stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    dec = declare(grid, shapes, how, stamp)
    path = HeldoutRecord(provenance.command(), provenance.commit(), dec.to_dict()).save(args.out)
    print(f"declared {len(shapes['matmul'])} matmul, {len(shapes['sdpa'])} SDPA shapes and {len(layers)} layer "
          f"sizes held out (sha256 {dec.sha256[:12]}) in {path}")
    return 0


def evaluate_parser():
    ap = command_parser("python -m calibrate compute evaluate", __doc__)
    ap.add_argument("--heldout", required=True, help="the declaration written by python -m calibrate compute declare")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help="the profile whose compute model is evaluated")
    ap.add_argument("--out", required=True, help="the evaluation record JSON to write")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="element type of the matmuls and SDPA")
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (the stand-in, for tests)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (samples per arm)")
    ap.add_argument("--calls", type=int, default=3, help="least calls per batch")
    ap.add_argument("--min-batch-ms", type=float, default=1.0, help="least milliseconds per batch")
    ap.add_argument("--warmup", type=int, default=3)
    return ap


class _Fresh:
    """Random tensors on the device from a seed."""

    def __init__(self, torch, device, dtype):
        self.torch, self.device, self.dtype = torch, torch.device(device), dtype

    def __call__(self, seed: int, *shape, grad: bool = False):
        g = self.torch.Generator(device=self.device).manual_seed(seed)
        return self.torch.randn(*shape, generator=g, device=self.device, dtype=self.dtype, requires_grad=grad)


def _wrong(torch, got, ref, tol) -> int:
    """Elements of ``got`` farther than ``tol`` (a tensor or number) from ``ref``: nan counts as wrong."""
    return int((~((got.double() - ref.double()).abs() <= tol)).sum().item())


def _copier(torch, device):
    """The 256 MiB copy issued after each matmul and SDPA call on a GPU (development's condition)."""
    return copy_256mib(torch, device) if torch.device(device).type == "cuda" else None


def _matmul_arm(torch, device, dtype, m, k, n, between):
    rand = _Fresh(torch, device, dtype)
    sets = [(rand(3 * i + 1, m, k), rand(3 * i + 2, k, n)) for i in range(3)]

    def fn(i):
        return torch.mm(*sets[i % 3])

    def verify(seed, call):
        a, b = rand(2 * seed, m, k), rand(2 * seed + 1, k, n)
        sets[0] = (a, b)
        got = call(0)
        ref = a.double() @ b.double()
        return _wrong(torch, got, ref, k * torch.finfo(dtype).eps * (a.double().abs() @ b.double().abs()))

    return TorchArm(torch, device, fn, between, verify)


def _one_head(torch, q, k, v):
    """Causal attention of one head in float32 (the SDPA check's reference)."""
    s = q.shape[0]
    scores = (q.float() @ k.float().T) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.float()


def _sdpa_arm(torch, device, dtype, shape, backward: bool, between):
    b, h, kv, s, d = shape
    rand = _Fresh(torch, device, dtype)

    def qkv(seed):
        return (rand(seed, b, h, s, d, grad=True), rand(seed + 1, b, kv, s, d, grad=True),
                rand(seed + 2, b, kv, s, d, grad=True))

    sets = [qkv(10 * i) for i in range(3)]
    grad = rand(99, b, h, s, d)

    def fn(i):
        return fresh_backward(torch, sets[i % 3], grad) if backward else sdpa_call(torch, *sets[i % 3])

    def verify(seed, call):
        sets[0] = q, k, v = qkv(10 * seed + 100)
        out = call(0)
        head = [t[0, 0].detach().float().requires_grad_() for t in (q, k, v)]
        ref = _one_head(torch, *head)
        if backward:
            ref.backward(grad[0, 0].float())
            got, ref = q.grad[0, 0], head[0].grad
        else:
            got = out[0, 0]
        return _wrong(torch, got, ref, 32 * torch.finfo(dtype).eps * max(float(ref.detach().abs().max()), 1e-30))

    return TorchArm(torch, device, fn, between, verify)


def _options(args, check: bool) -> Options:
    return Options(TimingMode.HOST, rounds=args.rounds, calls=args.calls, min_batch_s=args.min_batch_ms / 1e3,
                   warmup=args.warmup, check=check)


def _row(item, shape, part, predicted, arm) -> Row:
    lo, hi = arm.ci_s
    return Row(item, shape, part, predicted, arm.median_s, arm.status.value, arm.reason,
               None if math.isnan(lo) else lo, None if math.isnan(hi) else hi)


def _backward_row(item, shape, predicted, fwd, both) -> Row:
    """The backward: forward + backward less forward (no interval: a difference of medians)."""
    bad = next((a for a in (both, fwd) if not a.ok), None)
    if bad is not None:
        return Row(item, shape, "backward", predicted, None, bad.status.value, f"{bad.name}: {bad.reason}")
    return Row(item, shape, "backward", predicted, max(both.median_s - fwd.median_s, 0.0), "ok")


def measure_matmuls(torch, device, dtype, size, model, shapes, args) -> list[Row]:
    between = _copier(torch, device)
    arms = [(f"{m} x {k} x {n}", lambda m=m, k=k, n=n: _matmul_arm(torch, device, dtype, m, k, n, between))
            for m, k, n in shapes]
    res = compare(Solo(), arms, _options(args, check=True))
    return [_row("matmul", name, "forward", model.matmul_seconds(m, k, n, size), res[name])
            for (name, _), (m, k, n) in zip(arms, shapes)]


def measure_sdpa(torch, device, dtype, size, model, shapes, args) -> list[Row]:
    between = _copier(torch, device)
    rows = []
    for shape in shapes:
        name = " ".join(map(str, shape))
        res = compare(Solo(), [(part, lambda part=part: _sdpa_arm(torch, device, dtype, shape, part == "backward",
                                                                   between)) for part in ("forward", "backward")],
                      _options(args, check=True))
        rows.append(_row("sdpa", name, "forward", model.sdpa_seconds(*shape, size), res["forward"]))
        rows.append(_backward_row("sdpa", name, model.sdpa_seconds(*shape, size, backward=True), res["forward"],
                                  res["backward"]))
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _per_piece(arm, calls: int):
    """An arm's result with its samples per piece (``calls`` pieces a timed call)."""
    return dataclasses.replace(arm, samples_s=[t / calls for t in arm.samples_s])


def measure_layers(torch, device, model, sizes, args) -> list[Row]:
    rows = []
    if torch.device(device).type == "cuda":  # as development times them: between long matmuls, LAYER_QUEUE a call
        cover = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        arm, per_call = (lambda f: layer_piece_arm(torch, device, f, cover)), LAYER_QUEUE
    else:  # the CPU stand-in: one piece a call
        arm, per_call = (lambda f: TorchArm(torch, device, lambda i: f())), 1
    for tokens, hidden in sizes:
        heads = max(4, hidden // 128)
        if hidden % heads:
            raise UserError(f"layer size {tokens}x{hidden}: the hidden size must divide into {heads} heads")
        pieces = layer_pieces(torch, torch.device(device), tokens, hidden, heads)
        arms = [(f"{kind} {part}", lambda f=f: arm(f))
                for kind, (_, fwd, both) in pieces.items() for part, f in (("forward", fwd), ("both", both))]
        res = {k: _per_piece(a, per_call) for k, a in compare(Solo(), arms, _options(args, check=False)).arms.items()}
        for kind, (elems, _, _) in pieces.items():
            pred = model.layer_seconds(kind, elems)
            shape = f"{kind} @ {tokens}x{hidden}"
            fwd, both = res[f"{kind} forward"], res[f"{kind} both"]
            if pred is None:
                why = f"the profile has no layer_s figure for {kind}: measure it with python -m calibrate compute"
                rows += [Row("layer", shape, part, None, a.median_s, "no prediction", why)
                         for part, a in (("forward", fwd), ("backward", both))]
                continue
            rows.append(_row("layer", shape, "forward", pred[0], fwd))
            rows.append(_backward_row("layer", shape, pred[1], fwd, both))
        del pieces
    return rows


def evaluate_main(argv) -> int:
    args = evaluate_parser().parse_args(argv)
    if args.rounds < 1 or args.calls < 1 or args.warmup < 0 or not args.min_batch_ms >= 0:
        raise UserError("--rounds and --calls must be at least 1, --warmup and --min-batch-ms at least 0")
    dec_rec = HeldoutRecord.load(args.heldout)
    dec = dec_rec.declaration
    shapes = shapes_of(dec, development_grid(), repr(args.heldout))
    profile = Profile.load(args.profile)
    model = profile.compute
    if model is None:
        raise UserError(f"profile {args.profile} has no compute model: measure one with python -m calibrate compute")
    torch = require_torch()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but torch sees no CUDA device: run on a GPU machine, or --device cpu")
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[args.dtype])
    size = DTYPES[args.dtype]
    model.matmul_seconds(1, 1, 1, size)   # a model without figures of this element size: one error, before work
    rows = measure_matmuls(torch, device, dtype, size, model, [tuple(x) for x in shapes["matmul"]], args)
    rows += measure_sdpa(torch, device, dtype, size, model, [tuple(x) for x in shapes["sdpa"]], args)
    rows += measure_layers(torch, device, model, [tuple(x) for x in shapes["layers"]], args)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (stand-in)"
    rec = EvaluateRecord(_dt.date.today().isoformat(), provenance.command(), provenance.commit(),
                         f"{gpu}; {provenance.machine()}", torch.__version__, str(args.profile), model.source,
                         args.dtype, dec.to_dict(),
                         f"{_options(args, True).describe()} (matmul and SDPA; the layer pieces not checked)", rows)
    path = rec.save(args.out)
    for part, s in summary(rows).items():
        print(f"{part}: {s['measured']}/{s['rows']} measured, median error {pct(s['median_err'])}, median |error| "
              f"{pct(s['median_abs_err'], '')}, worst {pct(s['worst_abs_err'], '')}", file=sys.stderr)
    print(f"wrote the compute model's evaluation ({len(rows)} figures, held-out sha256 {dec.sha256[:12]}) to {path}")
    return 0


def main(argv=None) -> int:
    """``calibrate compute``: its ``declare`` and ``evaluate`` steps here, the measurement ``compute.main``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("declare", "evaluate"):
        return {"declare": declare_main, "evaluate": evaluate_main}[argv[0]](argv[1:])
    return compute.main(argv)
