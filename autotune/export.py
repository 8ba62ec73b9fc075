"""A plan as the configuration of a training framework: torchtitan's job config (TOML) or
Megatron-LM's command-line flags.

    from autotune.export import export
    from autotune.sbp.plan import PlanFile
    print(export(PlanFile.load("autotune-out/plan.json"), "megatron").text)

Both tools take a few degrees and flags, not per-layer placements. ``layout`` reads them off a plan:
the fine axes on which most matmul layers split a weight are its tensor-parallel axes, the others
its data-parallel axes (of which the FSDP ones, ``plan["sharding"]``, shard the weights); norms
whose input is split along tokens over the tensor axes mean sequence parallelism; ``stages`` give
the pipeline degree and ``recompute`` the activation checkpointing. The tools' own names:

- torchtitan (``torchtitan/config/job_config.py``): ``[parallelism]`` ``data_parallel_replicate_degree``,
  ``data_parallel_shard_degree`` (FSDP; both > 1 is HSDP), ``tensor_parallel_degree`` (its tensor
  parallelism always shards the norms' sequence: sequence parallel is implied),
  ``pipeline_parallel_degree``, ``pipeline_parallel_microbatch_size``; ``[activation_checkpoint]``
  ``mode`` ("none" | "selective" | "full"), ``selective_ac_option``; ``[training]``
  ``local_batch_size``, ``global_batch_size``, ``seq_len``. Its device mesh nests pp, dp_replicate,
  dp_shard, tp from the outside in.
- Megatron-LM (``megatron/training/arguments.py``): ``--tensor-model-parallel-size``,
  ``--pipeline-model-parallel-size`` (data parallelism is what is left of the world),
  ``--sequence-parallel``, ``--recompute-granularity`` (full | selective),
  ``--recompute-method`` (uniform | block), ``--recompute-num-layers``,
  ``--micro-batch-size`` (per data-parallel rank), ``--global-batch-size``, ``--seq-length``; FSDP
  (ZeRO-3) as Megatron-FSDP: ``--use-megatron-fsdp --data-parallel-sharding-strategy
  optim_grads_params --use-distributed-optimizer`` (the distributed optimizer alone shards only the
  optimizer state, which a plan without FSDP does not price, so it is not emitted then).
  Tensor-parallel ranks are adjacent ranks.

What a tool cannot express (placements of some layers that differ from its fixed Megatron-style
scheme, tensor axes that are not the innermost ranks, FSDP over part of the data axes, ...) is
listed, with the predicted figures of the nearest plan it can express: the baseline row of the
plan file with the plan's degrees (Megatron (d, t), data parallel, or an FSDP baseline), else the
fastest such baseline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from calibrate.errors import OptionError, UserError

from autotune.sbp.mesh import Cluster
from autotune.sbp.plan import PlanFile
from autotune.sbp.sbp import B, is_split, parse, split_dim

TARGETS = ("torchtitan", "megatron")
# baselines that a framework runs as they are (by the start of their strategy name)
EXPRESSIBLE = ("data parallel", "megatron", "fsdp", "hsdp", "tp+fsdp")
RECOMPUTE = ("none", "selective", "full")
NORMS = ("layernorm", "rmsnorm")


@dataclass(frozen=True)
class Layout:
    """A plan's parallelism as the frameworks count it."""

    data: int  # data-parallel degree (all data axes, FSDP ones included)
    fsdp: int  # of which sharded (FSDP / ZeRO-3)
    tensor: int
    pipeline: int
    sequence_parallel: bool
    recompute: str
    micro_batch: int  # per data-parallel rank
    global_batch: int
    sequence: int
    tensor_axes: tuple[int, ...]
    fsdp_axes: tuple[int, ...]

    @property
    def replicate(self) -> int:
        return self.data // self.fsdp


@dataclass(frozen=True)
class Export:
    target: str
    strategy: str
    layout: Layout
    config: str  # the TOML or the flags
    cannot: tuple[str, ...]  # what the target cannot express of the plan
    nearest: dict | None  # the baseline it runs as is: strategy and predicted totals

    @property
    def text(self) -> str:
        """The config with what it cannot express as comment lines."""
        note = "#"
        lines = [f"{note} {self.target} config for plan {self.strategy!r} (python -m autotune export)"]
        if self.cannot:
            lines.append(f"{note} {self.target} cannot express this plan exactly:")
            lines += [f"{note}   - {c}" for c in self.cannot]
        else:
            lines.append(f"{note} {self.target} expresses this plan exactly")
        if self.nearest:
            n = self.nearest
            lines.append(f"{note} nearest plan it can express: {n['strategy']!r}, predicted {_fmt(n.get('step_s'))} s/step "
                         f"({_fmt(n.get('total_s'))} s/step in collectives, {_gib(n.get('memory_bytes'))} GiB per device"
                         f"{'' if n.get('fits_memory', True) else ', over the memory limit'})")
        return "\n".join(lines + [self.config]) + "\n"


