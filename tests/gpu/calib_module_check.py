"""Issue 42's one-GPU target: the classes users import (transformers' LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM, GPT2LMHeadModel, and a nanoGPT), each calibrated by ``python -m calibrate module`` and its step
predicted from the profile with that section, against the step measured.

    python tests/gpu/calib_module_check.py PROFILE.json --out DIR [--shapes heldout|heldout2|heldout3|heldout4|dev] [--ids M1,M4] [--steps 10]

PROFILE.json: what ``python -m calibrate compute`` wrote on this machine. The shapes: the held-out rows of
reports/records/module_heldout.json (declared before the step model changed; never tuned on), with
``--shapes heldout2`` those of module_heldout2.json (declared 2026-11-29, tied embeddings and sliding windows among
them), heldout3 and heldout4 (public checkpoints' shapes: GPT-2 small and medium, TinyLlama, Qwen2 0.5B) likewise, or with ``--shapes dev`` the development rows of reports/records/module_dev.json. Per shape:
1. ``python -m calibrate module`` (a subprocess under a timeout) at tensor width 1, the shape's micro-batch and
   sequence, into DIR/<id>-profile.json (PROFILE.json plus the module section);
2. the step measured as users run it: fp32 weights, bf16 autocast, SDPA, fused AdamW, the shape's micro-batches
   accumulated, steps back to back, CUDA events at their boundaries, the median of --steps after --warmup;
   peak memory max_memory_allocated, and what the first micro-batch's forward leaves allocated for its backward
   (``kept``, beside the plan's predicted activations);
3. predicted: the searched one-GPU plan (``autotune.sbp.cost.Problem``, objective step) with the module section
   (its ``compute_source`` said), and with PROFILE.json alone (analytical) beside it.
Errors: ``calibrate.measure.stats.rel_err`` (predicted - measured) / measured. The table is printed last.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from calibrate.errors import UserError  # noqa: E402
from calibrate.measure import stats  # noqa: E402

SHAPES = {name: REPO / "reports" / "records" / f"module_{name}.json"
          for name in ("heldout", "heldout2", "heldout3", "heldout4", "dev")}
HF = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
      "GPT2LMHeadModel": "gpt2"}


def hf_config(row: dict) -> dict:
    """The config.json of a transformers shape."""
    arch = row["architecture"]
    if arch == "GPT2LMHeadModel":
        return {"architectures": [arch], "model_type": "gpt2", "n_embd": row["hidden"], "n_head": row["heads"],
                "n_layer": row["layers"], "n_inner": row["ffn"], "vocab_size": row["vocabulary"],
                "n_positions": row["sequence"], "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return {"architectures": [arch], "model_type": HF[arch], "hidden_size": row["hidden"],
            "num_attention_heads": row["heads"], "num_key_value_heads": row["kv_heads"],
            "num_hidden_layers": row["layers"], "intermediate_size": row["ffn"], "vocab_size": row["vocabulary"],
            "max_position_embeddings": row["sequence"], "tie_word_embeddings": row.get("tied", False),
            **({"sliding_window": row.get("sliding_window")} if arch != "LlamaForCausalLM" else {})}


def nano_fields(row: dict) -> dict:
    return {"kind": "gpt", "layers": row["layers"], "hidden": row["hidden"], "heads": row["heads"],
            "kv_heads": row["heads"], "ffn": row["ffn"], "vocabulary": row["vocabulary"], "sequence": row["sequence"],
            "micro_batch": row["micro_batch"], "batch": row["micro_batch"] * row["micro_batches"], "tied": True,
            "bias": True}


def nanogpt(config: dict):
    """The factory ``calibrate module --module`` calls: tests/gpu/transformer_check.py's nanoGPT."""
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    from transformer_check import modules
    c = dict(config, bias=config.get("bias", True), tied=config.get("tied", True))
    return modules()["gpt"](c)


def write_model(row: dict, folder: Path) -> Path:
    path = folder / f"{row['id']}-model.json"
    path.write_text(json.dumps(nano_fields(row) if row["architecture"] == "nanoGPT" else hf_config(row)))
    return path


