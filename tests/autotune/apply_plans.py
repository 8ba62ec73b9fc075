"""Typed plans written by hand for the contract's transformer layers (embedding, ln1, qkv, attention, proj,
residual, ln2, fc1, gelu|swiglu, fc2, ln_f, logits, loss), the test models (a tiny Hugging Face Llama and a
nanoGPT-style module) and their single-process reference. Shared by the apply tests."""
from __future__ import annotations

import math

import numpy as np

from autotune.plan import FineMesh, LayerPlan, ModelSpec, TypedPlan, WeightPlan
from autotune.sbp.mesh import Cluster

LLAMA = dict(kind="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, sequence=8,
             vocabulary=64, batch=8, micro_batch=4)
GPT = dict(kind="gpt", layers=2, hidden=32, heads=4, kv_heads=4, head_dim=8, ffn=128, sequence=8,
           vocabulary=48, batch=8, micro_batch=4)


def searched(cfg: dict, nodes: int, gpus: int, steps: int = 200, fsdp_axes: tuple[int, ...] | None = None,
             tied: bool = False) -> TypedPlan:
    """The SBP search's plan (over its recomputation and FSDP modes; in FSDP over ``fsdp_axes`` without
    recomputation where given) for ``cfg``'s graph (models/), through the typed plan's converter; a gpt's logits
    ``tied`` to its embedding (GPT-2's) or not (the nanoGPT-style module's)."""
    from autotune.plan import load_plan
    from autotune.sbp.boxing import Coster
    from autotune.sbp.cost import Problem
    from autotune.sbp.fit import search_modes
    from autotune.plan.build import build as build_plan
    from autotune.sbp.search import Budget, make_search
    from calibrate.profile import Profile
    from models import load_model
    fields = {k: v for k, v in cfg.items() if k != "kind"}
    if cfg["kind"] == "gpt":  # the nanoGPT-style module: a modern GPT with learned positions, untied logits
        fields.update(residual=True, attention="flash", bias=True, tied=tied, positions="learned")
    problem = Problem(load_model(cfg["kind"], None, fields), Coster(Profile.load("h200-nvlink+ib400"),
                                                                    Cluster(nodes, gpus)), require_fit=False)
    if fsdp_axes is not None:
        from autotune.sbp.memory import Mode
        problem = problem.with_mode(Mode("none", fsdp_axes))
        res = make_search("cd").run(problem, Budget(steps=steps), np.random.default_rng(0))
    else:
        problem, res = search_modes(problem, lambda pr, start, share=1.0: make_search("cd").run(
            pr, Budget(steps=steps), np.random.default_rng(0)))
    return load_plan(build_plan(problem, res.assignment, "searched"))


def megatron_baseline(cfg: dict, d: tuple, t: tuple, cluster: tuple = (1, 4), sequence_parallel: bool = False,
                      fsdp_axes: tuple[int, ...] | None = None) -> TypedPlan:
    """The search's Megatron baseline on ``cluster`` (nodes, GPUs) with mesh (d, t) (sizes per role on (nodes,
    GPUs)): its residual stream split by features on the tensor-parallel axes; with ``sequence_parallel``
    Megatron-LM's (the norms and the stream split by tokens there), FSDP over ``fsdp_axes`` where given."""
    from autotune.plan import load_plan
    from autotune.sbp.baselines import megatron_assignment
    from autotune.sbp.boxing import Coster
    from autotune.sbp.cost import Problem
    from autotune.sbp.memory import Mode
    from autotune.plan.build import build as build_plan
    from calibrate.profile import Profile
    from models import load_model
    fields = {k: v for k, v in cfg.items() if k != "kind"}
    if cfg["kind"] == "gpt":
        fields.update(residual=True, attention="flash", bias=True, tied=False, positions="learned")
    problem = Problem(load_model(cfg["kind"], None, fields), Coster(Profile.load("h200-nvlink+ib400"),
                                                                    Cluster(*cluster)), require_fit=False,
                      runnable=not sequence_parallel)
    if fsdp_axes is not None:
        problem = problem.with_mode(Mode("none", fsdp_axes))
    name = f"Megatron d={d} t={t}" + (", sequence parallel" if sequence_parallel else "")
    return load_plan(build_plan(problem, megatron_assignment(problem, d, t, sequence_parallel=sequence_parallel),
                                name))


