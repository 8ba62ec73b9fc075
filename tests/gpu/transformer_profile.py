"""Where a user-style transformer's step goes, kernel by kernel, beside the planner's per-layer figures.

    python tests/gpu/transformer_profile.py PROFILE.json [--ids D1,D2] [--recompute none]

For the development shapes only (reports/records/transformer_shapes.json; the held-out ones are
refused: no model change may be chosen by looking at them), the modules of
tests/gpu/transformer_check.py run a few steps, then one step under ``torch.profiler``. Printed
per shape:

- the measured step split into its forward (with the loss), backward and optimizer by CUDA
  events around each phase (one step, the phases synchronised: a little slower than steps back
  to back), beside the plan's per-layer forward, backward and optimizer figures summed;
- the CUDA kernel time of that step grouped into kinds of work by kernel name (matrix products,
  attention, normalisation, elementwise, reductions, the loss, the embedding, the optimizer,
  copies) with each group's largest kernels;
- the planner's per-layer forward and backward (``autotune.plan.build``'s ``forward_s``/``backward_s`` of
  every layer times its count) grouped by layer kind;
- the GPU time of that step by the host op that launched it (self time, the top 24);
- peak memory: ``torch.cuda.max_memory_allocated`` beside the plan's breakdown;
- with ``--memory``: one more step under ``torch.cuda.memory._record_memory_history``: where the
  step peaks (the allocation that reached it and where it was made) and what is alive then, grouped
  by the line of the module or of the step that allocated it (``memory_timeline``).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import transformer_check as tc  # noqa: E402
from alloc_trace import traced_step  # noqa: E402

# kernel-name fragments -> group, first match wins
GROUPS = (
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "splitk")),
    ("optimizer", ("adam", "multi_tensor")),
    ("loss", ("softmax", "nll", "cross_entropy", "log_softmax")),
    ("embedding", ("embedding", "indexselect", "index_select", "indexing_backward", "scatter", "gather")),
    ("norm", ("layer_norm", "layernorm", "rms")),
    ("reduce", ("reduce_kernel", "reduce")),
    ("copy/cast", ("copy", "cat", "catarray")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def kernel_table(prof) -> dict[str, list]:
    """group -> [total seconds, {kernel name: seconds}] over the profiled CUDA kernels."""
    out: dict[str, list] = defaultdict(lambda: [0.0, defaultdict(float)])
    for e in prof.events():
        if getattr(e, "device_type", None) is None or str(e.device_type).split(".")[-1] != "CUDA":
            continue
        secs = e.device_time_total / 1e6 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e6
        g = out[group_of(e.name)]
        g[0] += secs
        g[1][e.name] += secs
    return out


def phases(torch, module, shape, steps: int = 3):
    """Median forward, backward and optimizer seconds of ``steps`` steps, each phase between CUDA events."""
    x, y = tc.batch(torch, shape, "cuda") if hasattr(tc, "batch") else _batch(torch, shape)
    opt = torch.optim.AdamW(module.parameters(), lr=6e-4, fused=True)
    out = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(steps + 2):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = module(x, y)
        ev[1].record()
        loss.backward()
        ev[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ev[3].record()
        torch.cuda.synchronize()
        for k, (a, b) in zip(out, zip(ev, ev[1:])):
            out[k].append(a.elapsed_time(b) / 1e3)
    return {k: sorted(v[2:])[len(v[2:]) // 2] for k, v in out.items()}, opt, (x, y)


def _batch(torch, shape):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape["vocabulary"], (shape["micro_batch"], shape["sequence"] + 1), generator=g)
    return tokens[:, :-1].contiguous().cuda(), tokens[:, 1:].contiguous().cuda()


def plan_layers(shape: dict, profile_path: str, recompute: str) -> dict:
    """The plan's figures: per layer kind (forward, backward) seconds, the optimizer, the memory breakdown."""
    import numpy as np

    from calibrate.profile import Profile
    from models import load_model

    from autotune.sbp.boxing import Coster
    from autotune.sbp.cost import Problem
    from autotune.sbp.memory import Mode
    from autotune.sbp.mesh import Cluster
    from autotune.plan.build import build as build_plan
    from autotune.sbp.search import auto_budget, make_search

    kind, cfg = tc.model_config(shape)
    graph = load_model(kind, None, cfg)
    problem = Problem(graph, Coster(Profile.load(profile_path), Cluster(1, 1)), None, require_fit=False,
                      objective="step", mode=Mode(recompute=recompute))
    best = make_search("cd").run(problem, auto_budget(problem), np.random.default_rng(0))
    plan = build_plan(problem, best.assignment, "one GPU")
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    opt = 0.0
    for layer in plan.layers:
        k = kinds[f"{layer.kind} ({layer.name})" if layer.kind == "matmul" else layer.kind]
        k[0] += layer.count * layer.costs.get("forward_s", 0.0)
        k[1] += layer.count * layer.costs.get("backward_s", 0.0)
        opt += layer.count * layer.costs.get("optimizer_s", 0.0)
    return {"kinds": dict(kinds), "optimizer": opt, "totals": plan.costs.to_dict()}


def _site(frames) -> str:
    """Where an allocation was made: the innermost frame in the user's module (transformer_check.py), else in
    this script, with ``recompute`` when torch.utils.checkpoint re-ran it and ``backward`` when autograd made it."""
    names = [(f.get("filename", ""), f.get("line", 0), f.get("name", "")) for f in frames or []]
    mine = [n for n in names if n[0].endswith("transformer_check.py")] or \
        [n for n in names if n[0].endswith("transformer_profile.py")]
    where = f"{Path(mine[0][0]).name}:{mine[0][1]} {mine[0][2]}" if mine else (names[0][2] if names else "?")
    tags = [t for t, key in (("recompute", "checkpoint.py"), ("backward", "autograd")) if any(key in n[0] for n in names)]
    return where + (f" [{', '.join(tags)}]" if tags else "")


