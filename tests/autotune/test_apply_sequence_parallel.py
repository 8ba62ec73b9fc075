"""Megatron's sequence parallelism run by torch's styles (issues 41, 43): the search's Megatron plan with
``sequence_parallel`` (norms and the residual stream split by tokens on the tensor axis) is read as a tensor
layout with sequence parallelism (``autotune.plan.layouts``, no torch) and ``autotune.apply`` places it as
torchtitan does (``SequenceParallel`` norms, the row-parallel outputs reduce-scattered onto ``Shard(1)``, the
embedding's output ``Shard(1)``, the logits a DTensor of vocabulary columns under ``loss_parallel``). On gloo in
float64 the losses and parameters after two Adam steps equal one process's, for transformers' Llama at t = 2
with micro-batches of 1 and 2 sequences (one sequence split over the two ranks, or two), a nanoGPT-style module
(learned positions), and on 2 x 2 (data x tensor, and TP + FSDP); the reduce-scatters run (counted on the
functional collectives: gloo has them on the CPU). A planted bug (the norms computing on their sequence shards
with a plain weight, their gradients never summed over the tensor axis: the classic sequence-parallel bug)
fails it."""
import contextlib
import os
from collections import Counter
from dataclasses import replace
from unittest import mock

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)

from apply_plans import GPT, LLAMA, megatron_baseline  # noqa: E402
from autotune.plan.layouts import fully_shard_layout, local_stream, local_twin, plan_path, tp_layout  # noqa: E402
from autotune.plan.runnable import unrunnable  # noqa: E402
from gloo_runner import run_on_gloo  # noqa: E402
from test_apply_distributed import NanoGPT, mismatch, train  # noqa: E402
from tiny_models import hf_llama  # noqa: E402


def model_of(kind: str, cfg: dict):
    torch.manual_seed(0)
    return hf_llama(cfg, 0) if kind == "llama" else NanoGPT(cfg).double()


