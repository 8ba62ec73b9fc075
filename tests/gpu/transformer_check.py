"""Issue 26's one-GPU target: a transformer written as users write it, its step time and peak memory
measured, beside the planner's prediction.

    python tests/gpu/transformer_check.py PROFILE.json [--sets development,heldout] [--recompute full]

PROFILE.json is the profile ``python -m calibrate compute`` just wrote on this machine
(tests/gpu/transformer_check.sh does both). The shapes are those declared in
reports/records/transformer_shapes.json (read only; each row says which set it is from).

The models are plain ``nn.Module``s in this file, sharing no code with the project (models/,
autotune/execute): a nanoGPT-style GPT (learned positions, LayerNorm, GELU MLP, tied embedding,
biases) and a Llama-style model (RMSNorm, SwiGLU, grouped-query attention with rotary embeddings,
untied unless the shape says tied, an optional QKV bias). Attention is
``F.scaled_dot_product_attention(is_causal=True)``, grouped K/V heads passed with
``enable_gqa=True`` (as ``calibrate compute`` times it). The recipe: fp32 parameters,
``torch.autocast("cuda", torch.bfloat16)`` around the forward and the loss,
``torch.optim.AdamW(fused=True)``, one micro-batch per step, ``--recompute full``:
``torch.utils.checkpoint`` around each block.

Measured: steps back to back (no host synchronisation between them), CUDA events at their
boundaries, ``--warmup`` steps then ``--steps`` (at least 10) timed, the median; peak memory
``torch.cuda.max_memory_allocated`` over the timed steps; the loss must be finite and lower at
the last step than at the first (the same batch every step). A shape that runs out of memory keeps
its row, saying so.

Predicted: ``models.load_model`` (kind gpt or llama with the shape's fields, batch = micro_batch,
flash attention, residual stream) and ``autotune.sbp.cost.Problem`` on a 1 x 1 cluster with
PROFILE.json, objective "step": the searched plan's totals ``step_s`` and ``memory_bytes``.
Errors are the project's one relative error, ``calibrate.measure.stats.rel_err``: (predicted - measured)
/ measured, positive where the prediction is too high (the records before 2026-11-27 printed
measured / predicted - 1, the other sign).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from calibrate.cli import run_cli  # noqa: E402
from calibrate.errors import UserError  # noqa: E402
from calibrate.measure import stats  # noqa: E402
from calibrate.records import check_header  # noqa: E402
from models import load_model  # noqa: E402

SHAPES = REPO / "reports" / "records" / "transformer_shapes.json"
SETS = ("development", "heldout")
FAMILIES = ("gpt", "llama")
INTS = ("layers", "hidden", "heads", "kv_heads", "ffn", "sequence", "vocabulary", "micro_batch")
RECOMPUTE = ("none", "full")


# ---- the shapes ----------------------------------------------------------------------------------
def load_shapes(path: str | Path = SHAPES, sets=SETS) -> list[dict]:
    """The declared shapes of ``sets``, in the file's order, each with its "set"."""
    p = Path(path)
    fix = "use reports/records/transformer_shapes.json as declared"
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the shapes file {str(p)!r} ({e}): {fix}") from None
    check_header(data, "commtune.shape-declaration", 1, "shape declaration", fix, f"shapes file {str(p)!r}")
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise UserError(f"unknown set {unknown[0]!r}: use some of {', '.join(SETS)}")
    out = []
    for name in sets:
        for row in data.get(name, []):
            where = f"shapes file {str(p)!r}, {name} row {row.get('id', '?') if isinstance(row, dict) else row!r}"
            if not isinstance(row, dict) or row.get("family") not in FAMILIES:
                raise UserError(f"{where}: needs a family, one of {', '.join(FAMILIES)}: {fix}")
            bad = [k for k in INTS if not isinstance(row.get(k), int) or isinstance(row.get(k), bool) or row[k] <= 0]
            if bad:
                raise UserError(f"{where}: field {bad[0]!r} is {row.get(bad[0])!r}, not a positive integer: {fix}")
            if row["hidden"] % row["heads"] or row["heads"] % row["kv_heads"]:
                raise UserError(f"{where}: heads must divide hidden and kv_heads divide heads: {fix}")
            if not isinstance(row.get("tied"), bool) or not isinstance(row.get("qkv_bias", False), bool):
                raise UserError(f"{where}: tied (and qkv_bias, if given) must be true or false: {fix}")
            out.append(dict(row, set=name))
    return out


