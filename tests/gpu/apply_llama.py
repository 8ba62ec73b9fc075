"""Issue 41's GPU check (tests/gpu/apply_check.sh): a transformers LlamaForCausalLM built on the CPU, every plan
kind searched for it (``plan``, on the CPU before the GPU job) and run through autotune.apply / apply_pipeline by
execute's runners (``run``, under torchrun: their step timer and memory probe), beside tensor parallelism composed
by hand with torch's ParallelStyles (torchtitan's way) at t = 2 and 4 in the same job, then each degree's two
compositions resident together, one step of each in turn (``_in_turn``: the comparison on the same processes and
minutes, their losses compared). The tables last; JSON in OUT.

    python tests/gpu/apply_llama.py plan OUT PROFILE [--small] [--gpus N] [--sequence-parallel]
    [GC_MODE=off] torchrun --nproc-per-node N tests/gpu/apply_llama.py run OUT [--device cuda|cpu]

``--sequence-parallel`` (tests/gpu/seqpar_check.sh): no search; the Megatron plans at each t without and with
sequence parallelism (the tensor path), beside both composed by hand (torchtitan's styles; with sequence
parallelism its ``SequenceParallel`` norms and ``PrepareModuleInput`` on the attention and the MLP).

On N GPUs the batch is 8 N sequences in 2 micro-batches (each data rank's piece the same as on 4); tensor
parallelism at every t of 2 and 4 that divides N. Each run ends with PROFILE_STEPS steps under the torch profiler:
the table's attribution columns (time in NCCL kernels and its exposed part, the device's idle time, the host's
issue time, device time in matmuls and in copies) say where a step's time goes beside its prediction.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

SHAPE = dict(layers=16, hidden=2048, heads=16, kv_heads=8, head_dim=128, ffn=8192, vocabulary=128256, sequence=2048,
             batch=32, micro_batch=16)
SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=96, vocabulary=128, sequence=16, batch=8,
             micro_batch=4)
STEPS, WARMUP, PROFILE_STEPS = 8, 3, 2


def build(config: dict):
    """The factory execute calls with the plan's model config: transformers' own LlamaForCausalLM (execute's
    ``forward_loss`` calls it with ``labels``, the README's step: its own loss, under loss_parallel where the logits
    are split by vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = config
    return LlamaForCausalLM(LlamaConfig(vocab_size=c["vocabulary"], hidden_size=c["hidden"],
                                        intermediate_size=c["ffn"], num_hidden_layers=c["layers"],
                                        num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                                        head_dim=c["head_dim"], max_position_embeddings=c["sequence"],
                                        attn_implementation="sdpa"))


def _megatron(shape: dict, profile: str, d: tuple, t: tuple, name: str, gpus: int, sequence: bool = False) -> dict:
    """The Megatron plan on mesh (d, t) of 1 x ``gpus`` (sizes per role on (nodes, GPUs)), with ``sequence``
    parallelism or without, priced by the search's cost model at its path's host pace."""
    from autotune.sbp.baselines import megatron_assignment
    from autotune.sbp.boxing import Coster
    from autotune.sbp.cost import Problem
    from autotune.sbp.mesh import Cluster
    from autotune.plan.build import build as build_plan
    from calibrate.profile import Profile
    from models import load_model
    from autotune.plan.hostpace import at_host_pace
    prof = Profile.load(profile)
    problem = Problem(load_model("llama", None, dict(shape)), Coster(prof, Cluster(1, gpus)), require_fit=False,
                      objective="step", runnable=not sequence)
    return at_host_pace(build_plan(problem, megatron_assignment(problem, d, t, sequence_parallel=sequence), name),
                        prof.compute, prof.module)


def plan(out: Path, profile: str, small: bool, gpus: int = 4, sequence: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shape = SMALL if small else dict(SHAPE, batch=8 * gpus, micro_batch=4 * gpus)
    ts = [t for t in (2, 4) if gpus % t == 0]
    if sequence:
        plans = {f"TP t={t}{' SP' * sp}": _megatron(shape, profile, (1, gpus // t), (1, t),
                                                   f"Megatron d={gpus // t} t={t}{', sequence parallel' * sp}",
                                                   gpus, sp) for t in ts for sp in (False, True)}
        hand = [[t, sp] for t in ts for sp in (False, True)]
        (out / "plans.json").write_text(json.dumps({"shape": shape, "plans": {k: p.to_dict() for k, p in
                                                                              plans.items()}, "hand": hand}))
        print(f"wrote {out / 'plans.json'}: {', '.join(plans)}")
        return
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    for name, extra in (("search", []), ("search-pp", ["--pipeline", "2"])):
        subprocess.run([sys.executable, "-m", "autotune", "--model", "llama", *flags, "--nodes", "1",
                        "--gpus-per-node", str(gpus), "--profile", profile, "--compare", "none", "--out", str(out / name),
                        *extra], check=True, stdout=subprocess.DEVNULL, stderr=open(out / f"{name}.log", "w"), timeout=300)
    from autotune.plan.file import PlanFile
    single, piped = PlanFile.load(out / "search" / "plan.json"), PlanFile.load(out / "search-pp" / "plan.json")
    plans = {"searched": single.best}
    for b in single.baselines:
        for kind in ("data parallel", "FSDP"):
            if b.strategy.startswith(kind):
                plans[kind] = b
    plans["pipelined"] = piped.best if piped.best.stages else next(b for b in piped.baselines if b.stages)
    if gpus % 4 == 0:  # Megatron's 3-D plan, 2 stages of t = 2: the tensor path in a pipeline (PP + TP)
        plans["Megatron 3-D t=2"] = _megatron_3d(shape, profile, gpus)
    for t in (2, 4):
        if gpus % t == 0:
            plans[f"TP t={t}"] = _megatron(shape, profile, (1, gpus // t), (1, t), f"Megatron d={gpus // t} t={t}", gpus)
    (out / "plans.json").write_text(json.dumps({"shape": shape, "plans": {k: p.to_dict() for k, p in plans.items()},
                                                "hand": [[t, False] for t in ts]}))
    print(f"wrote {out / 'plans.json'}: {', '.join(plans)}")


def _megatron_3d(shape: dict, profile: str, gpus: int, tensor: int = 2):
    """Megatron's 3-D plan of 2 stages inside one node of ``gpus``, t = ``tensor`` (the pipeline search's 3-D
    candidates take whole nodes: its stage plans, ``autotune.pipeline.threed.stage_plans``, at each micro-batch
    count), the fastest simulated, as plan.json writes it."""
    from autotune.pipeline import threed
    from autotune.pipeline.record import pipeline_plan
    from autotune.pipeline.search import PipelineConfig, PipelineSearch
    from autotune.sbp.mesh import Cluster
    from calibrate.profile import Profile
    from models import load_model
    from autotune.sbp.memory import Mode
    search = PipelineSearch(load_model("llama", None, dict(shape)), Cluster(1, gpus), Profile.load(profile), None,
                            PipelineConfig(2, "1f1b"))
    sub, mesh = Cluster(1, gpus // 2), ((1, gpus // 2 // tensor), (1, tensor))  # (data, tensor) sizes per stage
    found = []
    for m in threed.micro_batch_counts(search.graph.batch, 2, sub, True, None):
        plans = threed.stage_plans(search, 2, sub, m, mesh, Mode()) if search.runs(2, m) else None
        if plans is not None:
            found.append(search.finish(search.candidate(2, sub, m, search.balanced(2), plans)))
    best = min(found, key=lambda c: c.step)
    return pipeline_plan(search, best, f"Megatron 3-D (t={tensor}, 2 stages of {sub}, {best.micro_batches} "
                                       f"micro-batches)")


def _hand_tp(shape: dict, t: int, d, sequence: bool = False):
    """torchtitan's composition by hand: parallelize_module (the attention's and the MLP's input prepared as a
    replicated DTensor; q/k/v, gate/up colwise; o, down rowwise; the embedding rowwise; the head colwise to
    vocabulary columns for loss_parallel) on a t-way mesh, fully_shard on a replicate mesh over the data ranks
    where there are more than one (torchtitan applies no FSDP at data degree 1); each data rank its piece of the
    batch. ``sequence``: torchtitan's sequence parallelism (``_sequence_styles``)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    from autotune.apply.batch import DataSplit
    from autotune.execute.moduletrain import build_module
    world = d.launch.world
    mesh = init_device_mesh(d.device.type, (world // t, 1, t), mesh_dim_names=("replicate", "shard", "tp"))
    model = build_module("apply_llama:build", {"kind": "llama", **shape}, 0, torch.float32, "cpu")
    styles = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
              "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        styles.update({p + n: ColwiseParallel() for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                           "mlp.gate_proj", "mlp.up_proj")})
        styles.update({p + n: RowwiseParallel() for n in ("self_attn.o_proj", "mlp.down_proj")})
        # the region's input a replicated DTensor once (torchtitan's PrepareModuleInput on the attention and the
        # MLP): one all-reduce of the input gradient a region backward
        styles[p + "self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                                     desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                     use_local_output=False)
        styles[p + "mlp"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                               use_local_output=False)
    if sequence:
        # torchtitan's sequence parallelism, the stream a DTensor of sequence shards between the regions
        # (transformers' Llama reads the sequence length from the embedding's output)
        s1 = Shard(1)
        styles.update({"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=s1,
                                                             use_local_output=False),
                       "model.norm": SequenceParallel(),
                       "lm_head": ColwiseParallel(input_layouts=s1, output_layouts=Shard(-1), use_local_output=False)})
        for i in range(shape["layers"]):
            p = f"model.layers.{i}."
            attn = PrepareModuleInput(input_kwarg_layouts={"hidden_states": s1},
                                      desired_input_kwarg_layouts={"hidden_states": Replicate()})
            styles.update({p + "input_layernorm": SequenceParallel(),
                           p + "post_attention_layernorm": SequenceParallel(), p + "self_attn": attn,
                           p + "mlp": PrepareModuleInput(input_layouts=(s1,), desired_input_layouts=(Replicate(),)),
                           p + "self_attn.o_proj": RowwiseParallel(output_layouts=s1, use_local_output=False),
                           p + "mlp.down_proj": RowwiseParallel(output_layouts=s1, use_local_output=False)})
    parallelize_module(model, mesh["tp"], styles)
    for unit in (list(model.model.layers) + [model]) * (world // t > 1):  # torchtitan: no FSDP at data degree 1
        fully_shard(unit, mesh=mesh["replicate", "shard"])
    model.to(d.device)
    return DataSplit(mesh.get_local_rank("replicate"), world // t).mark(model)


def run(out: Path, device: str) -> None:
    import torch

    from autotune.execute.env import start, stop
    from autotune.execute.moduletrain import ModuleTrainer
    from autotune.execute.pipetrain import run_pipeline_plan
    from autotune.execute.runner import free_device, run_module_plan
    from autotune.plan.typed import Plan
    spec = json.loads((out / "plans.json").read_text())
    shape, rows = spec["shape"], []
    if os.environ.get("GC_MODE") == "off":  # Python's collector off for the whole job (plans_h200x2.md, session 21)
        gc.disable()
    d = start(device)
    common = dict(module="apply_llama:build", steps=STEPS, warmup=WARMUP, profile_steps=PROFILE_STEPS, dtype="auto")
    try:
        for name, p in spec["plans"].items():
            free_device(d)
            p = Plan.from_dict(p, name)
            runner = run_pipeline_plan if p.stages else run_module_plan
            try:
                rec, model = runner(p, d, **common)
                del model
            except torch.OutOfMemoryError as e:
                rec = {"error": f"out of memory: {str(e).splitlines()[0][:200]}", "predicted": p.costs.to_dict()}
            rows.append(dict(name=name, strategy=p.strategy, record=rec))
        for t, sp in spec.get("hand", [[t, False] for t in (2, 4) if d.launch.world % t == 0]):
            free_device(d)
            model = _hand_tp(shape, t, d, sp)
            trainer = ModuleTrainer(model, {"kind": "llama", **shape}, shape["batch"] // shape["micro_batch"], d, 0,
                                    1e-3, torch.bfloat16 if d.is_gpu else None)
            try:
                measured = trainer.run(STEPS, WARMUP, PROFILE_STEPS)
            finally:
                trainer.close()
            del model
            rows.append(dict(name=f"TP t={t}{' SP' * sp} by hand", strategy=HAND,
                             record={"measured": measured, "apply_path": "hand", "predicted": {}}))
        turns = [_in_turn(spec, shape, t, sp, d) for t, sp in spec.get("hand", [])
                 if f"TP t={t}{' SP' * sp}" in spec["plans"]]
    finally:
        stop(d)
    if d.launch.rank == 0:
        (out / "apply_check.json").write_text(json.dumps(rows + turns, indent=1, default=str))
        print(table(rows))
        print(attribution(rows))
        if turns:
            print("| in turn, one step each (the same processes) | ours ms | by hand ms | ours / by hand | "
                  "losses' largest relative difference |\n| --- | ---: | ---: | ---: | ---: |")
            for r in turns:
                print(f"| {r['name']} | {r['ours_s'] * 1e3:.1f} | {r['hand_s'] * 1e3:.1f} | "
                      f"{r['ours_s'] / r['hand_s']:.3f} | {r['loss_difference']:.1e} |")


HAND = "parallelize_module, and fully_shard (replicate) over the data ranks"
TURNS, TURNS_WARMUP = 12, 2


def _in_turn(spec: dict, shape: dict, t: int, sp: bool, d) -> dict:
    """Ours (the plan "TP t=..." through autotune.apply) and the same degree composed by hand, both resident, one
    step of each in turn for ``TURNS`` steps: the medians after ``TURNS_WARMUP`` (the slowest rank's) compared on
    the same processes, minutes and host, which separate runs are not (2 x H200: the same plan's step varied by
    +-11% between processes)."""
    import statistics

    import torch
    import torch.distributed as dist

    from autotune.apply.place import apply, one_stage
    from autotune.execute.moduletrain import ModuleTrainer, build_module
    from autotune.execute.runner import free_device, plan_cluster
    from autotune.plan.typed import Plan
    name = f"TP t={t}{' SP' * sp}"
    free_device(d)
    typed = one_stage(Plan.from_dict(spec["plans"][name], name))
    config = {"kind": typed.model.kind, **typed.model.config}
    d.set_mesh(plan_cluster(typed, d.launch.world).axis_sizes)
    ours = apply(typed, build_module("apply_llama:build", config, 0, torch.float32, "cpu"), d.mesh)
    hand = _hand_tp(shape, t, d, sp)
    autocast = torch.bfloat16 if d.is_gpu else None
    trainers = [ModuleTrainer(m, {"kind": "llama", **shape}, shape["batch"] // shape["micro_batch"], d, 0, 1e-3,
                              autocast) for m in (ours, hand)]
    times: list = [[], []]
    losses: list = [[], []]
    try:
        for s in range(TURNS):
            for k, trainer in enumerate(trainers):
                loss, step, _ = trainer.timed_steps(s, 1)
                losses[k] += loss
                times[k] += step
    finally:
        for trainer in trainers:
            trainer.close()
    got = torch.tensor([statistics.median(x[TURNS_WARMUP:]) for x in times], dtype=torch.float64,
                       device=d.device if d.is_gpu else "cpu")
    dist.all_reduce(got, op=dist.ReduceOp.MAX)
    # the same weights and batches: the two compositions' losses agree step by step (bf16 autocast: to about 1e-2)
    diff = max(abs(a - b) / abs(b) for a, b in zip(*losses))
    return {"name": f"{name} in turn with by hand", "strategy": HAND, "ours_s": float(got[0]), "hand_s": float(got[1]),
            "loss_difference": diff, "record": {}}


def table(rows: list) -> str:
    lines = ["| plan | path | predicted ms | measured ms | measured / predicted | predicted GiB | measured GiB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        rec = r["record"]
        m, p = rec.get("measured") or {}, rec.get("predicted") or {}
        path = rec.get("apply_path") or "/".join((rec.get("pipeline") or {}).get("paths", [])) or "-"
        ms = m.get("step_s")
        pred = p.get("step_s")
        peak = max(m.get("peak_memory_bytes") or [0]) / 2**30 if m.get("peak_memory_bytes") else None
        cells = [r["name"], rec.get("error") or path, _f(pred and pred * 1e3), _f(ms and ms * 1e3),
                 _f(ms / pred if ms and pred else None, 2), _f(p.get("memory_bytes") and p["memory_bytes"] / 2**30, 2),
                 _f(peak, 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def attribution(rows: list) -> str:
    """Where each step's time goes (ms per step, the slowest rank's, under the profiler)."""
    lines = ["| plan | step | host issue | device idle | NCCL | exposed NCCL | matmul | copy | elementwise | other |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        m = r["record"].get("measured") or {}
        fam = m.get("device_time_s") or {}
        ms = [m.get(k) for k in ("step_s", "host_issue_s", "device_idle_s", "comm_s", "exposed_comm_s")] + [
            fam.get(k) for k in ("matmul", "copy", "elementwise")] + [
            sum(v for k, v in fam.items() if k not in ("matmul", "copy", "elementwise", "nccl")) if fam else None]
        lines.append("| " + " | ".join([r["name"]] + [_f(x and x * 1e3) for x in ms]) + " |")
    return "\n".join(lines)


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


if __name__ == "__main__":
    what, folder = sys.argv[1], Path(sys.argv[2])
    if what == "plan":
        plan(folder, sys.argv[3], "--small" in sys.argv,
             int(sys.argv[sys.argv.index("--gpus") + 1]) if "--gpus" in sys.argv else 4,
             "--sequence-parallel" in sys.argv)
    else:
        run(folder, sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "auto")