def memory_timeline(torch, step) -> None:
    """Run ``step()`` once under the allocator's history and print its peak: the bytes alive before the step,
    the allocation that reached the peak and where it was made, and what was alive then by site."""
    before, peak, at, sites = traced_step(torch, step, _site)
    print(f"memory timeline: {before / 2**30:.2f} GiB alive before the step (parameters, optimizer states); peak "
          f"{peak / 2**30:.2f} GiB reached by an allocation at {at}; alive then, made during the step (GiB, tensors):")
    for site, (size, n) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"  {site[:90]:90s} {size / 2**30:7.3f} {n:5d}")


def op_table(prof) -> list[tuple[str, float, int]]:
    """(op name, self GPU seconds, calls) per host op of the profiled step (autograd's backward nodes and
    aten ops alike), largest first: which op's kernels the step's time went to."""
    rows = []
    for e in prof.key_averages():
        secs = getattr(e, "self_device_time_total", None)
        secs = (e.self_cuda_time_total if secs is None else secs) / 1e6
        if secs > 0:
            rows.append((e.key, secs, e.count))
    return sorted(rows, key=lambda r: -r[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="transformer_profile.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="the profile python -m calibrate compute wrote on this machine")
    ap.add_argument("--shapes", default=str(tc.SHAPES),
                    help="a shape declaration; only its development rows are read (default %(default)s)")
    ap.add_argument("--ids", default=None, help="development shape ids (default all of them)")
    ap.add_argument("--recompute", default="none", choices=tc.RECOMPUTE)
    ap.add_argument("--memory", action="store_true",
                    help="also run one step under the allocator's history and print what is alive at its peak")
    ap.add_argument("--by-shape", default=None, metavar="OP",
                    help="also print the GPU time of host op OP (e.g. aten::copy_) by its input shapes")
    args = ap.parse_args(argv)
    shapes = tc.load_shapes(args.shapes, ("development",))
    if args.ids:
        want = set(args.ids.split(","))
        if want - {s["id"] for s in shapes}:
            print(f"transformer_profile.py: error: {sorted(want - {s['id'] for s in shapes})} are not development "
                  "shapes; only those may be profiled", file=sys.stderr)
            return 2
        shapes = [s for s in shapes if s["id"] in want]
    import torch
    from torch.profiler import ProfilerActivity, profile

    for shape in shapes:
        pred = plan_layers(shape, args.profile, args.recompute)
        with torch.device("cuda"):
            module = tc.build_module(shape, args.recompute)
        torch.cuda.reset_peak_memory_stats()
        ph, opt, (x, y) = phases(torch, module, shape)
        peak = torch.cuda.max_memory_allocated()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=bool(args.by_shape)) as prof:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = module(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        kt = kernel_table(prof)
        print(f"\n== {shape['id']} ({shape['family']}): layers {shape['layers']} hidden {shape['hidden']} heads "
              f"{shape['heads']}/{shape['kv_heads']} ffn {shape['ffn']} seq {shape['sequence']} vocab "
              f"{shape['vocabulary']} micro-batch {shape['micro_batch']}; recompute {args.recompute}")
        pf = sum(f for f, _ in pred["kinds"].values())
        pb = sum(b for _, b in pred["kinds"].values())
        print(f"measured ms: forward {ph['forward'] * 1e3:.2f}  backward {ph['backward'] * 1e3:.2f}  optimizer "
              f"{ph['optimizer'] * 1e3:.2f}  | predicted: forward {pf * 1e3:.2f}  backward {pb * 1e3:.2f}  optimizer "
              f"{pred['optimizer'] * 1e3:.2f}  step {pred['totals'].get('step_s', 0) * 1e3:.2f}")
        total = sum(v[0] for v in kt.values())
        print(f"kernels of one step: {total * 1e3:.2f} ms")
        for g, (secs, names) in sorted(kt.items(), key=lambda kv: -kv[1][0]):
            top = sorted(names.items(), key=lambda kv: -kv[1])[:4]
            print(f"  {g:12s} {secs * 1e3:8.2f} ms   " + "; ".join(f"{n[:60]} {s * 1e3:.2f}" for n, s in top))
        print("GPU time by the op that launched it (self, top 24; ms, calls):")
        for name, secs, calls in op_table(prof)[:24]:
            print(f"  {name[:48]:48s} {secs * 1e3:8.2f} {calls:6d}")
        if args.by_shape:
            print(f"{args.by_shape} by input shapes (self GPU ms, calls):")
            rows = [(e.input_shapes, (getattr(e, "self_device_time_total", None) or e.self_cuda_time_total) / 1e3,
                     e.count) for e in prof.key_averages(group_by_input_shape=True) if e.key == args.by_shape]
            for shapes, ms, calls in sorted(rows, key=lambda r: -r[1])[:20]:
                print(f"  {str(shapes)[:70]:70s} {ms:8.2f} {calls:6d}")
        print("predicted per layer kind (ms forward / backward):")
        for k, (f, b) in sorted(pred["kinds"].items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
            print(f"  {k:28s} {f * 1e3:8.2f} {b * 1e3:8.2f}")
        if args.memory:
            memory_timeline(torch, lambda: tc.one_step(torch, module, opt, x, y))
        mem = pred["totals"].get("memory", {})
        print(f"peak memory measured {peak / 2**30:.2f} GiB; predicted {pred['totals']['memory_bytes'] / 2**30:.2f} "
              "GiB = " + ", ".join(f"{k[:-6]} {v / 2**30:.2f}" for k, v in mem.items()))
        del module, opt, loss
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