def layer_table(cfg: dict) -> list[tuple[str, str, dict, dict]]:
    """(name, kind, dims, {weight: shape}) of each distinct layer, in chain order."""
    t = cfg["micro_batch"] * cfg["sequence"]
    h, v, f, hd = cfg["hidden"], cfg["vocabulary"], cfg["ffn"], cfg["head_dim"]
    heads, kv = cfg["heads"], cfg["kv_heads"]
    llama = cfg["kind"] == "llama"
    norm = ("rmsnorm", (h,)) if llama else ("layernorm", (2, h))
    qkv_n = (heads + 2 * kv) * hd
    act = ("swiglu", f) if llama else ("pointwise", f)
    fc1_n = 2 * f if llama else f
    return [
        ("embedding", "embedding", dict(tokens=t, k=v, n=h), {"weight": (v, h)}),
        ("ln1", norm[0], dict(tokens=t, hidden=h), {"weight": norm[1]}),
        ("qkv", "matmul", dict(tokens=t, k=h, n=qkv_n), {"weight": (h, qkv_n)}),
        ("attention", "attention", dict(tokens=t, hidden=heads * hd, heads=heads, kv_heads=kv, head_dim=hd,
                                        micro_batch=cfg["micro_batch"]), {}),
        ("proj", "matmul", dict(tokens=t, k=heads * hd, n=h), {"weight": (heads * hd, h)}),
        ("residual", "residual", dict(tokens=t, hidden=h), {}),
        ("ln2", norm[0], dict(tokens=t, hidden=h), {"weight": norm[1]}),
        ("fc1", "matmul", dict(tokens=t, k=h, n=fc1_n), {"weight": (h, fc1_n)}),
        (act[0] if llama else "gelu", act[0], dict(tokens=t, hidden=act[1]), {}),
        ("fc2", "matmul", dict(tokens=t, k=f, n=h), {"weight": (f, h)}),
        ("ln_f", norm[0], dict(tokens=t, hidden=h), {"weight": norm[1]}),
        ("logits", "matmul", dict(tokens=t, k=h, n=v), {"weight": (h, v)}),
        ("loss", "loss", dict(tokens=t, vocabulary=v), {}),
    ]


def typed_plan(cfg: dict, nodes: int, gpus: int, placements: dict, strategy: str, recompute: str = "none",
               fsdp_axes: tuple[int, ...] = ()) -> TypedPlan:
    """A TypedPlan from {layer name: (input, output, {weight: placements})} (fine-axis placements)."""
    cluster = Cluster(nodes, gpus)
    layers = []
    for name, kind, dims, weights in layer_table(cfg):
        i, o, w = placements[name]
        count = 2 * cfg["layers"] if kind == "residual" else cfg["layers"] if name not in (
            "embedding", "ln_f", "logits", "loss") else 1
        layers.append(LayerPlan(name, kind, count, dims, "hand", i, o,
                                tuple(WeightPlan(n, s, tuple(w[n])) for n, s in weights.items())))
    model = {k: v for k, v in cfg.items() if k != "kind"}
    return TypedPlan(ModelSpec(cfg["kind"], model), cluster, FineMesh.of(cluster), tuple(layers),
                     micro_batches=cfg["batch"] // cfg["micro_batch"], recompute=recompute,
                     sharding_mode="fsdp" if fsdp_axes else "none", sharding_axes=fsdp_axes, strategy=strategy)


def data_parallel(cfg: dict, axes: int = 2) -> dict:
    s0, b = ("S0",) * axes, ("B",) * axes
    return {name: (s0 if kind != "embedding" else None, s0 if kind != "loss" else None,
                   {w: b for w in weights}) for name, kind, _, weights in layer_table(cfg)}


