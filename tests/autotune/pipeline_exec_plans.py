"""Pipelined plans and models for the pipeline execution tests: the pipeline search's plan
(``autotune.pipeline.record.pipeline_plans``) of a small GPT (the reference modules, tied embedding and
logits, learned positions) and of a small Llama (Hugging Face), a Megatron-style 3-D plan of a small GPT
without the residual stream (its stages end in the row-parallel projection's partial sum), their modules,
and one process's training as the reference."""
from __future__ import annotations

import copy
import re

from tiny_models import hf_llama

GPT = dict(kind="gpt", layers=4, hidden=32, heads=4, kv_heads=4, head_dim=8, ffn=64, sequence=8, vocabulary=48,
           batch=8, micro_batch=2, residual=True, attention="flash", bias=True, tied=True, positions="learned")
LLAMA = dict(kind="llama", layers=4, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, sequence=8,
             vocabulary=40, batch=8, micro_batch=2)
GPT_PLAIN = dict(GPT, residual=False)  # the AutoDDL graph's block: a stage's stream is fc2's output
STEPS, LR, SEED = 2, 1e-2, 0


def searched(cfg: dict, stages: int, nodes: int = 2, gpus: int = 2, schedule: str = "1f1b") -> dict:
    """The pipeline search's plan of ``cfg`` in ``stages`` stages (its plan dict, as plan.json's best)."""
    from autotune.pipeline.record import pipeline_plans
    from autotune.pipeline.search import PipelineConfig
    from autotune.sbp.mesh import Cluster
    from calibrate.profile import Profile
    from models import load_model
    graph = load_model(cfg["kind"], None, {k: v for k, v in cfg.items() if k != "kind"})
    plan, _ = pipeline_plans(graph, Cluster(nodes, gpus), Profile.load("h200-nvlink+ib400"), 80 * 2**30,
                             PipelineConfig(stages, schedule, search="cd"))
    return plan


def megatron(cfg: dict, nodes: int, gpus: int, stages: int, tensor: int, micro_batches: int,
             schedule: str = "1f1b") -> dict:
    """The Megatron-style 3-D plan (``autotune.pipeline.threed``) of ``cfg`` in ``stages`` stages of whole nodes
    with t = ``tensor`` and ``micro_batches`` under ``schedule``, as the plan record writes it."""
    from autotune.pipeline import threed
    from autotune.pipeline.record import pipeline_plan
    from autotune.pipeline.search import PipelineConfig, PipelineSearch
    from autotune.sbp.mesh import Cluster
    from calibrate.profile import Profile
    from models import load_model
    graph = load_model(cfg["kind"], None, {k: v for k, v in cfg.items() if k != "kind"})
    search = PipelineSearch(graph, Cluster(nodes, gpus), Profile.load("h200-nvlink+ib400"), 80 * 2**30,
                            PipelineConfig(stages, schedule))
    # this (t, m)'s candidate simulated here: ``threed.finished`` keeps only those that can be the fastest
    c = search.finish(next(c for c in threed.candidates(search)
                           if c.tensor == tensor and c.micro_batches == micro_batches))
    return pipeline_plan(search, c, c.name)


def rerouted(plan: dict, stage: int, route: str, sent: list) -> dict:
    """``plan`` with stage ``stage``'s boundary run by ``route``, its tiles crossing in ``sent``."""
    out = copy.deepcopy(plan)
    out["stages"][stage].update(boundary_route=route, boundary_sent=list(sent))
    return out


def restage(plan: dict, stage: int, rewrite) -> dict:
    """``plan`` with stage ``stage``'s layers' placements rewritten: ``rewrite(layer name, key, text)`` gives
    the new SBP text of the layer's input, output or a weight."""
    out = copy.deepcopy(plan)
    for lay in out["stages"][stage]["plan"]["layers"]:
        sbp = lay["sbp"]
        for key in ("input", "output"):
            if key in sbp:
                sbp[key] = rewrite(lay["name"], key, sbp[key])
        sbp["weights"] = {w: rewrite(lay["name"], w, t) for w, t in sbp.get("weights", {}).items()}
    return out


def replicated(name: str, key: str, text: str) -> str:
    """Every split and partial sum made replication: the stage runs the whole micro-batch on each device."""
    return re.sub(r"\b(S\d|P):", "B:", text)