def _unsynced_norm(**_):
    """The planted bug: a norm on its sequence shard with its weight a plain tensor (no gradient sum)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)


def torchtitan_sp(model, layers: int):
    """torchtitan's sequence parallelism composed by hand on transformers' Llama (its ``parallelize_llama``, the
    stream a DTensor of sequence shards: the model reads the sequence length from the embedding's output)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    seq, whole = Shard(1), Replicate()
    styles = {"model.embed_tokens": RowwiseParallel(input_layouts=whole, output_layouts=seq, use_local_output=False),
              "model.norm": SequenceParallel(),
              "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    for i in range(layers):
        p = f"model.layers.{i}."
        styles.update({p + "input_layernorm": SequenceParallel(), p + "post_attention_layernorm": SequenceParallel(),
                       p + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                           desired_input_kwarg_layouts={"hidden_states": whole}),
                       p + "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
                       p + "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
                       p + "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=False)})
        styles.update({p + n: ColwiseParallel() for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                           "mlp.gate_proj", "mlp.up_proj")})
    parallelize_module(model, init_device_mesh("cpu", (2,)), styles)
    model._autotune_path = "torchtitan's, by hand"
    return model


def _counted(kind, cfg, plan, how):
    """``apply`` then ``train`` (under the planted bug where ``how`` is "bug", on the DTensor path where it is
    "dtensor"), counting the functional collectives: (path, the counts, the result)."""
    import autotune
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    counts = Counter()
    stream = cfg["micro_batch"] * cfg["sequence"] * cfg["hidden"]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor's own dispatch, whose collectives come back here
            out = func(*args, **(kwargs or {}))
            if func.namespace == "_c10d_functional":
                counts[func.__name__.split(".")[0]] += 1
            elif func.__name__.startswith("cat") and out.numel() == stream:  # a micro-batch's whole stream copied
                counts["stream copies"] += 1
            return out

    with mock.patch.object(torch.distributed.tensor.parallel, "SequenceParallel", _unsynced_norm) \
            if how == "bug" else contextlib.nullcontext():
        model = torchtitan_sp(model_of(kind, cfg), cfg["layers"]) if how == "torchtitan" else \
            autotune.apply(plan, model_of(kind, cfg), path="dtensor" if how == "dtensor" else "auto")
    with Count():
        got = train(model, plan, cfg)
    return model._autotune_path, dict(counts), got


def _reference(kind, cfg, plan):
    return train(model_of(kind, cfg), plan, cfg)


def one_process(kind, cfg, plan):
    """What one process trains, computed in a forked process too (a gloo rank alone): this one never runs
    autograd, whose threads a later fork cannot take (torch's CUDA builds start them)."""
    return run_on_gloo(_reference, [(kind, cfg, plan)], 1)[0][0]


def sp_plan(cfg, d, t, cluster, **kw):
    return megatron_baseline(cfg, d, t, cluster, sequence_parallel=True, **kw)


def replicated_ends(plan):
    """``plan`` with its embedding and logits replicated on the tensor axis (no style: the embedding's output cut
    to the stream's sequence shard, the head fed the gathered stream, the loss on whole logits)."""
    def swap(lay):
        if lay.name in ("embedding", "logits"):
            out = ("S0",) if lay.name == "embedding" else ("B",)
            return replace(lay, output=out, weights=tuple(replace(w, placements=("B",)) for w in lay.weights))
        return replace(lay, input=("B",)) if lay.name == "loss" else lay
    return replace(plan, layers=tuple(swap(lay) for lay in plan.layers), strategy=plan.strategy + ", ends replicated")


def test_the_layout_is_read_from_the_plan():
    """The Megatron plan with sequence parallelism is a tensor layout with it (t = 2; d x t; TP + FSDP: the
    fully_shard layout with it), runnable with a micro-batch of one sequence; without it, or with the norms split
    by tokens while the residual stream stays whole, it is not (the plain layout, the DTensor path)."""
    one = dict(LLAMA, micro_batch=1, batch=2)
    plan = sp_plan(one, (1, 1), (1, 2), (1, 2))
    assert plan_path(plan) == plan.apply_path == "tensor" and tp_layout(plan).sequence_parallel
    assert unrunnable(plan) == [] and tp_layout(replicated_ends(plan)).sequence_parallel
    plain = megatron_baseline(one, (1, 1), (1, 2), (1, 2))
    assert plan_path(plain) == "tensor" and not tp_layout(plain).sequence_parallel
    two = dict(LLAMA, micro_batch=2, batch=4)
    assert tp_layout(sp_plan(two, (2, 1), (1, 2), (2, 2))).sequence_parallel
    fsdp = sp_plan(two, (2, 1), (1, 2), (2, 2), fsdp_axes=(0,))
    assert plan_path(fsdp) == "fully_shard" and fully_shard_layout(fsdp).sequence_parallel
    # a pipeline stage of it: fully_shard's path, each rank's sequence shard crossing the boundaries
    assert local_twin(fsdp).plan is fsdp and "B" not in local_stream(fsdp)
    residual = plan.layer("residual")  # the stream whole while the norms are split: no layout of torch's styles
    broken = replace(plan, layers=tuple(replace(lay, input=("B",), output=("B",)) if lay is residual else lay
                                        for lay in plan.layers))
    assert tp_layout(broken) is None and plan_path(broken) == "dtensor"


def test_sequence_parallel_matches_one_process_on_two_ranks():
    """t = 2: Llama with micro-batches of 1 and 2 sequences (and with its embedding and head replicated) and
    nanoGPT (learned positions), each against one process, the reduce-scatters counted (none without sequence
    parallelism, and as many as torchtitan's styles composed by hand issue); the planted bug differs; on the
    DTensor path (``path="dtensor"``) the plan is refused in a line."""
    jobs = []
    for kind, base, mb in (("llama", LLAMA, 1), ("llama", LLAMA, 2), ("gpt", GPT, 2)):
        cfg = dict(base, micro_batch=mb, batch=2 * mb)
        jobs.append((kind, cfg, sp_plan(cfg, (1, 1), (1, 2), (1, 2)), None))
    cfg = jobs[0][1]
    jobs += [("llama", cfg, replicated_ends(jobs[0][2]), None),
             ("llama", cfg, megatron_baseline(cfg, (1, 1), (1, 2), (1, 2)), None),
             ("llama", cfg, jobs[0][2], "bug"), ("llama", cfg, jobs[0][2], "dtensor"),
             ("llama", cfg, jobs[0][2], "torchtitan")]
    results = run_on_gloo(_counted, jobs, 2)[0]
    for (kind, cfg, plan, how), got in zip(jobs, results):
        assert not isinstance(got, str) or how, got
        if how == "dtensor":  # a sequence split the DTensor path cannot give transformers' Llama: one line
            assert got.startswith("UserError: the plan splits each sequence of its residual stream over 2 devices"), got
            continue
        if how == "bug":
            assert isinstance(got, str) or mismatch(one_process(kind, cfg, plan), got[2]) is not None, \
                "the unsynced norms went unnoticed"
            continue
        path, counts, got = got
        want = one_process(kind, cfg, plan)
        if how == "torchtitan":  # the same numbers and the same sequence-parallel collectives as apply's
            assert mismatch(want, got) is None and all(counts.get(c) == results[0][1].get(c) for c in (
                "reduce_scatter_tensor", "all_gather_into_tensor")), (counts, results[0][1])
            continue
        assert path == "tensor" and mismatch(want, got) is None, (kind, cfg["micro_batch"], mismatch(want, got))
        passes = 2 * plan.micro_batches  # two steps of the plan's micro-batches
        # each pass: the embedding's and each block's two row-parallel outputs forward, the norms' gathers backward
        rs = 2 * (1 + 2 * cfg["layers"]) if tp_layout(plan).sequence_parallel else 0
        if "ends replicated" in plan.strategy:  # none of the embedding's partial sums, nor of the whole head's
            rs -= 2  # input gradient (the same on every rank: its shard taken)
        assert counts.get("reduce_scatter_tensor", 0) == passes * rs, (kind, plan.strategy, counts)
        if "ends replicated" not in plan.strategy:  # each of them copies the stream whole once, and each all-gather
            gathers = rs if cfg["micro_batch"] > 1 else 0  # where a rank holds more than one sequence
            assert counts.get("stream copies", 0) == passes * (rs + gathers), counts  # hostpace.sequence_copies_s


def test_sequence_parallel_on_data_and_tensor_axes():
    """2 x 2, a micro-batch of 2 sequences: data x tensor (each data rank one sequence, split over t) on the
    tensor path, and TP + FSDP with sequence parallelism on fully_shard, each against one process."""
    cfg = dict(LLAMA, micro_batch=2, batch=4)
    jobs = [("llama", cfg, sp_plan(cfg, (2, 1), (1, 2), (2, 2)), None),
            ("llama", cfg, sp_plan(cfg, (2, 1), (1, 2), (2, 2), fsdp_axes=(0,)), None)]
    results = run_on_gloo(_counted, jobs)[0]
    want = one_process("llama", cfg, jobs[0][2])
    for (_, _, plan, _), got, path in zip(jobs, results, ("tensor", "fully_shard")):
        assert not isinstance(got, str), got
        assert got[0] == path and mismatch(want, got[2]) is None, (plan.strategy, got[0], mismatch(want, got[2]))
        assert got[1].get("reduce_scatter_tensor", 0) > 0, got[1]


def test_the_search_offers_sequence_parallelism_where_plain_megatron_does_not_fit():
    """Llama 3 8B on 1 x 2 H200 (84 GiB), micro-batches of 2 sequences of 8,192: Megatron without sequence
    parallelism does not fit (at any recomputation), with it it does, on the tensor path, runnable, and the plan
    returned is no dearer than it (it is the baseline where the search finds nothing cheaper); with micro-batches
    of 1 plain Megatron fits too, and the plan returned is no dearer than either (on the H200 profile's measured
    norms, the sequence-parallel one is the cheaper of the two: its norms on half the tokens outweigh its fp32
    norm outputs all-gathered under autocast, where the plain plan all-reduces bf16)."""
    import autotune
    from autotune.sbp.mesh import Cluster
    from autotune.sbp.search import Budget
    from models import load_model

    def search(mb):
        graph = load_model("llama", "llama3-8b", {"batch": 16, "micro_batch": mb, "sequence": 8192})
        return autotune.search(graph, Cluster(1, 2), "h200-nvlink+ib400", memory_limit=84 * 2**30,
                               budget=Budget(steps=60), compare=(), pipeline="off")
    found = search(2)
    sp = next(b for b in found.baselines if b.search.get("sequence_parallel"))
    plain = next(b for b in found.baselines if b.strategy.startswith("Megatron ("))
    assert sp.apply_path == "tensor" and tp_layout(sp).sequence_parallel and unrunnable(sp) == []
    assert sp.costs.fits_memory and not plain.costs.fits_memory
    assert found.best.costs.fits_memory and found.best.costs.step_s <= sp.costs.step_s
    small = search(1)
    sp = next(b for b in small.baselines if b.search.get("sequence_parallel"))
    plain = next(b for b in small.baselines if b.strategy.startswith("Megatron ("))
    assert sp.costs.fits_memory and plain.costs.fits_memory and small.best.costs.fits_memory
    assert small.best.costs.step_s <= sp.costs.step_s < plain.costs.step_s


def test_the_baseline_keeps_to_meshes_apply_runs():
    """``megatron_sp`` on 2 x 2: t after d on the fine axes (t inside a node, or d over whole nodes), the plan it
    gives with a sequence-parallel layout; t across the nodes with d inside them is Megatron's plan but not the
    tensor path's order, and t = 1 is data parallelism: neither."""
    from autotune.plan import load_plan
    from autotune.plan.build import build as build_plan
    from autotune.plan.layouts import sequence_axes
    from autotune.sbp.baselines import megatron_sp, sequence_problem
    from autotune.sbp.boxing import Coster
    from autotune.sbp.mesh import Cluster
    from calibrate.profile import Profile
    from models import load_model
    fields = {k: v for k, v in dict(LLAMA, micro_batch=2, batch=4).items() if k != "kind"}
    pr = sequence_problem(load_model("llama", None, fields), Coster(Profile.load("h200-nvlink+ib400"), Cluster(2, 2)),
                          None, "comm")
    from autotune.sbp.baselines import megatron_assignment
    across = megatron_assignment(pr, (1, 2), (2, 1), sequence_parallel=True)  # t across nodes, d inside them
    assert across is not None and not sequence_axes(load_plan(build_plan(pr, across, "across")))
    assert megatron_sp(pr, (1, 2), (2, 1)) is None
    assert megatron_sp(pr, (2, 2), (1, 1)) is None  # t = 1: data parallelism
    inside = megatron_sp(pr, (2, 1), (1, 2))
    assert inside is not None and sequence_axes(load_plan(build_plan(pr, inside, "sp"))) == (1,)