def _fmt(x) -> str:
    return "?" if x is None else f"{x:.4g}"


def _gib(x) -> str:
    return "?" if x is None else f"{x / 2**30:.2f}"


def _cluster(plan: dict) -> Cluster:
    try:
        c = plan["cluster"]
        return Cluster(int(c["nodes"]), int(c["gpus_per_node"]))
    except (KeyError, TypeError, ValueError):
        raise UserError("the plan has no cluster section: re-run the search (python -m autotune --out DIR)") from None


def _fine(plan: dict, cluster: Cluster) -> list[dict]:
    """Per layer: name, kind, count, and the fine placements of its input, output and weights."""
    out = []
    for lay in plan.get("layers") or []:
        try:
            sbp = lay["sbp"]
            entry = {"name": lay["name"], "kind": lay["kind"], "count": int(lay.get("count", 1)),
                     "input": parse(sbp["input"], cluster).fine(cluster) if "input" in sbp else None,
                     "output": parse(sbp["output"], cluster).fine(cluster) if "output" in sbp else None,
                     "weights": {n: parse(t, cluster).fine(cluster) for n, t in sbp.get("weights", {}).items()}}
        except (KeyError, TypeError, AttributeError):
            raise UserError(f"a layer of plan {plan.get('strategy', '')!r} lacks name, kind or sbp: re-run the search") from None
        out.append(entry)
    if not out:
        raise UserError(f"plan {plan.get('strategy', '')!r} has no layers: give a plan.json written by python -m autotune")
    return out


def _stage_plan(plan: dict) -> dict:
    stages = plan.get("stages")
    if not stages:
        return plan
    first = stages[0].get("plan") if isinstance(stages[0], dict) else None
    if not isinstance(first, dict):
        raise UserError("the plan's stages carry no plan of their own: re-run the search")
    return {**{k: plan[k] for k in ("cluster", "model", "recompute", "sharding") if k in plan}, **first}


