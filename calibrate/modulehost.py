"""The host's cost of each of ``autotune.apply``'s paths on the user's module (``calibrate.usermodule``): per block
and micro-batch and per block and step, the ``1 + MORE``-block model's issue time less the one-block model's over
``MORE``, on a process group of one (``host_seconds``), among 2 GPUs for the paths whose collectives a group of one
skips (``peer_host``), or under torch's fake process group of 2 on one device (``fake_host``); and the same on
calibrate's reference block for ``calibrate compute`` (``reference_host``). The memory each path holds beyond the
plain module, and the allocator's fragmentation, come from the same models (``calibrate.module``'s ``memory``).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import tempfile

from calibrate.allocator import allocator_of
from calibrate.compute import HOST_PATHS, OUTSIDE_HOST_PATHS
from calibrate.device.peers import run_peers
from calibrate.errors import UserError
from calibrate.measure.torcharm import TorchArm, medians, timing
from calibrate.usermodule import MORE, REFERENCE, Timed, UserModule, rebuild

# apply's paths (``calibrate.compute.HOST_PATHS``) timed on a process group of one: the tensor path's styles need
# the ranks of a tensor-parallel group (``peer_host``: among 2 GPUs, or under torch's fake group of 2 on one)
ONE_GROUP_PATHS = ("none",) + tuple(p for p in HOST_PATHS if p not in ("none", "tensor", "sequence"))
REFERENCE_OCCURRENCES = 10  # a Llama block's layer occurrences in the step model's graph (models.transformer)
# REFERENCE as a config.json of transformers' own Llama: the block ``reference_host`` times where transformers is
# installed (the class users import issues more than the plain-torch reference module: 1.35 x on one H200)
REFERENCE_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": REFERENCE["hidden"],
                "num_attention_heads": REFERENCE["heads"], "num_key_value_heads": REFERENCE["kv_heads"],
                "head_dim": REFERENCE["hidden"] // REFERENCE["heads"], "intermediate_size": REFERENCE["ffn"],
                "vocab_size": REFERENCE["vocabulary"], "num_hidden_layers": 1, "max_position_embeddings": 512,
                "tie_word_embeddings": False}


@contextlib.contextmanager
def _group_of_one(torch, device):
    """A process group of this process alone (unless one exists): DDP and FSDP need one."""
    dist = torch.distributed
    if dist.is_initialized():
        yield False
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
        try:
            yield True
        finally:
            dist.destroy_process_group()


def _wrap(torch, m: Timed, path: str) -> None:
    """Place the model on apply's ``path`` over the process group of one."""
    if path == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        m.model = DistributedDataParallel(m.model, device_ids=[m.device.index] if m.cuda else None)
    elif path == "dtensor":  # every Linear's weight a DTensor, its output made whole again: DTensor's dispatch on
        # each of its ops and a redistribution at every layer's boundary (the per-layer placement path's pattern)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        mesh = init_device_mesh(m.device.type, (torch.distributed.get_world_size(),))
        plan = {name: ColwiseParallel(output_layouts=Replicate()) for name, mod in m.model.named_modules()
                if isinstance(mod, torch.nn.Linear)}
        parallelize_module(m.model, mesh, plan)
    elif path in ("tensor", "sequence"):  # torchtitan's styles on the blocks over every rank of the group
        _tensor_parallel(torch, m, sequence=path == "sequence")
    elif path == "fully_shard":
        from torch.distributed.fsdp import fully_shard
        for block in blocks_of(torch, m.model):
            fully_shard(block)
        fully_shard(m.model)
    m.opt = torch.optim.AdamW(param_groups(m.model), lr=1e-5, fused=m.cuda)


def blocks_of(torch, model) -> list:
    """The model's blocks: its first non-empty ``nn.ModuleList``'s modules."""
    lists = [mod for mod in model.modules() if isinstance(mod, torch.nn.ModuleList) and len(mod)]
    return list(lists[0]) if lists else []