def file_hash(path: str | Path = SHAPES) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def model_config(shape: dict) -> tuple[str, dict]:
    """The planner's model (kind, fields of the transformer contract) of a shape: one micro-batch
    per step, bf16 activations, SDPA flash attention, the residual stream."""
    gpt = shape["family"] == "gpt"
    cfg = {k: shape[k] for k in INTS}
    cfg.update(batch=shape["micro_batch"], head_dim=shape["hidden"] // shape["heads"], act_bytes=2,
               tied=shape["tied"], attention="flash", residual=True, bias=gpt,
               qkv_bias=shape.get("qkv_bias", gpt), norm="layernorm" if gpt else "rmsnorm",
               mlp="gelu" if gpt else "swiglu", positions="learned" if gpt else "rotary")
    if gpt:
        cfg["max_positions"] = shape["sequence"]
    return shape["family"], cfg


# ---- the modules, as users write them ------------------------------------------------------------
def modules():
    """The module classes (torch imported here: the shape and table code runs without it)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, attn, mlp, norm):
            super().__init__()
            self.ln_1, self.attn, self.ln_2, self.mlp = norm(), attn, norm(), mlp

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Stack(nn.Module):
        """Blocks, each run under torch.utils.checkpoint when recompute is "full"."""

        def __init__(self, blocks, recompute: str):
            super().__init__()
            self.h, self.recompute = nn.ModuleList(blocks), recompute

        def forward(self, x):
            for block in self.h:
                x = checkpoint(block, x, use_reentrant=False) if self.recompute == "full" else block(x)
            return x

    def init_weights(module):  # nanoGPT's
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    class CausalSelfAttention(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.n_head = c["heads"]
            self.c_attn = nn.Linear(c["hidden"], 3 * c["hidden"], bias=c["bias"])
            self.c_proj = nn.Linear(c["hidden"], c["hidden"], bias=c["bias"])

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class MLP(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c_fc = nn.Linear(c["hidden"], c["ffn"], bias=c["bias"])
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(c["ffn"], c["hidden"], bias=c["bias"])

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))

    class GPT(nn.Module):
        """nanoGPT: learned positions, pre-norm blocks, LayerNorm, GELU MLP, tied embedding, biases."""

        def __init__(self, c, recompute: str = "none"):
            super().__init__()
            norm = lambda: nn.LayerNorm(c["hidden"], bias=c["bias"])  # noqa: E731
            self.wte = nn.Embedding(c["vocabulary"], c["hidden"])
            self.wpe = nn.Embedding(c["sequence"], c["hidden"])
            self.blocks = Stack([Block(CausalSelfAttention(c), MLP(c), norm) for _ in range(c["layers"])], recompute)
            self.ln_f = norm()
            self.lm_head = nn.Linear(c["hidden"], c["vocabulary"], bias=False)
            self.apply(init_weights)
            if c["tied"]:
                self.wte.weight = self.lm_head.weight

        def forward(self, idx, targets):
            pos = torch.arange(idx.size(1), device=idx.device)
            x = self.ln_f(self.blocks(self.wte(idx) + self.wpe(pos)))
            logits = self.lm_head(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float = 1e-5):
            super().__init__()
            self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

        def forward(self, x):
            y = x.float()
            return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def rotate_half(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1)

    class Attention(nn.Module):
        """Grouped-query attention with rotary embeddings; K/V heads shared through enable_gqa."""

        def __init__(self, c):
            super().__init__()
            self.n_heads, self.n_kv_heads = c["heads"], c["kv_heads"]
            self.head_dim = c["hidden"] // c["heads"]
            self.wq = nn.Linear(c["hidden"], self.n_heads * self.head_dim, bias=c["qkv_bias"])
            self.wk = nn.Linear(c["hidden"], self.n_kv_heads * self.head_dim, bias=c["qkv_bias"])
            self.wv = nn.Linear(c["hidden"], self.n_kv_heads * self.head_dim, bias=c["qkv_bias"])
            self.wo = nn.Linear(self.n_heads * self.head_dim, c["hidden"], bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
            k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
            v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
            return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    class FeedForward(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.w1 = nn.Linear(c["hidden"], c["ffn"], bias=False)
            self.w3 = nn.Linear(c["hidden"], c["ffn"], bias=False)
            self.w2 = nn.Linear(c["ffn"], c["hidden"], bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class LlamaBlock(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.attention_norm, self.attention = RMSNorm(c["hidden"]), Attention(c)
            self.ffn_norm, self.feed_forward = RMSNorm(c["hidden"]), FeedForward(c)

        def forward(self, x, cos, sin):
            x = x + self.attention(self.attention_norm(x), cos, sin)
            return x + self.feed_forward(self.ffn_norm(x))

    class Llama(nn.Module):
        """Llama: RMSNorm, SwiGLU, grouped-query attention with rotary embeddings, no biases but an
        optional QKV bias (Qwen2), untied output unless tied."""

        def __init__(self, c, recompute: str = "none", theta: float = 10000.0):
            super().__init__()
            self.recompute = recompute
            self.tok_embeddings = nn.Embedding(c["vocabulary"], c["hidden"])
            self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c["layers"]))
            self.norm = RMSNorm(c["hidden"])
            self.output = nn.Linear(c["hidden"], c["vocabulary"], bias=False)
            self.apply(init_weights)
            if c["tied"]:
                self.output.weight = self.tok_embeddings.weight
            d = c["hidden"] // c["heads"]
            inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
            angles = torch.outer(torch.arange(c["sequence"], dtype=torch.float32), inv)
            angles = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

        def forward(self, idx, targets):
            T = idx.size(1)
            cos, sin = self.cos[:T], self.sin[:T]
            x = self.tok_embeddings(idx)
            for layer in self.layers:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False) if self.recompute == "full" \
                    else layer(x, cos, sin)
            logits = self.output(self.norm(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    return {"gpt": GPT, "llama": Llama}


def build_module(shape: dict, recompute: str = "none"):
    """The shape's module (parameters fp32, on torch's default device)."""
    _, cfg = model_config(shape)
    return modules()[shape["family"]](cfg, recompute)


# ---- measuring -----------------------------------------------------------------------------------
def one_step(torch, module, opt, x, y, device_type: str = "cuda"):
    """One training step as users write it: the forward under bf16 autocast (on CUDA), the backward, the
    optimizer's step and its gradients set to None; returns the loss."""
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
        loss = module(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def train_steps(torch, module, shape: dict, steps: int, warmup: int, device) -> dict:
    """Steps back to back on one fixed batch (fp32 parameters, bf16 autocast, fused AdamW on CUDA);
    returns the step times between CUDA events (CUDA) and the losses, first to last."""
    cuda = torch.device(device).type == "cuda"
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape["vocabulary"], (shape["micro_batch"], shape["sequence"] + 1), generator=g)
    x, y = (t.contiguous().to(device) for t in (tokens[:, :-1], tokens[:, 1:]))
    opt = torch.optim.AdamW(module.parameters(), lr=6e-4, fused=cuda)
    losses, marks = [], []

    def step():
        losses.append(one_step(torch, module, opt, x, y, torch.device(device).type).detach())

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
    for i in range(steps):
        step()
        if cuda:
            marks[i + 1].record()
    if cuda:
        torch.cuda.synchronize()
    return {"step_s": [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])],
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "losses": [float(v) for v in losses]}