def tp_data(cfg: dict, axes: int = 2, tp: int = 1) -> dict:
    """The first ``axes - tp`` axes split the data, the last ``tp`` are Megatron's tensor parallelism (column
    then row parallel, the embedding vocabulary-parallel)."""
    act = "swiglu" if cfg["kind"] == "llama" else "gelu"
    d = axes - tp

    def f(data, model):
        return (data,) * d + (model,) * tp
    col, row, rep, data = f("S0", "S1"), f("S0", "P"), ("B",) * axes, f("S0", "B")
    w_col, w_row = f("B", "S1"), f("B", "S0")
    return {
        "embedding": (None, row, {"weight": w_row}),
        "ln1": (data, data, {"weight": rep}),
        "qkv": (data, col, {"weight": w_col}),
        "attention": (col, col, {}),
        "proj": (col, row, {"weight": w_row}),
        "residual": (data, data, {}),
        "ln2": (data, data, {"weight": rep}),
        "fc1": (data, col, {"weight": w_col}),
        act: (col, col, {}),
        "fc2": (col, row, {"weight": w_row}),
        "ln_f": (data, data, {"weight": rep}),
        "logits": (data, col, {"weight": w_col}),
        "loss": (col, None, {}),
    }


def vocab_parallel(cfg: dict) -> dict:
    """Megatron's tensor parallelism on fine axis 1 (``tp_data``), and the embedding's and the logits' weights
    split by vocabulary over both fine axes (all four devices): the embedding's output a partial sum on both,
    the logits split by vocabulary on both."""
    out = tp_data(cfg)
    out["embedding"] = (None, ("P", "P"), {"weight": ("S0", "S0")})
    out["logits"] = (("B", "B"), ("S1", "S1"), {"weight": ("S1", "S1")})
    out["loss"] = (("S1", "S1"), None, {})
    return out


def random_partial(cfg: dict, mesh: tuple[int, ...], seed: int) -> dict:
    """Random placements that keep the inline layers computable on local pieces (attention split by batch or
    whole KV groups, activation functions and norms never given partial sums, the residual stream in one
    placement, possibly P), with at least one partial sum among the activations."""
    rng = np.random.default_rng(seed)
    while True:
        out, partial = {}, False
        for name, kind, dims, weights in layer_table(cfg):
            def pick(options, shape=None, dim_of=None):
                while True:
                    fine = tuple(str(rng.choice(options)) for _ in mesh)
                    if shape is None or _divides(shape, fine, mesh):
                        return fine
            w = {n: pick(["S0", "S1", "B"], s) for n, s in weights.items()}
            if name == "qkv":
                parts = math.prod(n for p, n in zip(w["weight"], mesh) if p == "S1")
                if cfg["kv_heads"] % parts:
                    w["weight"] = tuple("B" if p == "S1" else p for p in w["weight"])
            if kind == "attention":
                fine = pick(["S0", "S1", "B"])
                while (math.prod(n for p, n in zip(fine, mesh) if p == "S1") > cfg["kv_heads"] or
                       cfg["kv_heads"] % math.prod(n for p, n in zip(fine, mesh) if p == "S1")):
                    fine = pick(["S0", "S1", "B"])
                i = o = fine
            elif kind in ("swiglu", "pointwise"):
                i = o = pick(["S0", "S1", "B"])
            elif kind == "residual":
                i = o = pick(["S0", "S1", "B", "P"])
            elif kind == "embedding":
                i, o = None, pick(["S0", "S1", "B", "P"])
            elif kind == "matmul":  # linear in its input: a partial input stays partial
                i, o = pick(["S0", "S1", "B", "P"]), pick(["S0", "S1", "B", "P"])
            else:  # norms, the loss: never a partial input
                i, o = pick(["S0", "S1", "B"]), pick(["S0", "S1", "B", "P"])
            partial |= "P" in (i or ()) and kind != "loss"
            out[name] = (i, o, w)
        if partial:
            return out


def _divides(shape, fine, mesh) -> bool:
    for d in range(len(shape)):
        n = math.prod(size for p, size in zip(fine, mesh) if p == f"S{d}")
        if shape[d] % n:
            return False
    return all(int(p[1:]) < len(shape) for p in fine if p[0] == "S")
