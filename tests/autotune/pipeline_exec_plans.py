"""Pipelined plans and models for the pipeline execution tests: the pipeline search's plan
(``autotune.pipeline.record.pipeline_plans``) of a small GPT (the reference modules, tied embedding and
logits, learned positions) and of a small Llama (Hugging Face), a Megatron-style 3-D plan of a small GPT
without the residual stream (its stages end in the row-parallel projection's partial sum), their modules,
and one process's training as the reference."""
from __future__ import annotations

from dataclasses import replace

from tiny_models import hf_llama

GPT = dict(kind="gpt", layers=4, hidden=32, heads=4, kv_heads=4, head_dim=8, ffn=64, sequence=8, vocabulary=48,
           batch=8, micro_batch=2, residual=True, attention="flash", bias=True, tied=True, positions="learned")
LLAMA = dict(kind="llama", layers=4, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, sequence=8,
             vocabulary=40, batch=8, micro_batch=2)
GPT_PLAIN = dict(GPT, residual=False)  # the AutoDDL graph's block: a stage's stream is fc2's output
STEPS, LR, SEED = 2, 1e-2, 0


def searched(cfg: dict, stages: int, nodes: int = 2, gpus: int = 2, schedule: str = "1f1b"):
    """The pipeline search's plan of ``cfg`` in ``stages`` stages (a pipelined Plan, as plan.json's best)."""
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
             schedule: str = "1f1b", sequence_parallel: bool = False) -> dict:
    """The Megatron-style 3-D plan (``autotune.pipeline.threed``) of ``cfg`` in ``stages`` stages of whole nodes
    with t = ``tensor`` and ``micro_batches`` under ``schedule`` (with ``sequence_parallel``: Megatron-LM's
    --sequence-parallel, the stages' plans made so), as the plan record writes it."""
    from autotune.pipeline import threed
    from autotune.pipeline.record import pipeline_plan
    from autotune.pipeline.search import PipelineConfig, PipelineSearch, submesh
    from autotune.sbp.memory import NONE
    from autotune.sbp.mesh import Cluster
    from calibrate.profile import Profile
    from models import load_model
    graph = load_model(cfg["kind"], None, {k: v for k, v in cfg.items() if k != "kind"})
    search = PipelineSearch(graph, Cluster(nodes, gpus), Profile.load("h200-nvlink+ib400"), 80 * 2**30,
                            PipelineConfig(stages, schedule))
    if sequence_parallel:
        sub = submesh(search.cluster, stages)
        plans = threed.stage_plans(search, stages, sub, micro_batches, ((sub.nodes, gpus // tensor), (1, tensor)),
                                   NONE, True)
        c = search.candidate(stages, sub, micro_batches, search.balanced(stages), plans,
                             name=f"Megatron 3-D (t={tensor}, sequence parallel)")
    else:  # this (t, m)'s candidate simulated here: ``threed.finished`` keeps only those that can be the fastest
        c = next(c for c in threed.candidates(search) if c.tensor == tensor and c.micro_batches == micro_batches)
    c = search.finish(c)
    return pipeline_plan(search, c, c.name)


def _restaged(plan, stage: int, **fields):
    """``plan`` with stage ``stage``'s plan's ``fields`` replaced."""
    stages = list(plan.stages)
    stages[stage] = replace(stages[stage], plan=replace(stages[stage].plan, **fields))
    return replace(plan, stages=tuple(stages))


def rerouted(plan, stage: int, route: str, sent: list):
    """``plan`` with stage ``stage``'s boundary run by ``route``, its tiles crossing in ``sent``."""
    stages = list(plan.stages)
    stages[stage] = replace(stages[stage], boundary_route=route, boundary_sent=tuple(sent))
    return replace(plan, stages=tuple(stages))


def _relaid(lay, rewrite):
    """A layer with its placements rewritten: ``rewrite(layer name, key, placements)`` gives the new placements
    of its input, output or a weight (key: the weight's name)."""
    return replace(lay, input=lay.input and rewrite(lay.name, "input", lay.input),
                   output=lay.output and rewrite(lay.name, "output", lay.output),
                   weights=tuple(replace(w, placements=rewrite(lay.name, w.name, w.placements)) for w in lay.weights))


def restage(plan, stage: int, rewrite):
    """``plan`` with stage ``stage``'s layers' placements rewritten (``_relaid``)."""
    return _restaged(plan, stage, layers=tuple(_relaid(lay, rewrite) for lay in plan.stages[stage].plan.layers))


def replicated(name: str, key: str, fine: tuple) -> tuple:
    """Every split and partial sum made replication: the stage runs the whole micro-batch on each device."""
    return ("B",) * len(fine)


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


def adam_steps(pipe, cfg: dict, before=None) -> list[float]:
    """STEPS Adam steps of a pipeline's stage (``autotune.apply_pipeline``) on the whole batch: each step's loss
    (``before()`` called before each step)."""
    import torch
    opt = torch.optim.Adam(pipe.module.parameters(), lr=LR)
    ids, targets = batch(cfg)
    losses = []
    for _ in range(STEPS):
        if before is not None:
            before()
        losses.append(float(pipe.step(ids, targets)))
        opt.step()
        opt.zero_grad()
    return losses


def sharded(plan, stage: int, axes=(0,)):
    """``plan`` with stage ``stage``'s weights sharded (FSDP mode) over ``axes``: a data-parallel stage becomes
    the FSDP plan that fully_shard runs."""
    return _restaged(plan, stage, sharding_mode="fsdp", sharding_axes=tuple(axes))


def in_micro_batches(plan, m: int):
    """``plan`` run in ``m`` micro-batches of the same batch (its model's micro-batch, each stage's count)."""
    mb = plan.model.get("batch") // m

    def model(p):
        return replace(p.model, config=dict(p.model.config, micro_batch=mb))
    stages = tuple(replace(s, plan=replace(s.plan, micro_batches=m, model=model(s.plan))) for s in plan.stages)
    return replace(plan, micro_batches=m, model=model(plan), stages=stages)


def first_gradients(cfg: dict, micro_batches: int) -> dict:
    """The gradients of the first step's mean loss in one process, by parameter name."""
    model = make_model(cfg)
    ids, targets = batch(cfg)
    import torch
    for x, y in zip(ids.chunk(micro_batches), targets.chunk(micro_batches)):
        logits = logits_of(model, x)
        (torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) / micro_batches).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _columns(plan, stage: int) -> tuple:
    return ("S1",) * len(plan.stages[stage].plan.mesh.sizes)


def column_embedding(plan):
    """``plan`` with its first stage's embedding split by features on the stage's axes (its table's columns,
    the whole micro-batch looked up there; the searched plans of a 1.1 B Llama on 2 x 2 H100s have it), as the
    search places it."""
    cols = _columns(plan, 0)

    def relaid(lay):  # the token table alone by columns (a learned positions table left out of the plan)
        return lay if lay.name != "embedding" else \
            replace(lay, output=cols, weights=(replace(lay.weight("weight"), placements=cols),))
    return _restaged(plan, 0, layers=tuple(relaid(lay) for lay in plan.stages[0].plan.layers))


def vocabulary_head(plan):
    """``plan`` with its last stage's logits split by vocabulary on the stage's axes (their weight's rows,
    the stream gathered whole before them) and its loss vocabulary-parallel, as the search places the
    searched 2 x 2 plan of a 1.1 B Llama."""
    cols = _columns(plan, -1)

    def rewrite(name, key, fine):
        if name == "logits":
            return ("B",) * len(cols) if key == "input" else cols
        return cols if name == "loss" and key == "input" else fine
    return restage(plan, len(plan.stages) - 1, rewrite)


def vocabulary_parallel(plan) -> bool:
    """Whether ``plan``'s last stage splits its logits by vocabulary (``vocabulary_head``)."""
    logits = plan.stages[-1].plan.layer("logits")
    return logits.weight("weight").placements == _columns(plan, -1)


def stage_parameters(module, names: dict) -> dict:
    """A pipeline stage's parameters whole (a DTensor's gathered), by the model's names (``names``: id of each of
    the model's modules -> its name)."""
    from torch.distributed.tensor import DTensor
    params = {}
    for _, m in module.named_modules():
        for pn, p in m.named_parameters(recurse=False):
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            params[f"{names[id(m)]}.{pn}".lstrip(".")] = whole.detach().clone()
    return params


def check_ranks(problems: list, bug, results: list, k: int, trained, label: str) -> None:
    """Job ``k`` of a pipelined run checked on every rank (``problems``: each rank's mismatch with one process, or
    None): a planted ``bug`` noticed on some rank; else no rank differs, and every parameter of ``trained`` was
    trained by some stage (each rank's result: (losses, its stage's parameters by name, ...))."""
    if bug:
        assert any(problems), f"{label}: the planted bug {bug!r} went unnoticed"
        return
    assert not any(problems), f"{label}: {[p for p in problems if p]}"
    seen = {name for got in results for name in got[k][1]}
    assert seen == set(trained), f"parameters no stage trained: {sorted(set(trained) - seen)}"