def loss_check(losses: list[float]) -> str:
    """"" when every loss is finite and the last is below the first, else what is wrong."""
    if not losses or not all(math.isfinite(v) for v in losses):
        return "loss not finite"
    return "" if losses[-1] < losses[0] else f"loss did not decrease ({losses[0]:.4f} -> {losses[-1]:.4f})"


def measure(shape: dict, steps: int, warmup: int, recompute: str, device: str = "cuda") -> dict:
    import torch
    module = None
    try:
        with torch.device(device):  # parameters made and initialised on the GPU
            module = build_module(shape, recompute)
        r = train_steps(torch, module, shape, steps, warmup, device)
    except torch.cuda.OutOfMemoryError:
        return {"note": "out of memory (skipped)"}
    finally:
        del module
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"step_s": statistics.median(r["step_s"]) if r["step_s"] else None, "peak_bytes": r["peak_bytes"],
            "loss_first": r["losses"][0], "loss_last": r["losses"][-1], "note": loss_check(r["losses"])}


# ---- predicting ----------------------------------------------------------------------------------
def predict(shape: dict, profile_path: str, recompute: str) -> dict:
    """The planner's step time and peak memory of the shape on one GPU with the measured profile."""
    import numpy as np

    from calibrate.profile import Profile

    from autotune.sbp.boxing import Coster
    from autotune.sbp.cost import Problem
    from autotune.sbp.mesh import Cluster
    from autotune.plan.build import build as build_plan
    from autotune.sbp.search import auto_budget, make_search

    from autotune.sbp.memory import Mode

    kind, cfg = model_config(shape)
    graph = load_model(kind, None, cfg)
    problem = Problem(graph, Coster(Profile.load(profile_path), Cluster(1, 1)), None, require_fit=False,
                      objective="step", mode=Mode(recompute=recompute))
    best = make_search("cd").run(problem, auto_budget(problem), np.random.default_rng(0))
    costs = build_plan(problem, best.assignment, "one GPU").costs
    return {"pred_step_s": costs.step_s, "pred_bytes": costs.memory_bytes}