def layout(plan: dict) -> Layout:
    """The degrees and flags of a plan (the first stage's placements for a pipelined plan)."""
    pipeline = len(plan.get("stages") or []) or 1
    inner = _stage_plan(plan)
    cluster = _cluster(inner)
    layers = _fine(inner, cluster)
    n = len(cluster.axis_sizes)
    votes, total = [0] * n, 0
    for lay in layers:
        if lay["kind"] != "matmul":
            continue
        total += lay["count"]
        for a in range(n):
            if any(is_split(f[a]) for f in lay["weights"].values()):
                votes[a] += lay["count"]
    tensor_axes = tuple(a for a in range(n) if total and 2 * votes[a] > total)
    data_axes = [a for a in range(n) if a not in tensor_axes]
    sharding = inner.get("sharding") or {"mode": "none", "axes": []}
    if not isinstance(sharding, dict) or sharding.get("mode", "none") not in ("none", "fsdp"):
        raise UserError(f"the plan's sharding {sharding!r} is not none or fsdp: re-run the search")
    fsdp_axes = tuple(sorted(int(a) for a in sharding.get("axes", []))) if sharding.get("mode") == "fsdp" else ()
    recompute = inner.get("recompute", "none")
    if recompute not in RECOMPUTE:
        raise UserError(f"the plan's recompute {recompute!r} is not one of {', '.join(RECOMPUTE)}: re-run the search")
    norms = [lay for lay in layers if lay["kind"] in NORMS and lay["input"] is not None]
    sp = bool(tensor_axes) and bool(norms) and sum(
        lay["count"] for lay in norms if all(lay["input"][a] == "S0" for a in tensor_axes)) * 2 > sum(
        lay["count"] for lay in norms)
    model = plan.get("model") or {}
    data = math.prod(cluster.axis_sizes[a] for a in data_axes)  # a pipelined plan: its first stage's submesh
    micro, batch, seq = model.get("micro_batch"), model.get("batch"), model.get("sequence", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (micro, batch, seq)):
        raise UserError(f"the plan's model has micro_batch {micro!r}, batch {batch!r}, sequence {seq!r}; each must be "
                        f"a positive integer: re-run the search")
    return Layout(data=data, fsdp=math.prod(cluster.axis_sizes[a] for a in fsdp_axes),
                  tensor=math.prod(cluster.axis_sizes[a] for a in tensor_axes), pipeline=pipeline,
                  sequence_parallel=sp, recompute=recompute, micro_batch=max(micro // data, 1),
                  global_batch=batch, sequence=seq, tensor_axes=tensor_axes, fsdp_axes=fsdp_axes)


def _expressible(plan: dict) -> bool:
    return plan.get("strategy", "").lower().startswith(EXPRESSIBLE)


def _placements(lay: dict) -> str:
    def f(t):
        return "(" + ", ".join(t) + ")"
    parts = [f"{k} {f(lay[k])}" for k in ("input", "output") if lay[k] is not None]
    return ", ".join(parts + [f"{n} {f(t)}" for n, t in lay["weights"].items()])


def _layer_differences(plan: dict, other: dict) -> list[str]:
    mine, theirs = _fine(plan, _cluster(plan)), {lay["name"]: lay for lay in _fine(other, _cluster(other))}
    out = []
    for lay in mine:
        ref = theirs.get(lay["name"])
        if ref is None:
            out.append(f"layer {lay['name']}: no such layer in {other.get('strategy', '')!r}")
        elif (lay["input"], lay["output"], lay["weights"]) != (ref["input"], ref["output"], ref["weights"]):
            out.append(f"layer {lay['name']} (x{lay['count']}): {_placements(lay)} on the fine axes, where "
                       f"{other.get('strategy', '')!r} has {_placements(ref)}")
    return out


def nearest(pf: PlanFile, plan: dict) -> dict | None:
    """The baseline of the plan file that a framework runs as is, with the plan's degrees if there is
    one, else the fastest that fits (None: the file has none)."""
    pool = [b for b in [pf.best] + list(pf.baselines) if _expressible(b)]
    if not pool:
        return None
    if _expressible(plan):
        return plan
    mine = layout(plan)
    key = (mine.data, mine.tensor, mine.fsdp, mine.pipeline)
    same = [b for b in pool if (lambda lo: (lo.data, lo.tensor, lo.fsdp, lo.pipeline))(layout(b)) == key]
    fits = [b for b in (same or pool) if (b.get("totals") or {}).get("fits_memory", True)] or (same or pool)
    return min(fits, key=lambda b: (b.get("totals") or {}).get("step_s", math.inf))


def cannot_express(target: str, plan: dict, lo: Layout, near: dict | None) -> list[str]:
    """What of ``plan`` the target's fixed scheme cannot express."""
    cluster = _cluster(_stage_plan(plan))
    n = len(cluster.axis_sizes)
    out = []
    if near is not None and near is not plan:
        nl = layout(near)
        if (nl.data, nl.tensor, nl.fsdp) != (lo.data, lo.tensor, lo.fsdp):
            out.append(f"no baseline of the plan file has this plan's degrees (data {lo.data}, tensor {lo.tensor}, "
                       f"FSDP {lo.fsdp}); the nearest has data {nl.data}, tensor {nl.tensor}, FSDP {nl.fsdp}")
        out += _layer_differences(_stage_plan(plan), _stage_plan(near))
    elif near is None and not _expressible(plan):
        out.append("the plan file has no baseline that the framework runs as is (data parallel, Megatron or FSDP) "
                   "to compare the per-layer placements with: re-run the search to write them")
    if lo.tensor_axes and lo.tensor_axes != tuple(range(n - len(lo.tensor_axes), n)):
        out.append(f"the tensor-parallel axes {list(lo.tensor_axes)} of the fine axes {list(cluster.axis_sizes)} are "
                   f"not the innermost ranks, which is where {target} puts tensor parallelism")
    if lo.fsdp_axes:
        data_axes = [a for a in range(n) if a not in lo.tensor_axes]
        if target == "megatron" and lo.fsdp != lo.data:
            out.append(f"FSDP over {lo.fsdp} of the {lo.data} data-parallel ranks (hybrid sharding): Megatron-LM's "
                       f"FSDP shards over the whole data-parallel group")
        if tuple(data_axes[len(data_axes) - len(lo.fsdp_axes):]) != lo.fsdp_axes:
            out.append(f"the FSDP axes {list(lo.fsdp_axes)} are not the innermost data axes, which is where "
                       f"{target} shards (its replicate dimension is outside its shard dimension)")
    if target == "torchtitan" and lo.tensor > 1 and not lo.sequence_parallel:
        out.append("the norms are replicated over the tensor-parallel ranks: torchtitan's tensor parallelism always "
                   "shards their sequence (sequence parallel; same traffic, as reduce-scatter and all-gather)")
    if target == "torchtitan" and lo.recompute == "selective":
        out.append("selective recomputation of the attention core: torchtitan's selective modes are per operator "
                   "(selective_ac_option \"op\") or every n-th block")
    micro = int((plan.get("model") or {}).get("micro_batch", 0))
    if micro % lo.data:
        out.append(f"the micro-batch of {micro} sequences does not split evenly over {lo.data} data-parallel ranks")
    return out


def torchtitan_config(lo: Layout) -> str:
    # local_batch_size: per data-parallel rank and step; torchtitan accumulates gradients over
    # global / (local * data) such batches, and a pipeline splits one into micro-batches
    local = lo.global_batch // lo.data if lo.pipeline > 1 else lo.micro_batch
    lines = ["[training]", f"local_batch_size = {local}",
             f"global_batch_size = {lo.global_batch}", f"seq_len = {lo.sequence}", "",
             "[parallelism]", f"data_parallel_replicate_degree = {lo.replicate}",
             f"data_parallel_shard_degree = {lo.fsdp}", f"tensor_parallel_degree = {lo.tensor}",
             f"pipeline_parallel_degree = {lo.pipeline}"]
    if lo.pipeline > 1:
        lines.append(f"pipeline_parallel_microbatch_size = {lo.micro_batch}")
    lines += ["", "[activation_checkpoint]", f'mode = "{lo.recompute}"']
    if lo.recompute == "selective":
        lines.append('selective_ac_option = "op"')
    return "\n".join(lines)


def megatron_flags(lo: Layout) -> str:
    flags = [f"--tensor-model-parallel-size {lo.tensor}", f"--pipeline-model-parallel-size {lo.pipeline}",
             f"--micro-batch-size {lo.micro_batch}", f"--global-batch-size {lo.global_batch}",
             f"--seq-length {lo.sequence}"]
    if lo.sequence_parallel:
        flags.append("--sequence-parallel")
    if lo.recompute == "full":
        flags += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    elif lo.recompute == "selective":
        flags.append("--recompute-granularity selective")
    if lo.fsdp > 1:  # ZeRO-3: parameters, gradients and optimizer state sharded (Megatron-FSDP)
        flags += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params",
                  "--use-distributed-optimizer"]
    return (f"# data-parallel size: {lo.data} (what is left of the world)\n" + " \\\n".join(flags))