# the block's modules by name, as apply's tensor path places them (the reference block's and transformers' Llama,
# Qwen2 and Mistral names): column-wise, row-wise, and the norms whose output the column-wise layers read
COLWISE = ("q", "k", "v", "gate", "up", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o", "down", "o_proj", "down_proj")
NORMS = ("ln1", "ln2", "input_layernorm", "post_attention_layernorm")


def _tensor_parallel(torch, m: Timed, sequence: bool = False) -> None:
    """The model's blocks placed as apply's tensor path places a Llama (``autotune.apply.tensor``) over every rank
    of the group: each norm's output a replicated DTensor once, the projections that read it column-wise, the
    two that write the stream row-wise; the embedding and the head split by vocabulary where the model names them
    (``_vocabulary_layers``), the loss then under ``loss_parallel`` (``Timed.loss_context``), else as they are.
    ``sequence``: with sequence parallelism (the "sequence" path): the stream between the regions a DTensor split
    by tokens, each norm ``SequenceParallel`` and its output gathered once, the row-wise outputs reduce-scattered
    onto it; the first block takes the stream whole and splits it, the last hands it back whole (the model's
    edges, outside the blocks' difference). A block with other names is not placed: said by the caller as a path
    not measured."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(m.device.type, (world,))
    tokens = Shard(1)
    blocks = blocks_of(torch, m.model)
    for block in blocks:
        styles = {}
        for name, mod in block.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            linear = isinstance(mod, torch.nn.Linear)
            if linear and leaf in COLWISE:
                styles[name] = [ColwiseParallel()]
            elif linear and leaf in ROWWISE:
                styles[name] = [RowwiseParallel(output_layouts=tokens, use_local_output=False) if sequence
                                else RowwiseParallel()]
            elif leaf in NORMS:
                styles[name] = [SequenceParallel()] * sequence + [PrepareModuleOutput(
                    output_layouts=tokens if sequence else Replicate(), desired_output_layouts=Replicate(),
                    use_local_output=False)]
        if not any(isinstance(v[0], RowwiseParallel) for v in styles.values()):
            raise ValueError(f"no projections named {', '.join(ROWWISE)} in {type(block).__name__}")
        for name, chain in styles.items():
            for style in chain:
                parallelize_module(block.get_submodule(name), mesh, style)
        for attr in ("h", "kv"):  # the reference block's heads per rank (transformers' blocks infer theirs)
            if hasattr(block, attr):
                setattr(block, attr, getattr(block, attr) // world)
    embedding, head = _vocabulary_layers(torch, m.model, world)
    if embedding is not None:  # by vocabulary, as apply's tensor path: rows, and columns for loss_parallel
        parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate()))
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        m.parallel_loss = True
    if sequence:
        parallelize_module(blocks[0], mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                               desired_input_layouts=(tokens,), use_local_output=False))
        parallelize_module(blocks[-1], mesh, PrepareModuleOutput(output_layouts=tokens,
                                                                 desired_output_layouts=Replicate(),
                                                                 use_local_output=True))


def _vocabulary_layers(torch, model, world: int) -> tuple:
    """(the input embedding, the output head) of a model that names them as transformers' models do
    (``get_input_embeddings``, ``get_output_embeddings``): an ``nn.Embedding`` and an ``nn.Linear`` of their own
    weights (not tied) whose vocabulary ``world`` divides; (None, None) otherwise."""
    try:
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None, None
    ok = isinstance(embedding, torch.nn.Embedding) and type(head) is torch.nn.Linear \
        and head.weight is not embedding.weight and embedding.num_embeddings % world == 0 \
        and head.out_features % world == 0
    return (embedding, head) if ok else (None, None)


def param_groups(module) -> list[dict]:
    """``module``'s trainable parameters as optimizer parameter groups of one kind each: the DTensors and the
    plain tensors (torch's fused AdamW refuses a group that mixes them):
    ``torch.optim.AdamW(param_groups(module), fused=True)`` (``autotune.param_groups``)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in module.parameters() if p.requires_grad]
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": g} for g in groups if g]


def host_seconds(torch, um: UserModule, micro_batch: int, sequence: int, device, iters: int, warmup: int,
                 progress, paths=ONE_GROUP_PATHS, memory: dict | None = None, outside: dict | None = None,
                 strict: bool = False) -> dict:
    """Per path (``paths``): (seconds the host takes to issue one block's forward and backward, and its
    optimizer step), the ``1 + MORE``-block model's issue time less the one-block model's, over ``MORE`` (as the
    compute's blocks: the difference of two whole models' times divided), each call timed by the host clock (an
    engine arm on the CPU's clock) with the device synchronised after it. On CUDA, ``memory`` (given) receives the
    module section's memory figures (``calibrate.module``): each path's peak allocated over a step of the larger
    model beyond the plain module's, per parameter, and the fragmentation on the plain path. ``outside`` (given)
    receives, for the paths of ``OUTSIDE_HOST_PATHS`` whose vocabulary layers were placed, the one-block model's
    (per micro-batch, per step) issue time less a block's: the host's cost of the model outside its blocks. A path
    this torch cannot place is said and skipped; ``strict`` (a rank of several: its peers would wait in that path's
    collectives for ever) raises it instead."""
    out, peaks = {}, {}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    with _group_of_one(torch, device):
        for path in paths:
            models = arms = m = None
            try:
                models = {n: Timed(torch, um, n, 1, device) for n in (1, 1 + MORE)}
                for m in models.values():
                    if path != "none":
                        _wrap(torch, m, path)
                    m.inputs(micro_batch, sequence, um.model["vocabulary"])
                    m.both(0)
                    m.opt.step()
                arms = [(f"{k}{n}", (lambda fn: lambda: TorchArm(torch, "cpu", fn, sync))(fn))
                        for n, m in models.items() for k, fn in (("fb", m.both), ("o", m.step))]
                med = medians(torch, arms, timing(iters, warmup, back_to_back=False))
                big = 1 + MORE
                out[path] = (max(med[f"fb{big}"] - med["fb1"], 0.0) / MORE, max(med[f"o{big}"] - med["o1"], 0.0) / MORE)
                if outside is not None and path in OUTSIDE_HOST_PATHS and models[1].parallel_loss:
                    outside[path] = (max(med["fb1"] - out[path][0], 0.0), max(med["o1"] - out[path][1], 0.0))
                    progress(f"host {path} outside the blocks: {outside[path][0] * 1e6:.0f} us per micro-batch, "
                             f"{outside[path][1] * 1e6:.0f} us per step")
                if device.type == "cuda":
                    peaks[path] = (*_step_peak(torch, models[big], device), models[big].params)
                progress(f"host {path}: {out[path][0] * 1e6:.0f} us per block and micro-batch, "
                         f"{out[path][1] * 1e6:.0f} us per block and step")
            except UserError:
                raise
            except Exception as e:  # a path this torch cannot place on a group of one: said, the rest go on
                if strict:
                    raise
                progress(f"host {path}: not measured ({type(e).__name__}: {str(e)[:120]})")
            finally:  # every reference to the path's models (``m``, the arms) dropped before the cache is emptied:
                models = arms = m = None  # else the next path is built beside this one (8 B on 2 GPUs: OOM)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if memory is not None and "none" in peaks:
        base_alloc, base_reserved, params = peaks["none"]
        memory["fragmentation"] = min(max(base_reserved / base_alloc - 1.0, 0.0), 1.0)
        memory["allocator"] = allocator_of(os.environ)
        memory["path_bytes_per_param"] = {p: (a - base_alloc) / params for p, (a, _, _) in peaks.items() if p != "none"}
    return out


def _step_peak(torch, m: Timed, device) -> tuple[int, int]:
    """(peak allocated, peak reserved) over one step (forward and backward, optimizer) from a clean cache."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    m.both(0)
    m.step(0)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


# the paths whose collectives a group of one skips
PEER_HOST_PATHS = ("ddp", "fully_shard", "tensor", "sequence", "dtensor")
# of them, those whose host cost torch's fake process group of 2 (every collective a no-op; torchtitan's dry run
# uses it) measures on one device as 2 GPUs do: the tensor styles' block 13.99 ms a micro-batch under it, 13.70
# among 2 H200s (plans_h200x2.md, session 21). Not DDP (its reducer refuses the fake group), nor fully_shard and
# the DTensor path, whose real collectives' host cost the fake group leaves out (25-40% under, calib.md)
FAKE_HOST_PATHS = ("tensor", "sequence")
AMONG_PEERS = "among 2 GPUs"
UNDER_FAKE = "under torch's fake process group of 2 on one device"


def peer_host(torch, recipe: tuple, micro_batch: int, sequence: int, device, iters: int, warmup: int,
              progress) -> tuple[dict, dict, str]:
    """``host_seconds`` of the paths a group of one cannot time for the module ``recipe`` builds, its figures
    outside the blocks (``host_seconds``' ``outside``), and where they were timed: where 2 GPUs are visible,
    ``PEER_HOST_PATHS`` in each of 2 processes of one NCCL group (each path issuing its collectives as in a job of
    2: 2 x H200, 2026-11-28, a tensor-parallel step of a 1.5 B Llama issued 670 ms where the group of one's figure
    gave 497), rank 0's; else, or where a path fails there (a rank raises it, so that no rank waits in a
    collective its peer left: 2 x H200, 2026-11-29, an 8 B Llama's hung), ``FAKE_HOST_PATHS`` under torch's fake
    process group of 2 in this process (``fake_host``); ({}, {}, "") where neither can run."""
    if not recipe:
        return {}, {}, ""
    if torch.cuda.device_count() < 2:
        return fake_host(torch, rebuild(recipe), micro_batch, sequence, device, iters, warmup, progress)
    try:
        got = run_peers(_peer_job, (recipe, micro_batch, sequence, iters, warmup),
                        what="the apply paths' host cost among 2 GPUs")
    except UserError as e:  # a path failed on a rank (its error named): what one device can time, and said
        progress(f"host among 2 GPUs: not measured ({e}); the tensor paths under torch's fake group of 2 instead")
        return fake_host(torch, rebuild(recipe), micro_batch, sequence, device, iters, warmup, progress)
    for line in got["lines"]:
        progress(f"{line} ({AMONG_PEERS})")
    return (*({k: tuple(float(x) for x in v) for k, v in got[key].items()} for key in ("host_s", "outside_s")),
            AMONG_PEERS)


def fake_host(torch, um: UserModule, micro_batch: int, sequence: int, device, iters: int, warmup: int,
              progress) -> tuple[dict, dict, str]:
    """``host_seconds`` of ``FAKE_HOST_PATHS`` (and their figures outside the blocks) as rank 0 of torch's fake
    process group of 2, set up and destroyed here; ({}, {}, "") inside a distributed job or where this torch has
    no fake group."""
    dist = torch.distributed
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return {}, {}, ""
    if dist.is_initialized():
        return {}, {}, ""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    outside: dict = {}
    try:
        host = host_seconds(torch, um, micro_batch, sequence, device, iters, warmup,
                            lambda line: progress(f"{line} (fake group of 2)"), FAKE_HOST_PATHS, outside=outside)
    finally:
        dist.destroy_process_group()
    return host, outside, UNDER_FAKE if host else ""


def _peer_job(torch, device, world: int, recipe: tuple, micro_batch: int, sequence: int, iters: int,
              warmup: int) -> dict:
    """``host_seconds`` of ``PEER_HOST_PATHS`` on one of ``calibrate.device.peers``' ranks."""
    lines: list = []
    outside: dict = {}
    host = host_seconds(torch, rebuild(recipe), micro_batch, sequence, device, iters, warmup, lines.append,
                        PEER_HOST_PATHS, outside=outside, strict=True)
    return {"host_s": host, "outside_s": outside, "lines": lines}


def reference_recipe() -> tuple:
    """The ``rebuild`` recipe of the block ``reference_host`` times: transformers' own Llama of the REFERENCE shape
    (``REFERENCE_HF``: what users run) where transformers is installed, else the project's ``reference_module``."""
    try:
        importlib.import_module("transformers")
    except ImportError:
        return ("reference",)
    return ("hf", REFERENCE_HF, "calibrate's reference block")


def reference_host(torch, device, iters: int, warmup: int, progress) -> tuple[dict, dict, str, tuple, str]:
    """``compute.host_s`` (``calibrate.compute``): per apply path, the host's seconds per layer occurrence of the step
    model's graph, per micro-batch and per step: the reference block's (``reference_recipe``) per block
    (``host_seconds``, micro-batch 1 of 512 tokens) over ``REFERENCE_OCCURRENCES``; on a group of one, and those of
    the rest where ``peer_host`` can time them; ``compute.host_outside_s``, the reference model's outside its blocks
    on the paths that split it by vocabulary; which block that was; the paths ``peer_host`` timed, and where."""
    recipe = reference_recipe()
    um = rebuild(recipe)
    per_block = host_seconds(torch, um, 1, 512, device, iters, warmup, progress)
    peers, outside, where = peer_host(torch, recipe, 1, 512, device, iters, warmup, progress)
    per_block.update(peers)
    return ({path: (a / REFERENCE_OCCURRENCES, b / REFERENCE_OCCURRENCES) for path, (a, b) in per_block.items()},
            outside, um.name, tuple(peers), where)