# ---- the table -----------------------------------------------------------------------------------
def error(measured, predicted):
    return stats.rel_err(predicted, measured)


def _f(v, scale: float, fmt: str) -> str:
    return "-" if v is None else format(v * scale, fmt)


def table(rows: list[dict]) -> str:
    """One line per shape, then the median error (signed, and of its size) per set."""
    head = ("shape", "set", "pred step ms", "step ms", "err %", "pred GiB", "GiB", "err %", "note")
    lines = [head]
    for r in rows:
        t_err, m_err = error(r.get("step_s"), r.get("pred_step_s")), error(r.get("peak_bytes"), r.get("pred_bytes"))
        r["step_err"], r["mem_err"] = t_err, m_err
        lines.append((r["id"], r["set"], _f(r.get("pred_step_s"), 1e3, ".2f"), _f(r.get("step_s"), 1e3, ".2f"),
                      _f(t_err, 100, "+.1f"), _f(r.get("pred_bytes"), 2**-30, ".2f"),
                      _f(r.get("peak_bytes"), 2**-30, ".2f"), _f(m_err, 100, "+.1f"), r.get("note", "")))
    w = [max(len(str(x[i])) for x in lines) for i in range(len(head) - 1)]
    out = ["  ".join(str(c).ljust(w[i]) if i < 2 else str(c).rjust(w[i]) for i, c in enumerate(x[:-1]))
           + (f"  {x[-1]}" if x[-1] else "") for x in lines]
    out.append("")
    for name in SETS:
        mine = [r for r in rows if r["set"] == name]
        if not mine:
            continue
        parts = []
        for key, what in (("step_err", "step time"), ("mem_err", "memory")):
            errs = [r[key] for r in mine if r[key] is not None]
            parts.append(f"{what} median {statistics.median(errs) * 100:+.1f}%, median |error| "
                         f"{statistics.median(abs(e) for e in errs) * 100:.1f}% ({len(errs)} shapes)" if errs
                         else f"{what}: no shape measured")
        out.append(f"{name}: " + "; ".join(parts))
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="transformer_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="the profile python -m calibrate compute wrote on this machine")
    ap.add_argument("--shapes", default=str(SHAPES), help="the shape declaration (default %(default)s)")
    ap.add_argument("--sets", default=",".join(SETS), help="sets to run, of development, heldout (default both)")
    ap.add_argument("--ids", default=None, help="only these shape ids, comma-separated (default all of --sets)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per shape, at least 10 (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--recompute", default="none", choices=RECOMPUTE,
                    help="full: torch.utils.checkpoint around each block, predicted as recomputation full")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.steps < 10 or args.warmup < 1:
        raise UserError("--steps must be at least 10 and --warmup at least 1")
    shapes = load_shapes(args.shapes, [s.strip() for s in args.sets.split(",") if s.strip()])
    if args.ids:
        want = {i.strip() for i in args.ids.split(",") if i.strip()}
        missing = sorted(want - {s["id"] for s in shapes})
        if missing:
            raise UserError(f"no shape {missing[0]!r} in --sets {args.sets}: use ids of {args.shapes}")
        shapes = [s for s in shapes if s["id"] in want]
    import torch
    if not torch.cuda.is_available():
        raise UserError("transformer_check.py measures a GPU but torch sees no CUDA device: run it on a GPU machine")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; shapes {args.shapes} (sha256 "
          f"{file_hash(args.shapes)}); profile {args.profile}; recompute {args.recompute}; "
          f"{args.warmup} warm-up + {args.steps} timed steps, median", flush=True)
    rows = []
    for shape in shapes:
        row = {"id": shape["id"], "set": shape["set"], "family": shape["family"]}
        try:
            row.update(predict(shape, args.profile, args.recompute))
            unpredicted = ""
        except UserError as e:
            unpredicted = f"no prediction: {e}"
        row.update(measure(shape, args.steps, args.warmup, args.recompute))
        row["note"] = "; ".join(n for n in (row.get("note", ""), unpredicted) if n)
        rows.append(row)
        print(f"  {shape['id']} ({shape['set']}): {json.dumps({k: v for k, v in row.items() if k != 'id'})}",
              flush=True)
    print(table(rows))
    if args.out:
        import datetime

        import torch

        from calibrate.measure import provenance
        from calibrate.outputs import write_atomic
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else provenance.machine()
        write_atomic(args.out, json.dumps({
            "date": datetime.date.today().isoformat(), "device": device, "commit": provenance.commit(),
            "command": provenance.command(), "shapes_sha256": file_hash(args.shapes), "profile": args.profile,
            "recompute": args.recompute, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="transformer_check"))