def calibrate_module(row: dict, model: Path, profile: str, out: Path, timeout: int) -> str:
    cmd = [sys.executable, "-m", "calibrate", "module", "--model", str(model), "--profile", profile, "--out", str(out),
           "--tensor", "1", "--micro-batches", str(row["micro_batch"]), "--sequence", str(row["sequence"]), "--no-host"]
    if row["architecture"] == "nanoGPT":
        cmd += ["--module", "tests.gpu.calib_module_check:nanogpt"]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return f"calibrate module timed out after {timeout} s"
    print(f"  calibrate module {row['id']}: exit {r.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)
    return "" if r.returncode == 0 else f"calibrate module failed: {r.stderr.strip().splitlines()[-1:]}"


def build(row: dict, torch):
    if row["architecture"] == "nanoGPT":
        model = nanogpt(nano_fields(row))
        return model, lambda ids: model(ids, ids)
    import transformers
    cls = getattr(transformers, row["architecture"])
    conf = cls.config_class.from_dict({k: v for k, v in hf_config(row).items() if k != "architectures"})
    conf._attn_implementation = "sdpa"
    model = cls(conf)
    return model, lambda ids: model(input_ids=ids, labels=ids).loss


def traced(torch, step) -> dict:
    """One ``step()`` under the allocator's history: the peak and the blocks alive at it by where they were made
    (``alloc_trace.peak_live``), GiB."""
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    from alloc_trace import site, traced_step
    before, peak, at, sites = traced_step(torch, step, site, 400_000)
    top = sorted(sites.items(), key=lambda kv: -kv[1][0])[:25]
    return {"peak_gib": peak / 2**30, "before_gib": before / 2**30, "reached_at": at,
            "alive_gib": {k: round(v[0] / 2**30, 3) for k, v in top}}


def measure(row: dict, steps: int, warmup: int, trace: bool = False) -> dict:
    import torch
    model = None
    try:
        with torch.device("cuda"):
            model, loss_of = build(row, torch)
        model = model.to("cuda", torch.float32).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, row["vocabulary"], (row["micro_batch"], row["sequence"]), generator=g).cuda()
               for _ in range(row["micro_batches"])]
        losses = []

        kept = []

        def step():
            for i, x in enumerate(ids):
                before = torch.cuda.memory_allocated() if i == 0 else 0
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss_of(x) / len(ids)
                if i == 0:
                    kept.append(torch.cuda.memory_allocated() - before)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        for _ in range(warmup):
            step()
        where = traced(torch, step) if trace else None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
        issue = []
        for i in range(steps):
            t0 = time.perf_counter()
            step()
            marks[i + 1].record()
            issue.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        return {"step_s": statistics.median(times), "issue_s": statistics.median(issue), "peak_bytes": torch.cuda.max_memory_allocated(),
                "kept_bytes": kept[-1],
                "loss_first": float(losses[0]), "loss_last": float(losses[-1]),
                **({"trace": where} if where else {})}
    except torch.cuda.OutOfMemoryError:
        return {"note": "out of memory"}
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