def make_model(cfg: dict):
    if cfg["kind"] == "gpt":
        from models.modules import build
        return build(cfg, seed=SEED).double()
    return hf_llama(cfg, SEED)


def batch(cfg: dict):
    """(ids, targets) of the whole batch, the same every step."""
    import torch
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, cfg["vocabulary"], (cfg["batch"], cfg["sequence"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def logits_of(model, ids):
    return model(ids) if hasattr(model, "plan_mapping") else model(input_ids=ids, use_cache=False).logits


def train_one_process(cfg: dict, micro_batches: int) -> tuple[list, dict]:
    """STEPS Adam steps of the whole model in one process, the batch in ``micro_batches``: (losses, parameters)."""
    import torch
    model = make_model(cfg)
    ids, targets = batch(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for x, y in zip(ids.chunk(micro_batches), targets.chunk(micro_batches)):
            logits = logits_of(model, x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            (loss / micro_batches).backward()
            total += loss.item() / micro_batches
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def sharded(plan: dict, stage: int, axes=(0,)) -> dict:
    """``plan`` with stage ``stage``'s weights sharded (FSDP mode) over ``axes``: a data-parallel stage becomes
    the FSDP plan that fully_shard runs."""
    out = copy.deepcopy(plan)
    entry = out["stages"][stage]["plan"]
    entry["sharding"] = {"mode": "fsdp", "axes": list(axes)}
    return out


def in_micro_batches(plan: dict, m: int) -> dict:
    """``plan`` run in ``m`` micro-batches of the same batch (its model's micro-batch, each stage's count)."""
    out = copy.deepcopy(plan)
    mb = out["model"]["batch"] // m
    out["pipeline"]["micro_batches"] = m
    out["model"]["micro_batch"] = mb
    for s in out["stages"]:
        s["plan"]["micro_batches"] = m
        s["plan"]["model"]["micro_batch"] = mb
    return out


def first_gradients(cfg: dict, micro_batches: int) -> dict:
    """The gradients of the first step's mean loss in one process, by parameter name."""
    model = make_model(cfg)
    ids, targets = batch(cfg)
    import torch
    for x, y in zip(ids.chunk(micro_batches), targets.chunk(micro_batches)):
        logits = logits_of(model, x)
        (torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) / micro_batches).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def column_embedding(plan: dict) -> dict:
    """``plan`` with its first stage's embedding split by features on the stage's one axis (its table's columns,
    the whole micro-batch looked up there; the searched plans of a 1.1 B Llama on 2 x 2 H100s have it), as the
    search writes it."""
    out = copy.deepcopy(plan)
    lay = out["stages"][0]["plan"]["layers"][0]
    assert lay["name"] == "embedding"
    lay["mesh"] = [[1, 1], [1, 2], [1, 1]]
    lay["sbp"] = {"output": "(S0: (1, 1), S1: (1, 2), P: (1, 1))",
                  "weights": {"weight": "(B: (1, 1), S1: (1, 2), S0: (1, 1))"}}
    return out


def vocabulary_head(plan: dict) -> dict:
    """``plan`` with its last stage's logits split by vocabulary on the stage's one axis (their weight's rows,
    the stream gathered whole before them) and its loss vocabulary-parallel, as the search writes the
    searched 2 x 2 plan of a 1.1 B Llama."""
    out = copy.deepcopy(plan)
    layers = {lay["name"]: lay for lay in out["stages"][-1]["plan"]["layers"]}
    layers["logits"]["mesh"] = [[1, 1], [1, 2], [1, 1]]
    layers["logits"]["sbp"] = {"input": "(S0: (1, 1), B: (1, 2), S1: (1, 1))",
                               "output": "(S0: (1, 1), S1: (1, 2), P: (1, 1))",
                               "weights": {"weight": "(B: (1, 1), S1: (1, 2), S0: (1, 1))"}}
    layers["loss"]["mesh"] = [[1, 1], [1, 2]]
    layers["loss"]["sbp"] = {"input": "(S0: (1, 1), S1: (1, 2))", "weights": {}}
    return out


def vocabulary_parallel(plan: dict) -> bool:
    """Whether ``plan``'s last stage splits its logits by vocabulary (``vocabulary_head``)."""
    logits = next(lay for lay in plan["stages"][-1]["plan"]["layers"] if lay["name"] == "logits")
    return "S1: (1, 2)" in logits["sbp"]["weights"]["weight"]
