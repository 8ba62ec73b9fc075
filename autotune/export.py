"""A plan as the configuration of a training framework: torchtitan's command-line overrides (its
release 0.3 configures a job by ``--module``/``--config`` and ``--section.field`` overrides parsed by
tyro; the 0.2 TOML job config is gone) or Megatron-LM's command-line flags.

    from autotune.export import export
    from autotune.plan import PlanFile
    print(export(PlanFile.load("autotune-out/plan.json"), "megatron").text)

Both tools take a few degrees and flags, not per-layer placements. ``layout`` reads them off a plan:
the fine axes on which most matmul layers split a weight are its tensor-parallel axes, the others
its data-parallel axes (of which the FSDP ones, ``plan.sharding_axes``, shard the weights); norms
whose input is split along tokens over the tensor axes mean sequence parallelism; ``stages`` give
the pipeline degree and ``recompute`` the activation checkpointing. The tools' own names:

- torchtitan 0.3 (``torchtitan/config/configs.py``, ``trainer.py``): ``--parallelism.``
  ``data_parallel_replicate_degree``, ``data_parallel_shard_degree`` (FSDP; both > 1 is HSDP),
  ``tensor_parallel_degree`` (its tensor parallelism always shards the norms' sequence: sequence
  parallel is implied), ``pipeline_parallel_degree``, ``pipeline_parallel_schedule`` (GPipe, 1F1B,
  Interleaved1F1B), ``module_fqns_per_model_part`` (the stage split: one comma-separated list of modules per
  stage, per virtual stage when interleaved), ``fsdp_reshard_after_forward never`` (ZeRO: FSDP over the data
  ranks keeping the weights whole through the step),
  ``pipeline_parallel_microbatch_size``; ``--training.`` ``local_batch_size``, ``global_batch_size``,
  ``seq_len``; activation checkpointing as the subcommand ``activation-checkpoint:none|full|selective``
  (last). Its device mesh nests pp, dp_replicate, dp_shard, tp from the outside in.
- Megatron-LM (``megatron/training/arguments.py``): ``--tensor-model-parallel-size``,
  ``--pipeline-model-parallel-size`` (data parallelism is what is left of the world),
  ``--sequence-parallel``, ``--recompute-granularity`` (full | selective),
  ``--recompute-method`` (uniform | block), ``--recompute-num-layers``,
  ``--micro-batch-size`` (per data-parallel rank), ``--global-batch-size``, ``--seq-length``; an
  uneven stage split as ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
  (Megatron runs 1F1B, interleaved with ``--num-virtual-stages-per-pipeline-rank``); ZeRO-1 as
  ``--use-distributed-optimizer``; FSDP (ZeRO-3) as Megatron-FSDP (megatron-core 0.16):
  ``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
  --use-distributed-optimizer --no-gradient-accumulation-fusion --ckpt-format fsdp_dtensor``, and
  HSDP (sharded over the inner data ranks, replicated across the outer) with
  ``--num-distributed-optimizer-instances R --outer-dp-sharding-strategy no_shard``. Tensor-parallel
  ranks are adjacent ranks. megatron-core's wheel does not hold Megatron-LM's argument parser
  (``megatron/training/arguments.py``), so the flags are checked against its published names in tests.

Both train transformer language models: a plan of another model (mlp, vgg13, u-transformer) is
refused, as is a pipelined plan whose split its stages' plans do not match (what ``apply_pipeline``
refuses). "Expresses exactly" compares the plan with the exported configuration's own plan: the
degrees, stage split, schedule, recomputation and micro-batch the flags set, and each layer's
placements under the tool's fixed scheme (data parallel: every activation split on the batch over
the data axes and every weight whole; with tensor parallelism, the plan file's baseline of the same
degrees, which is that scheme). What differs is listed, with the predicted figures of that plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from calibrate.allocator import EXPANDABLE_ENV
from calibrate.errors import OptionError, UserError

from autotune.plan.file import PlanFile
from autotune.plan.layouts import context_size
from autotune.plan.typed import LayerPlan, Plan
from autotune.sbp.sbp import B, is_split

TARGETS = ("torchtitan", "megatron")
# baselines that a framework runs as they are (by the start of their strategy name)
EXPRESSIBLE = ("data parallel", "megatron", "fsdp", "hsdp", "tp+fsdp")
NORMS = ("layernorm", "rmsnorm")
TRAINED = ("gpt", "llama")  # the model kinds both tools train (transformer language models)
# the pipeline schedules of the plan as each tool names them (absent: the tool has none like it)
SCHEDULES = {"torchtitan": {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved-1f1b": "Interleaved1F1B"},
             "megatron": {"1f1b": "1F1B", "interleaved-1f1b": "1F1B"}}  # Megatron's: --num-virtual-stages-...
TORCHTITAN_MODULE = {"llama": "llama3"}  # torchtitan's model of a plan's family (it has no GPT-2)


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
    schedule: str = ""  # the pipeline's (1f1b, gpipe, eager-1f1b); "" without one
    split: tuple[int, ...] = ()  # transformer blocks per stage
    layers: int = 0  # the model's transformer blocks
    kind: str = ""  # the model's family (gpt, llama)
    recompute_blocks: int = 0  # full recomputation of each stage's first blocks only; 0: every block
    virtual: int = 1  # chunks a rank (interleaved 1F1B's virtual stages)
    zero: int = 0  # ZeRO stage over the data ranks (1: optimizer states, 2: and gradients; FSDP is ``fsdp``)
    chunks: tuple = ()  # blocks per virtual stage, in order (interleaved 1F1B; ``Plan.chunk_ranges``)
    context: int = 1  # of the data ranks, those each sequence is split over (context parallelism)

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
            lines.append(f"{note} the plan it runs (the plan file's of these degrees): {n['strategy']!r}, predicted {_fmt(n.get('step_s'))} s/step "
                         f"({_fmt(n.get('total_s'))} s/step in collectives, {_gib(n.get('memory_bytes'))} GiB per device"
                         f"{'' if n.get('fits_memory', True) else ', over the memory limit'})")
        return "\n".join(lines + [self.config]) + "\n"


def _fmt(x) -> str:
    return "?" if x is None else f"{x:.4g}"


def _gib(x) -> str:
    return "?" if x is None else f"{x / 2**30:.2f}"


def _stage_plan(plan: Plan) -> Plan:
    """The plan whose placements set the degrees: a pipelined plan's first stage's."""
    inner = plan.stages[0].plan if plan.stages else plan
    if not inner.layers:
        raise UserError(f"plan {plan.strategy!r} has no layers: give a plan.json written by python -m autotune")
    return inner


def _weights(lay: LayerPlan) -> dict:
    return {w.name: w.placements for w in lay.weights}


def layout(plan: Plan) -> Layout:
    """The degrees and flags of a plan (the first stage's placements for a pipelined plan)."""
    pipeline = len(plan.stages) or 1
    inner = _stage_plan(plan)
    cluster = inner.cluster
    n = len(cluster.axis_sizes)
    votes, total = [0] * n, 0
    for lay in inner.layers:
        if lay.kind != "matmul":
            continue
        total += lay.count
        for a in range(n):
            if any(is_split(w.placements[a]) for w in lay.weights):
                votes[a] += lay.count
    tensor_axes = tuple(a for a in range(n) if total and 2 * votes[a] > total)
    data_axes = [a for a in range(n) if a not in tensor_axes]
    fsdp_axes = tuple(sorted(inner.sharding_axes)) if inner.sharding_mode == "fsdp" else ()
    norms = [lay for lay in inner.layers if lay.kind in NORMS and lay.input is not None]
    sp = bool(tensor_axes) and bool(norms) and sum(
        lay.count for lay in norms if all(lay.input[a] == "S0" for a in tensor_axes)) * 2 > sum(
        lay.count for lay in norms)
    model = plan.model
    data = math.prod(cluster.axis_sizes[a] for a in data_axes)  # a pipelined plan: its first stage's submesh
    context = context_size(inner)
    micro, batch, seq = model.get("micro_batch"), model.get("batch"), model.get("sequence", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (micro, batch, seq)):
        raise UserError(f"the plan's model has micro_batch {micro!r}, batch {batch!r}, sequence {seq!r}; each must be "
                        f"a positive integer: re-run the search")
    return Layout(data=data, fsdp=math.prod(cluster.axis_sizes[a] for a in fsdp_axes),
                  tensor=math.prod(cluster.axis_sizes[a] for a in tensor_axes), pipeline=pipeline,
                  sequence_parallel=sp, recompute=inner.recompute, micro_batch=max(micro * context // data, 1),
                  global_batch=batch, sequence=seq, tensor_axes=tensor_axes, fsdp_axes=fsdp_axes,
                  schedule=plan.pipeline.schedule if plan.stages else "",
                  split=tuple(plan.pipeline.split) if plan.stages else (),
                  layers=int(model.get("layers") or 0), kind=model.kind, recompute_blocks=inner.recompute_blocks,
                  virtual=plan.virtual_stages, zero=plan.stages[0].zero_stage if plan.stages else 0,
                  chunks=tuple(b - a for a, b in plan.chunk_ranges()) if plan.virtual_stages > 1 else (),
                  context=context)


def check_exportable(plan: Plan) -> None:
    """A plan the tools cannot run refused in one line: a model other than a transformer language model,
    a pipelined plan whose split its stages' plans do not match (refused by ``apply_pipeline`` alike)."""
    kind, layers = plan.model.kind, plan.model.get("layers")
    if kind not in TRAINED:
        raise UserError(f"the plan's model is {kind!r} {plan.model.get('name', '')}: torchtitan and Megatron-LM "
                        f"train transformer language models ({', '.join(TRAINED)}) only; export a transformer's plan, "
                        f"or place this one with autotune.apply".replace("  ", " "))
    if not plan.stages:
        return
    split = plan.pipeline.split
    if not (len(split) == len(plan.stages) >= 2 and all(k >= 1 for k in split) and sum(split) == layers):
        raise UserError(f"the plan's stage split {list(split)!r} does not give its {len(plan.stages)} stages at least "
                        f"one of the model's {layers} blocks each, all of them: re-run python -m autotune --pipeline N")
    try:  # what apply_pipeline refuses (a split its stages' plans do not match), refused here alike
        from autotune.apply.pipeplan import load_pipelined
    except ImportError:  # without torch: the checks above
        return
    load_pipelined(plan)


def _expressible(plan: Plan) -> bool:
    return plan.strategy.lower().startswith(EXPRESSIBLE)


def _placements(lay: LayerPlan) -> str:
    def f(t):
        return "(" + ", ".join(t) + ")"
    parts = [f"{k} {f(t)}" for k, t in (("input", lay.input), ("output", lay.output)) if t is not None]
    return ", ".join(parts + [f"{n} {f(t)}" for n, t in _weights(lay).items()])


def _layer_differences(plan: Plan, other: Plan) -> list[str]:
    theirs = {lay.name: lay for lay in other.layers}
    out = []
    for lay in plan.layers:
        ref = theirs.get(lay.name)
        if ref is None:
            out.append(f"layer {lay.name}: no such layer in {other.strategy!r}")
        elif (lay.input, lay.output, _weights(lay)) != (ref.input, ref.output, _weights(ref)):
            out.append(f"layer {lay.name} (x{lay.count}): {_placements(lay)} on the fine axes, where "
                       f"{other.strategy!r} has {_placements(ref)}")
    return out


def _degrees(lo: Layout) -> tuple:
    return lo.data, lo.tensor, lo.fsdp


def same_scheme(pf: PlanFile, plan: Plan) -> Plan | None:
    """The plan file's baseline that a framework runs as is with exactly the plan's degrees (its own
    plan when it is one), or None."""
    if _expressible(plan):
        return plan
    mine = layout(plan)
    same = [b for b in [pf.best] + list(pf.baselines)
            if _expressible(b) and not b.stages and _degrees(layout(b)) == _degrees(mine)]
    return min(same, key=lambda b: math.inf if b.costs.step_s is None else b.costs.step_s) if same else None


def _data_parallel_differences(stage: Plan, where: str) -> list[str]:
    """Layers of ``stage`` (a plan of one stage, no tensor parallelism) placed otherwise than data parallelism
    places them: every activation split on the batch over every data axis, every weight whole (FSDP
    shards the weights by ``sharding``, not by their placements)."""
    n, out = len(stage.cluster.axis_sizes), []
    for lay in stage.layers:
        acts = [t[:n] for t in (lay.input, lay.output) if t is not None]
        if any(f != "S0" for t in acts for f in t) or any(f != B for w in lay.weights for f in w.placements[:n]):
            out.append(f"{where}layer {lay.name} (x{lay.count}): {_placements(lay)} on the fine axes, where "
                       f"data parallelism splits every activation on the batch and keeps every weight whole")
    return out


def cannot_express(target: str, plan: Plan, lo: Layout, own: Plan | None) -> list[str]:
    """What of ``plan`` the configuration exported for ``target`` runs otherwise (``own``: the baseline of the
    same degrees that the configuration runs, None when the plan file has none)."""
    cluster = _stage_plan(plan).cluster
    n = len(cluster.axis_sizes)
    out = []
    stages = [("", _stage_plan(plan), lo)]
    if plan.stages:
        stages = [(f"stage {i}: ", s.plan, layout(s.plan))
                  for i, s in enumerate(plan.stages)]
        if len({_degrees(slo) for _, _, slo in stages}) > 1:
            out.append("the stages have different degrees (" + "; ".join(
                f"{w}data {slo.data}, tensor {slo.tensor}, FSDP {slo.fsdp}" for w, _, slo in stages) +
                f"): {target} gives every stage the same")
        if lo.schedule not in SCHEDULES[target]:
            nearest = "1F1B"
            out.append(f"the {lo.schedule} schedule: {target} has no such schedule (exported: {nearest})")
    if lo.tensor == 1:
        for where, stage, _ in stages:
            out += _data_parallel_differences(stage, where)
    elif own is not None and own is not plan and not plan.stages:
        out += _layer_differences(plan, own)
    elif own is None:
        out.append(f"the per-layer placements with tensor parallelism {lo.tensor} are not compared with {target}'s "
                   f"scheme: the plan file has no baseline of these degrees{' per stage' if plan.stages else ''}")
    if lo.tensor_axes and lo.tensor_axes != tuple(range(n - len(lo.tensor_axes), n)):
        out.append(f"the tensor-parallel axes {list(lo.tensor_axes)} of the fine axes {list(cluster.axis_sizes)} are "
                   f"not the innermost ranks, which is where {target} puts tensor parallelism")
    if lo.fsdp_axes:
        data_axes = [a for a in range(n) if a not in lo.tensor_axes]
        if tuple(data_axes[len(data_axes) - len(lo.fsdp_axes):]) != lo.fsdp_axes:
            out.append(f"the FSDP axes {list(lo.fsdp_axes)} are not the innermost data axes, which is where "
                       f"{target} shards (its replicate dimension is outside its shard dimension)")
    if target == "torchtitan" and lo.tensor > 1 and not lo.sequence_parallel:
        out.append("the norms are replicated over the tensor-parallel ranks: torchtitan's tensor parallelism always "
                   "shards their sequence (sequence parallel; same traffic, as reduce-scatter and all-gather)")
    if target == "torchtitan" and lo.context > 1 and lo.fsdp == 1 and not lo.zero:
        out.append(f"the weights replicated over the {lo.context} context-parallel ranks: torchtitan shards them there "
                   f"(FSDP over dp_shard x cp)")
    if target == "torchtitan" and lo.recompute == "selective":
        out.append("selective recomputation of the attention core: torchtitan's selective modes are per operator "
                   "or every n-th block (exported: its default selective policy)")
    modes = {(st.plan.recompute, st.plan.recompute_blocks) for st in plan.stages}
    if len(modes) > 1:
        said = ", ".join(f"{r} ({b or 'every'} blocks)" if r == "full" else r for r, b in sorted(modes))
        out.append(f"the stages recompute differently ({said}): {target} sets one recomputation for every stage "
                   f"(exported: the first stage's)")
    if target == "torchtitan" and lo.recompute_blocks:
        out.append(f"full recomputation of each stage's first {lo.recompute_blocks} blocks: torchtitan checkpoints every "
                   f"block or every n-th (exported: every block, which re-runs more and fits)")
    if lo.zero == 1 and target == "torchtitan":
        out.append("ZeRO-1 (optimizer states sharded): torchtitan shards the gradients too (FSDP never resharding "
                   "after forward, its ZeRO-2; the same traffic, less memory)")
    if lo.zero == 2 and target == "megatron":
        out.append("ZeRO-2's sharded gradients: Megatron-LM's distributed optimizer reduce-scatters them into a "
                   "whole buffer (exported: --use-distributed-optimizer; the same traffic, more memory)")
    if target == "megatron" and lo.virtual > 1 and len(set(lo.chunks)) > 1:
        out.append(f"the chunks of {list(lo.chunks)} blocks: Megatron-LM's virtual stages take equal layers")
    if target == "megatron" and lo.split and megatron_split(lo) is None:
        out.append(f"the stage split {list(lo.split)}: Megatron-LM sets only the first and last stages' layers, the "
                   f"others even")
    micro = int(plan.model.get("micro_batch", 0))
    if micro % lo.data:
        out.append(f"the micro-batch of {micro} sequences does not split evenly over {lo.data} data-parallel ranks")
    return out


def megatron_split(lo: Layout) -> tuple[int | None, int | None] | None:
    """(first, last) stage's layers as Megatron-LM's flags set them (None: the even split), or None when the
    middle stages are not even."""
    p, split = len(lo.split), list(lo.split)
    if len(set(split)) == 1:
        return (None, None)
    middle = split[1:-1]
    if len(set(middle)) > 1:
        return None
    if p == 2:  # the first stage's count sets both
        return (split[0], None)
    return (split[0] if split[0] != middle[0] else None, split[-1] if split[-1] != middle[0] else None)


def torchtitan_parts(lo: Layout) -> list[list[str]]:
    """The stage split (under interleaved 1F1B each virtual stage's, in order) as torchtitan's
    module_fqns_per_model_part: the embedding with the first part's blocks, the final norm and head with the
    last's."""
    parts, start, sizes = [], 0, lo.chunks or lo.split
    for i, k in enumerate(sizes):
        part = [f"layers.{j}" for j in range(start, start + k)]
        start += k
        parts.append((["tok_embeddings"] if i == 0 else []) + part + (["norm", "lm_head"] if i == len(sizes) - 1
                                                                      else []))
    return parts


def torchtitan_config(lo: Layout) -> str:
    # local_batch_size: per data-parallel rank and step; torchtitan accumulates gradients over
    # global / (local * data) such batches, and a pipeline splits one into micro-batches
    local = lo.global_batch // lo.data if lo.pipeline > 1 else lo.micro_batch
    module = TORCHTITAN_MODULE.get(lo.kind)
    flags = []
    if lo.pipeline > 1:  # first: its lists take every word up to the next option
        flags.append("--parallelism.module_fqns_per_model_part " + " ".join(",".join(p) for p in torchtitan_parts(lo)))
    flags += [f"--training.local_batch_size {local}", f"--training.global_batch_size {lo.global_batch}",
              f"--training.seq_len {lo.sequence}",
              f"--parallelism.data_parallel_replicate_degree {1 if lo.zero else lo.replicate // _outside(lo)}",
              f"--parallelism.data_parallel_shard_degree {(lo.data if lo.zero else lo.fsdp) // _inside(lo)}",
              f"--parallelism.tensor_parallel_degree {lo.tensor}",
              f"--parallelism.pipeline_parallel_degree {lo.pipeline}"]
    if lo.context > 1:  # its ranks inside the data ranks (FSDP shards over dp_shard x cp)
        flags.append(f"--parallelism.context_parallel_degree {lo.context}")
    if lo.zero:  # ZeRO: FSDP over the data ranks, the weights whole from a step's first forward to its last backward
        flags.append("--parallelism.fsdp_reshard_after_forward never")
    if lo.pipeline > 1:
        flags += [f"--parallelism.pipeline_parallel_schedule {SCHEDULES['torchtitan'].get(lo.schedule, '1F1B')}",
                  f"--parallelism.pipeline_parallel_microbatch_size {lo.micro_batch}"]
    flags.append(f"activation-checkpoint:{lo.recompute}")  # a subcommand: last
    head = (f"# run: torchrun ... -m torchtitan.train --module {module} --config YOUR_{module.upper()}_CONFIG, then:"
            if module else "# run: torchrun ... -m torchtitan.train --module YOUR_MODEL --config YOUR_CONFIG, then "
                           "(torchtitan has no GPT-2 model: bring yours):")
    return head + "\n" + " \\\n".join(flags)


def _inside(lo: Layout) -> int:
    """The context-parallel ranks inside torchtitan's shard dimension (all of them where it shards: FSDP over
    dp_shard x cp), the rest ``_outside``, in its replicate dimension."""
    return lo.context if lo.fsdp % lo.context == 0 and (lo.fsdp > 1 or lo.zero) else 1


def _outside(lo: Layout) -> int:
    return lo.context // _inside(lo)


def megatron_flags(lo: Layout) -> str:
    flags = [f"--tensor-model-parallel-size {lo.tensor}", f"--pipeline-model-parallel-size {lo.pipeline}",
             f"--micro-batch-size {lo.micro_batch}", f"--global-batch-size {lo.global_batch}",
             f"--seq-length {lo.sequence}"]
    if lo.split:
        first, last = megatron_split(lo) or (None, None)
        flags += [f"--decoder-first-pipeline-num-layers {first}"] if first is not None else []
        flags += [f"--decoder-last-pipeline-num-layers {last}"] if last is not None else []
    if lo.virtual > 1:
        flags.append(f"--num-virtual-stages-per-pipeline-rank {lo.virtual}")
    if lo.context > 1:
        flags.append(f"--context-parallel-size {lo.context}")
    if lo.sequence_parallel:
        flags.append("--sequence-parallel")
    if lo.zero:  # ZeRO-1: optimizer states sharded over the data ranks, gradients reduce-scattered
        flags.append("--use-distributed-optimizer")
    if lo.recompute == "full":
        flags += ["--recompute-granularity full"] + (
            ["--recompute-method block", f"--recompute-num-layers {lo.recompute_blocks}"] if lo.recompute_blocks
            else ["--recompute-method uniform", "--recompute-num-layers 1"])
    elif lo.recompute == "selective":
        flags.append("--recompute-granularity selective")
    if lo.fsdp > 1:  # ZeRO-3: parameters, gradients and optimizer state sharded (Megatron-FSDP, megatron-core 0.16)
        flags += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params",
                  "--use-distributed-optimizer", "--no-gradient-accumulation-fusion", "--ckpt-format fsdp_dtensor"]
        if lo.replicate > 1:  # HSDP: FSDP inside each of the replicate groups, replicated across them
            flags += [f"--num-distributed-optimizer-instances {lo.replicate}", "--outer-dp-sharding-strategy no_shard"]
    return (f"# data-parallel size: {lo.data // lo.context} (what is left of the world)\n" + " \\\n".join(flags))


RENDER = {"torchtitan": torchtitan_config, "megatron": megatron_flags}


def export(pf: PlanFile, target: str, which: str = "best") -> Export:
    """The plan ``which`` (best, or baseline:NAME) of a plan file as ``target``'s configuration."""
    if target not in TARGETS:
        raise OptionError("to", f"{target!r} is not a known framework: use one of {', '.join(TARGETS)}")
    if which == "all" or not (which == "best" or which.startswith("baseline:") and which[9:].strip()):
        raise OptionError("which", f"{which!r} is neither best nor baseline:NAME, e.g. baseline:megatron")
    try:
        plan = pf.select(which)[0]
    except UserError as e:
        raise OptionError("which", str(e)) from None
    check_exportable(plan)
    lo = layout(plan)
    own = same_scheme(pf, plan)
    cannot = cannot_express(target, plan, lo, own)
    figures = None
    if own is not None and own is not plan:
        t = own.costs
        figures = {"strategy": own.strategy, "step_s": t.step_s, "total_s": t.total_s,
                   "memory_bytes": t.memory_bytes, "fits_memory": t.fits_memory}
    return Export(target, plan.strategy, lo, RENDER[target](lo), tuple(cannot), figures)


def next_steps(plan_path, plan: Plan, module: str | None = None) -> list[str]:
    """How to use a written plan: apply it in a training script, export it, measure it (the last
    lines of ``python -m autotune`` and the report's plan section); ``module``: what ``execute --module`` runs
    (the config.json the plan was searched for; None: the reference modules, its default)."""
    nodes, gpus = plan.cluster.nodes, plan.cluster.gpus_per_node
    launch = f"torchrun --nproc-per-node {gpus}" if nodes == 1 else f"torchrun --nnodes {nodes} --nproc-per-node {gpus}"
    apply = (f"pipe = autotune.apply_pipeline(\"{plan_path}\", model), then pipe.step(ids, targets) a step"
             if plan.stages else f"model = autotune.apply(\"{plan_path}\", model)")
    env = "" if plan.allocator == "default" else f"{'='.join(EXPANDABLE_ENV)} "  # what its memory limit left
    return ["next steps:",
            f"  apply it to your model:  {apply} in your training script (README: Apply a plan to your model)"
            + (f", the job started under {env.strip()}" if env else ""),
            f"  export it:               python -m autotune export {plan_path} --to torchtitan|megatron",
            f"  measure it:              {env}{launch} -m autotune execute {plan_path}"
            + (f" --module {module}" if module else "")]