def predict(row: dict, model_file: Path, profile: str) -> dict:
    import numpy as np

    from calibrate.profile import Profile
    from models import load_model

    from autotune.sbp.boxing import Coster
    from autotune.sbp.cost import Problem
    from autotune.sbp.mesh import Cluster
    from autotune.plan.build import build as build_plan
    from autotune.sbp.search import auto_budget, make_search

    over = {"sequence": row["sequence"], "micro_batch": row["micro_batch"],
            "batch": row["micro_batch"] * row["micro_batches"]}
    if row["architecture"] == "nanoGPT":
        fields = {k: v for k, v in nano_fields(row).items() if k not in ("kind",)}
        fields.update(over, attention="flash", residual=True, qkv_bias=True, norm="layernorm", mlp="gelu",
                      positions="learned", max_positions=row["sequence"], head_dim=row["hidden"] // row["heads"])
        graph = load_model("gpt", None, fields)
    else:
        graph = load_model(str(model_file), None, over)
    problem = Problem(graph, Coster(Profile.load(profile), Cluster(1, 1)), None, require_fit=False, objective="step")
    best = make_search("cd").run(problem, auto_budget(problem), np.random.default_rng(0))
    plan = build_plan(problem, best.assignment, "one GPU")
    return {"step_s": plan.costs.step_s, "bytes": plan.costs.memory_bytes, "source": plan.compute_source,
            "kept_bytes": problem.memory_breakdown(best.assignment).activations,
            "memory_gib": {k: round(v / 2**30, 3) for k, v in plan.costs.memory.items() if isinstance(v, (int, float))}}


def table(rows: list[dict]) -> str:
    head = ("id", "class", "source", "pred ms", "analytical ms", "step ms", "err %", "analyt. err %", "pred GiB",
            "GiB", "mem err %", "kept pred / analyt. / meas. GiB", "note")
    lines = [head]
    for r in rows:
        m, p, a = r.get("step_s"), r.get("pred", {}), r.get("analytical", {})
        lines.append((r["id"], r["architecture"], p.get("source", "-"),
                      *(f"{v * 1e3:.1f}" if v else "-" for v in (p.get("step_s"), a.get("step_s"), m)),
                      *(f"{stats.rel_err(x, m) * 100:+.1f}" if x and m else "-" for x in (p.get("step_s"), a.get("step_s"))),
                      *(f"{v / 2**30:.2f}" if v else "-" for v in (p.get("bytes"), r.get("peak_bytes"))),
                      f"{stats.rel_err(p['bytes'], r['peak_bytes']) * 100:+.1f}" if p.get("bytes") and r.get("peak_bytes")
                      else "-", " / ".join(f"{v / 2**30:.2f}" if v else "-" for v in
                                           (p.get("kept_bytes"), a.get("kept_bytes"), r.get("kept_bytes"))),
                      r.get("note", "")))
    w = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    out = ["  ".join(str(c).ljust(w[i]) for i, c in enumerate(x)) for x in lines]
    errs = [stats.rel_err(r["pred"]["step_s"], r["step_s"]) for r in rows if r.get("step_s") and r.get("pred")]
    if errs:
        out.append(f"step error with the module section: median {statistics.median(errs) * 100:+.1f}%, worst "
                   f"{max(errs, key=abs) * 100:+.1f}%, within 5%: {sum(abs(e) <= 0.05 for e in errs)} of {len(errs)}, "
                   f"signs {sum(e > 0 for e in errs)}+ / {sum(e < 0 for e in errs)}-, median |error| "
                   f"{statistics.median(map(abs, errs)) * 100:.1f}%")
    mem = [stats.rel_err(r["pred"]["bytes"], r["peak_bytes"]) for r in rows if r.get("peak_bytes") and r.get("pred")]
    if mem:
        out.append(f"memory error: median |error| {statistics.median(map(abs, mem)) * 100:.1f}%, worst "
                   f"{max(mem, key=abs) * 100:+.1f}%, within 5%: {sum(abs(e) <= 0.05 for e in mem)} of {len(mem)}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="heldout")
    ap.add_argument("--ids", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--module-timeout", type=int, default=60)
    ap.add_argument("--trace", default="", help="ids whose measured step's memory is traced (allocator history)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in json.loads(SHAPES[args.shapes].read_text())[args.shapes]
            if not args.ids or r["id"] in args.ids.split(",")]
    results = []
    for row in rows:
        r = dict(row)
        model = write_model(row, out)
        profile = out / f"{row['id']}-profile.json"
        note = calibrate_module(row, model, args.profile, profile, args.module_timeout)
        try:
            r["analytical"] = predict(row, model, args.profile)
            if not note:
                r["pred"] = predict(row, model, str(profile))
        except UserError as e:
            note = f"{note}; no prediction: {e}".strip("; ")
        r.update(measure(row, args.steps, args.warmup, row["id"] in args.trace.split(",")))
        r["note"] = "; ".join(n for n in (note, r.get("note", "")) if n)
        results.append(r)
        print(f"  {row['id']}: {json.dumps({k: v for k, v in r.items() if k in ('step_s', 'issue_s', 'peak_bytes', 'pred', 'note')})}",
              flush=True)
    (out / "module_check.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    from calibrate.cli import run_cli
    sys.exit(run_cli(main))