RENDER = {"torchtitan": torchtitan_config, "megatron": megatron_flags}


def select(pf: PlanFile, which: str) -> dict:
    if which == "best":
        return pf.best
    if which.startswith("baseline:"):
        name = which.split(":", 1)[1].strip().lower()
        if not name:
            raise OptionError("which", f"{which!r} names no baseline: give baseline:NAME, e.g. baseline:megatron")
        hits = [b for b in pf.baselines if b.get("strategy", "").lower().startswith(name)]
        if hits:
            return hits[0]
        names = ", ".join(repr(b.get("strategy", "")) for b in pf.baselines)
        raise OptionError("which", f"no baseline named {name!r} in the plan file: use one of {names}")
    raise OptionError("which", f"{which!r} is neither best nor baseline:NAME")


def export(pf: PlanFile, target: str, which: str = "best") -> Export:
    """The plan ``which`` (best, or baseline:NAME) of a plan file as ``target``'s configuration."""
    if target not in TARGETS:
        raise OptionError("to", f"{target!r} is not a known framework: use one of {', '.join(TARGETS)}")
    plan = select(pf, which)
    lo = layout(plan)
    near = nearest(pf, plan)
    cannot = cannot_express(target, plan, lo, near)
    figures = None
    if near is not None:
        t = near.get("totals") or {}
        figures = {"strategy": near.get("strategy", ""), **{k: t.get(k) for k in ("step_s", "total_s", "memory_bytes")},
                   "fits_memory": t.get("fits_memory", True)}
    return Export(target, plan.get("strategy", ""), lo, RENDER[target](lo), tuple(cannot), figures)


def next_steps(plan_path, plan: dict) -> list[str]:
    """How to use a written plan: apply it in a training script, export it, measure it (the last
    lines of ``python -m autotune`` and the report's plan section)."""
    c = plan.get("cluster") or {}
    nodes, gpus = c.get("nodes", 1), c.get("gpus_per_node", 1)
    launch = f"torchrun --nproc-per-node {gpus}" if nodes == 1 else f"torchrun --nnodes {nodes} --nproc-per-node {gpus}"
    apply = (f"pipe = autotune.apply_pipeline(\"{plan_path}\", model), then pipe.step(ids, targets) a step"
             if "stages" in plan else f"model = autotune.apply(\"{plan_path}\", model)")
    return ["next steps:",
            f"  apply it to your model:  {apply} in your training script (README: Apply a plan to your model)",
            f"  export it:               python -m autotune export {plan_path} --to torchtitan|megatron",
            f"  measure it:              {launch} -m autotune execute {plan_path}"]
