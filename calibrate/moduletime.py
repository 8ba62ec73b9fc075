"""Timing the user's own transformer module on one device: ``python -m calibrate module`` writes the
profile's ``module`` section (``calibrate.module``; the rule there).

The module is either a Hugging Face ``config.json`` (LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM, GPT2LMHeadModel: transformers' own classes, built from the config with random
weights, SDPA attention) or a factory ``package.module:factory`` called with a dict of the model's
fields (kind, layers, hidden, heads, kv_heads, head_dim, ffn, vocabulary, sequence, micro_batch, batch)
that returns an ``nn.Module`` whose ``forward(ids, targets)`` returns the mean loss (what ``python -m
autotune execute --module`` trains). One block is timed, not the whole model: a model of ``1 + MORE``
blocks less one of one block, over ``MORE`` (the difference of two whole models' times is noisy where the
layers outside the blocks dominate, a large vocabulary's; ``MORE`` blocks divide the noise), each at every
local shape (tensor width, micro-batch, sequence), through the
measurement engine (``calibrate.measure``: arms interleaved in rounds, the median). The recipe is the
one users run: fp32 parameters, bf16 autocast on CUDA, AdamW (fused on CUDA). torch is imported by the
caller and passed in.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass, replace
from typing import Callable

from calibrate.allocator import allocator_of
from calibrate.compute import HOST_PATHS, OUTSIDE_HOST_PATHS
from calibrate.device.peers import run_each, run_peers
from calibrate.errors import UserError
from calibrate.measure.torcharm import TorchArm, medians, timing
from calibrate.module import STEP_MICRO_BATCHES, ModulePoint, ModuleSection

# transformers' classes and their model_type (a config saved by XConfig.save_pretrained has no architectures)
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                    "GPT2LMHeadModel": "gpt2"}
# apply's paths (``calibrate.compute.HOST_PATHS``) timed on a process group of one: the tensor path's styles need
# the ranks of a tensor-parallel group (``peer_host``: among 2 GPUs, or under torch's fake group of 2 on one)
ONE_GROUP_PATHS = ("none",) + tuple(p for p in HOST_PATHS if p not in ("none", "tensor", "sequence"))
REFERENCE = {"hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 688, "vocabulary": 1024}  # host-bound on any GPU
REFERENCE_OCCURRENCES = 10  # a Llama block's layer occurrences in the step model's graph (models.transformer)
# REFERENCE as a config.json of transformers' own Llama: the block ``reference_host`` times where transformers is
# installed (the class users import issues more than the plain-torch reference module: 1.35 x on one H200)
REFERENCE_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": REFERENCE["hidden"],
                "num_attention_heads": REFERENCE["heads"], "num_key_value_heads": REFERENCE["kv_heads"],
                "head_dim": REFERENCE["hidden"] // REFERENCE["heads"], "intermediate_size": REFERENCE["ffn"],
                "vocab_size": REFERENCE["vocabulary"], "num_hidden_layers": 1, "max_position_embeddings": 512,
                "tie_word_embeddings": False}

MORE = 3  # the larger model of a point has 1 + MORE blocks


@dataclass(frozen=True)
class UserModule:
    """How to build the user's module at a local shape and run one forward to its loss."""

    name: str  # "transformers:LlamaForCausalLM" or the factory's spec
    model: dict  # the global shape (calibrate.module.MODEL_KEYS)
    build: Callable[[int, int], object]  # (blocks, tensor width) -> nn.Module
    loss: Callable[[object, object], object]  # (module, ids) -> loss
    widths: tuple[int, ...]  # tensor widths the module can be divided by
    checkpoint: Callable[[object, bool], bool]  # (module, on) -> whether recomputation could be switched
    recipe: tuple = ()  # (constructor name, its arguments): how another process builds the same (``rebuild``)


def rebuild(recipe: tuple) -> UserModule:
    """The ``UserModule`` a ``recipe`` names, in a process of its own (``peer_host``'s)."""
    name, *args = recipe
    return {"hf": hf_module, "factory": factory_module, "reference": reference_module}[name](*args)


def _divisors(*counts: int, most: int = 8) -> tuple[int, ...]:
    return tuple(t for t in (1, 2, 4, 8) if t <= most and all(c % t == 0 for c in counts))


def hf_module(cfg: dict, origin: str) -> UserModule:
    """transformers' class of a ``config.json`` (its ``architectures``, else its ``model_type``), built from the
    config."""
    archs = cfg.get("architectures") or [a for a, t in HF_ARCHITECTURES.items() if t == cfg.get("model_type")]
    if len(archs) != 1 or archs[0] not in HF_ARCHITECTURES:
        raise UserError(f"{origin}: architectures {cfg.get('architectures')!r}, model_type "
                        f"{cfg.get('model_type')!r}; calibrate module builds one of "
                        f"{', '.join(HF_ARCHITECTURES)} from a config.json (else pass --module pkg.mod:factory)")
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise UserError("calibrate module --model config.json needs the transformers package: pip install "
                        "transformers") from None
    arch = archs[0]
    cls = getattr(transformers, arch)
    gpt2 = arch == "GPT2LMHeadModel"
    keys = {"layers": "n_layer", "heads": "n_head", "hidden": "n_embd"} if gpt2 else \
        {"layers": "num_hidden_layers", "heads": "num_attention_heads", "hidden": "hidden_size",
         "kv_heads": "num_key_value_heads", "ffn": "intermediate_size"}
    try:
        hidden, heads = int(cfg[keys["hidden"]]), int(cfg[keys["heads"]])
        kv = heads if gpt2 else int(cfg.get(keys["kv_heads"]) or heads)
        ffn = int(cfg.get("n_inner") or 4 * hidden) if gpt2 else int(cfg[keys["ffn"]])
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{origin}: {e} missing or not a number: give the model's whole config.json") from None
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    # GPT-2's head size is n_embd / n_head: its heads cannot be divided without changing it
    widths = (1,) if gpt2 else _divisors(heads, kv, ffn, vocab)

    def build(blocks: int, t: int):  # use_cache as the config says (transformers' default, on: built in training)
        local = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype", "dtype")}
        local.update({keys["layers"]: blocks, "vocab_size": vocab // t})
        if not gpt2:
            local.update({keys["heads"]: heads // t, keys["kv_heads"]: kv // t, keys["ffn"]: ffn // t,
                          "head_dim": head_dim})
        conf = cls.config_class.from_dict(local)
        conf._attn_implementation = "sdpa"
        return cls(conf)

    def loss(model, ids):
        return model(input_ids=ids, labels=ids).loss

    def checkpoint(model, on: bool) -> bool:  # named gradient_ in every transformers 5 (deprecated in 5.2x: quiet)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if on:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
        return True

    return UserModule(f"transformers:{arch}", {"hidden": hidden, "heads": heads, "kv_heads": kv, "ffn": ffn,
                                              "vocabulary": vocab}, build, loss, widths, checkpoint,
                      ("hf", cfg, origin))


def factory_module(spec: str, fields: dict) -> UserModule:
    """A factory ``package.module:factory`` called with the model's fields (module docstring)."""
    name, sep, attr = spec.partition(":")
    if not sep or not name or not attr:
        raise UserError(f"--module {spec!r} is not package.module:factory (e.g. models.modules:build)")
    try:
        factory = getattr(importlib.import_module(name), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"--module {spec!r}: cannot load it ({e}): put it on PYTHONPATH or fix the name") from None
    if fields.get("kind") == "gpt" and "ffn" not in fields and isinstance(fields.get("hidden"), int):
        fields = dict(fields, ffn=4 * fields["hidden"])  # a gpt model JSON's default, as the search reads it
    missing = [k for k in ("hidden", "heads", "ffn", "vocabulary") if not isinstance(fields.get(k), int)]
    if missing:
        raise UserError(f"--module needs the model's fields from --model (a model JSON with {', '.join(missing)})")
    heads, kv, ffn, vocab = fields["heads"], fields.get("kv_heads") or fields["heads"], fields["ffn"], \
        fields["vocabulary"]

    def build(blocks: int, t: int):
        local = dict(fields, layers=blocks, heads=heads // t, kv_heads=kv // t, ffn=ffn // t, vocabulary=vocab // t,
                     head_dim=fields.get("head_dim") or fields["hidden"] // heads)
        try:
            return factory(local)
        except UserError:
            raise
        except Exception as e:  # the user's code: one line
            raise UserError(f"{spec}(config) raised {type(e).__name__}: {e}: it is called with the model's fields "
                            f"(a dict: layers, hidden, heads, ...); make it build the model from that") from None

    def checkpoint(model, on: bool) -> bool:
        fn = getattr(model, "gradient_checkpointing_enable" if on else "gradient_checkpointing_disable", None)
        if fn is None:
            return False
        fn()
        return True

    return UserModule(spec, {"hidden": fields["hidden"], "heads": heads, "kv_heads": kv, "ffn": ffn,
                             "vocabulary": vocab}, build, lambda model, ids: loss_of(model(ids, ids), spec),
                      _divisors(heads, kv, ffn, vocab), checkpoint, ("factory", spec, fields))


def loss_of(out, spec: str):
    """The mean loss a user's ``forward(ids, targets)`` returns: the 0-d tensor itself, nanoGPT's ``(logits,
    loss)`` (the tuple's 0-d tensor) or a Hugging Face output's ``.loss``; anything else refused in one line."""
    if isinstance(out, (tuple, list)):
        found = [x for x in out if getattr(x, "dim", None) is not None and x.dim() == 0]
        out = found[0] if len(found) == 1 else out
    out = getattr(out, "loss", out)
    if getattr(out, "dim", None) is None or out.dim() != 0:
        raise UserError(f"{spec}'s model returned a {type(out).__name__} from forward(ids, targets), not the mean "
                        f"loss: return the loss (a 0-d tensor), (logits, loss) as nanoGPT does, or an output with "
                        f".loss")
    return out


def reference_module() -> UserModule:
    """A small Llama written as users write it (RMSNorm in fp32, separate q, k, v projections, rotary, SDPA with
    grouped K/V heads, SwiGLU), in plain torch: what ``calibrate compute`` times the host's cost of apply's paths
    on (its kernels are shorter than their issue: the step is the host's)."""
    c = REFERENCE

    def build(blocks: int, t: int):
        import torch
        from torch import nn
        from torch.nn import functional as F

        from calibrate.layers import _rms, _rotate_half
        d = c["hidden"] // c["heads"]

        class Norm(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(c["hidden"]))

            def forward(self, x):
                return _rms(torch, x, self.weight)

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                h, kv = c["heads"] // t, c["kv_heads"] // t
                self.h, self.kv = h, kv
                self.ln1, self.ln2 = Norm(), Norm()
                self.q, self.k, self.v = (nn.Linear(c["hidden"], n * d, bias=False) for n in (h, kv, kv))
                self.o = nn.Linear(h * d, c["hidden"], bias=False)
                self.gate, self.up = (nn.Linear(c["hidden"], c["ffn"] // t, bias=False) for _ in range(2))
                self.down = nn.Linear(c["ffn"] // t, c["hidden"], bias=False)

            def forward(self, x):
                b, s, _ = x.shape
                y = self.ln1(x)
                q, k, v = (p(y).view(b, s, n, d).transpose(1, 2) for p, n in
                           ((self.q, self.h), (self.k, self.kv), (self.v, self.kv)))
                q, k = (z + _rotate_half(torch, z) for z in (q, k))
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
                x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
                y = self.ln2(x)
                return x + self.down(F.silu(self.gate(y)) * self.up(y))

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.embedding = nn.Embedding(c["vocabulary"] // t, c["hidden"])
                self.blocks = nn.ModuleList(Block() for _ in range(blocks))
                self.norm, self.head = Norm(), nn.Linear(c["hidden"], c["vocabulary"] // t, bias=False)

            def forward(self, ids, targets):
                x = self.embedding(ids)
                for block in self.blocks:
                    x = block(x)
                logits = self.head(self.norm(x))
                return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

        return Model()

    return UserModule("calibrate.moduletime:reference_module", dict(REFERENCE), build,
                      lambda model, ids: model(ids, ids), _divisors(*REFERENCE.values()), lambda model, on: False,
                      ("reference",))


class _Timed:
    """One model (one block, two or ``1 + MORE``) on the device with its optimizer and the arms that time it."""

    def __init__(self, torch, um: UserModule, blocks: int, t: int, device):
        self.torch, self.um, self.device = torch, um, device
        self.cuda = device.type == "cuda"
        try:
            with device if self.cuda else contextlib.nullcontext():  # made on the GPU: no CPU initialisation
                model = um.build(blocks, t)
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{um.name}: building it with {blocks} block(s) at tensor width {t} raised "
                            f"{type(e).__name__}: {e}") from None
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"{um.name} built a {type(model).__name__}, not a torch.nn.Module: return the model")
        self.model = model.to(device=device, dtype=torch.float32).train()
        self.params = sum(p.numel() for p in self.model.parameters())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=self.cuda)
        self.ids = None
        self.parallel_loss = False  # the head's output split by vocabulary: the loss under torch's loss_parallel

    def loss_context(self):
        """The context a loss and its backward run in: torch's ``loss_parallel`` where the logits are split by
        vocabulary (``_tensor_parallel``), else none."""
        if not self.parallel_loss:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()

    def inputs(self, micro_batch: int, sequence: int, vocab: int) -> None:
        g = self.torch.Generator(device="cpu").manual_seed(0)
        self.ids = [self.torch.randint(0, vocab, (micro_batch, sequence), generator=g).to(self.device)
                    for _ in range(2)]

    def forward(self, i: int):
        with self.torch.autocast(self.device.type, dtype=self.torch.bfloat16, enabled=self.cuda):
            return self.um.loss(self.model, self.ids[i % 2])

    def both(self, i: int) -> None:
        for p in self.model.parameters():
            p.grad = None
        with self.loss_context():
            self.forward(i).backward()

    def recompute(self, i: int) -> None:
        self.um.checkpoint(self.model, True)
        try:
            self.both(i)
        finally:
            self.um.checkpoint(self.model, False)

    def step(self, i: int) -> None:
        self.opt.step()

    def user_step(self, i: int) -> None:
        """The step as users run it: from no gradients, ``STEP_MICRO_BATCHES`` forward and backward passes
        accumulated, then the optimizer's step (the gradients left for the optimizer's own arm)."""
        for p in self.model.parameters():
            p.grad = None
        with self.loss_context():
            for j in range(STEP_MICRO_BATCHES):
                self.forward(i + j).backward()
        self.opt.step()

    def forward_bytes(self) -> tuple[int, int] | None:
        """One forward (the loss made) from no gradients: (the bytes it leaves allocated for the backward: what
        autograd keeps and autocast's bf16 weight copies; the bytes at its peak, the model's output alive until
        then), each above what was held before it; None off CUDA."""
        return self._bytes(lambda: self.forward(0))

    def step_peak(self) -> int | None:
        """Bytes allocated at the peak of a user step (``user_step``, from no gradients) above what was held
        before it: the gradients, what each micro-batch keeps and the transients beside them."""
        got = self._bytes(lambda: self.user_step(0))
        return got[1] if got is not None else None

    def _bytes(self, fn) -> tuple[int, int] | None:
        """(bytes allocated after ``fn``, at its peak) from no gradients, above what was held before it; None off
        CUDA."""
        if not self.cuda:
            return None
        cuda = self.torch.cuda
        for p in self.model.parameters():
            p.grad = None
        cuda.synchronize(self.device)
        base = cuda.memory_allocated(self.device)
        cuda.reset_peak_memory_stats(self.device)
        out = fn()
        cuda.synchronize(self.device)
        got = cuda.memory_allocated(self.device) - base, cuda.max_memory_allocated(self.device) - base
        del out
        return got


def _arm(torch, device, fn):
    return lambda: TorchArm(torch, device, fn)


def time_point(torch, um: UserModule, models: dict, t: int, micro_batch: int, sequence: int, iters: int,
               warmup: int) -> ModulePoint:
    """One local shape: both models' arms interleaved in one comparison (a slow spell falls on all alike)."""
    one, two = models[1], models[1 + MORE]
    vocab = um.model["vocabulary"] // t
    for m in (one, two):
        m.inputs(micro_batch, sequence, vocab)
        m.both(0)  # gradients present for the optimizer's arm; the lazily made state made
        m.opt.step()
    can_recompute = um.checkpoint(one.model, False)
    arms = []
    for n, m in ((1, one), (2, two)):
        arms += [(f"f{n}", _arm(torch, m.device, m.forward)), (f"fb{n}", _arm(torch, m.device, m.both)),
                 (f"o{n}", _arm(torch, m.device, m.step))]
        arms.append((f"s{n}", _arm(torch, m.device, m.user_step)))
        if can_recompute:
            arms.append((f"rc{n}", _arm(torch, m.device, m.recompute)))
    med = medians(torch, arms, timing(iters, warmup, back_to_back=True))
    f = {n: med[f"f{n}"] for n in (1, 2)}
    b = {n: max(med[f"fb{n}"] - med[f"f{n}"], 0.0) for n in (1, 2)}
    o = {n: med[f"o{n}"] for n in (1, 2)}
    fwd = {n: m.forward_bytes() or (None, None) for n, m in ((1, one), (2, two))}  # (kept, peak) each
    kept = {n: k for n, (k, _) in fwd.items()}
    act = max(kept[2] - kept[1], 0) / MORE if kept[1] is not None else None
    block = {"forward_s": max(f[2] - f[1], 0.0) / MORE, "backward_s": max(b[2] - b[1], 0.0) / MORE,
             "optimizer_s": max(o[2] - o[1], 0.0) / MORE,
             "recompute_s": max((med["rc2"] - med["fb2"]) - (med["rc1"] - med["fb1"]), 0.0) / MORE
             if can_recompute else None,
             "activation_bytes": act, "step_s": max(med["s2"] - med["s1"], 0.0) / MORE,
             "forward_transient_bytes": max((fwd[2][1] - fwd[1][1]) / MORE - act, 0.0) if act is not None else None}
    outside = {"forward_s": max(f[1] - block["forward_s"], 0.0), "backward_s": max(b[1] - block["backward_s"], 0.0),
               "optimizer_s": max(o[1] - block["optimizer_s"], 0.0),
               "activation_bytes": max(kept[1] - act, 0) if act is not None else None,
               "step_s": max(med["s1"] - block["step_s"], 0.0), "peak_bytes": one.step_peak()}
    return ModulePoint(t, micro_batch, sequence, block, outside)


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


def _wrap(torch, m: _Timed, path: str) -> None:
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
        for block in _blocks(torch, m.model):
            fully_shard(block)
        fully_shard(m.model)
    m.opt = torch.optim.AdamW(param_groups(m.model), lr=1e-5, fused=m.cuda)


def _blocks(torch, model) -> list:
    """The model's blocks: its first non-empty ``nn.ModuleList``'s modules."""
    lists = [mod for mod in model.modules() if isinstance(mod, torch.nn.ModuleList) and len(mod)]
    return list(lists[0]) if lists else []


# the block's modules by name, as apply's tensor path places them (the reference block's and transformers' Llama,
# Qwen2 and Mistral names): column-wise, row-wise, and the norms whose output the column-wise layers read
COLWISE = ("q", "k", "v", "gate", "up", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o", "down", "o_proj", "down_proj")
NORMS = ("ln1", "ln2", "input_layernorm", "post_attention_layernorm")


def _tensor_parallel(torch, m: _Timed, sequence: bool = False) -> None:
    """The model's blocks placed as apply's tensor path places a Llama (``autotune.apply.tensor``) over every rank
    of the group: each norm's output a replicated DTensor once, the projections that read it column-wise, the
    two that write the stream row-wise; the embedding and the head split by vocabulary where the model names them
    (``_vocabulary_layers``), the loss then under ``loss_parallel`` (``_Timed.loss_context``), else as they are.
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
    blocks = _blocks(torch, m.model)
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
            models = None
            try:
                models = {n: _Timed(torch, um, n, 1, device) for n in (1, 1 + MORE)}
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
            finally:
                models = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if memory is not None and "none" in peaks:
        base_alloc, base_reserved, params = peaks["none"]
        memory["fragmentation"] = min(max(base_reserved / base_alloc - 1.0, 0.0), 1.0)
        memory["allocator"] = allocator_of(os.environ)
        memory["path_bytes_per_param"] = {p: (a - base_alloc) / params for p, (a, _, _) in peaks.items() if p != "none"}
    return out


def _step_peak(torch, m: _Timed, device) -> tuple[int, int]:
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


def time_widths(torch, um: UserModule, widths, micro_batches, sequence: int, device, iters: int, warmup: int,
                progress) -> list[ModulePoint]:
    """The points of ``widths`` x ``micro_batches`` at ``sequence`` on ``device``, one width's models at a time; a
    shape that runs out of memory is skipped, said."""
    points = []
    oom = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    for t in widths:
        models = {n: _Timed(torch, um, n, t, device) for n in (1, 1 + MORE)}
        for mb in micro_batches:
            try:
                p = time_point(torch, um, models, t, mb, sequence, iters, warmup)
            except oom:
                progress(f"tensor {t}, micro-batch {mb}, sequence {sequence}: out of memory, skipped")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            except UserError:
                raise
            except Exception as e:
                fix = ("its model is built from the fields (heads, kv_heads, ffn, vocabulary divided by the width) "
                       "and called as forward(ids, targets), returning the loss (or nanoGPT's (logits, loss)): make "
                       "it so, or " if um.recipe[:1] == ("factory",) else "")
                raise UserError(f"{um.name} could not be timed at tensor width {t}, micro-batch {mb}, sequence "
                                f"{sequence}: {type(e).__name__}: {str(e)[:200]}: {fix}give --tensor, "
                                f"--micro-batches or --sequence it takes") from None
            points.append(p)
            bl = p.block
            progress(f"tensor {t}, micro-batch {mb}, sequence {sequence}: block {bl['forward_s'] * 1e3:.3f} ms forward, "
                     f"{bl['backward_s'] * 1e3:.3f} ms backward, optimizer {bl['optimizer_s'] * 1e3:.3f} ms; "
                     f"outside {p.outside['forward_s'] * 1e3:.3f} / {p.outside['backward_s'] * 1e3:.3f} ms"
                     + (f"; kept for the backward: block {bl['activation_bytes'] / 2**20:.1f} MiB, outside "
                        f"{p.outside['activation_bytes'] / 2**20:.1f} MiB" if bl["activation_bytes"] is not None
                        else ""))
        models = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return points


def lane_shares(widths, lanes: int) -> list[tuple[int, ...]]:
    """``widths`` shared out to ``lanes``: a width's shapes cost about 1 / width (its local shapes' size), each width,
    the costliest first, to the lane with the least so far (2 x H200, an 8 B Llama: width 1 took 37 s of the 77)."""
    shares: list[list[int]] = [[] for _ in range(lanes)]
    for t in sorted(widths):
        min(shares, key=lambda share: sum(1 / w for w in share)).append(t)
    return [tuple(share) for share in shares]


def _widths_job(torch, device, recipe: tuple, widths, micro_batches, sequence: int, iters: int, warmup: int,
                prefix: str) -> dict:
    """``time_widths`` in a process of ``measure``'s lanes, its progress lines on stderr under ``prefix``."""
    points = time_widths(torch, rebuild(recipe), widths, micro_batches, sequence, device, iters, warmup,
                         lambda msg: print(f"{prefix}{msg}", file=sys.stderr, flush=True))
    return {"points": [p.to_dict() for p in points]}


def measure(torch, um: UserModule, widths, micro_batches, sequence: int, device, iters: int, warmup: int,
            progress, source: str, host: bool = True, save=None, lanes: int = 1) -> ModuleSection:
    """The module section of ``um`` at every (tensor width, micro-batch) of ``widths`` x ``micro_batches``
    and ``sequence`` (module docstring; ``time_widths``). With ``lanes`` above 1 the widths are shared out
    (``lane_shares``) to that many processes (``calibrate.device.peers.run_each``: one GPU each, GPUs 0 to lanes - 1, each
    width on one GPU as alone; on the CPU, processes: tests), else timed one after the other on ``device``.
    ``save`` (given) is called with the section of the timed shapes before the host's cost is measured: an
    interrupted run keeps them."""
    bad = [t for t in widths if t not in um.widths]
    if bad:
        raise UserError(f"{um.name}: tensor width {bad[0]} does not divide its heads, K/V heads, MLP and vocabulary "
                        f"(widths it can take: {', '.join(map(str, um.widths))})")
    lanes = min(lanes, len(widths)) if um.recipe else 1
    if lanes > 1:
        progress(f"tensor widths {', '.join(map(str, widths))} shared out to {lanes} "
                 f"{'GPUs' if device.type == 'cuda' else 'processes'}, each timing its widths alone")
        got = run_each(_widths_job, [(um.recipe, share, micro_batches, sequence, iters, warmup, f"[module] lane {i}: ")
                                     for i, share in enumerate(lane_shares(widths, lanes))],
                       "timing the tensor widths", device.type)
        points = sorted((ModulePoint(**p) for g in got for p in g["points"]), key=lambda p: p.key)
        progress(f"{len(points)} shapes timed on {lanes} lanes")
    else:
        points = time_widths(torch, um, widths, micro_batches, sequence, device, iters, warmup, progress)
    if not points:
        raise UserError(f"{um.name}: no shape could be timed (each ran out of memory): give smaller --micro-batches "
                        f"or --sequence")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    section = ModuleSection(source, um.name, um.model, tuple(points),
                            "fp32 weights, bf16 autocast, fused AdamW" if device.type == "cuda"
                            else "fp32 weights, fp32 (no autocast on the CPU), AdamW", name)
    if not host:
        return section
    if save is not None:
        save(section)
    memory: dict = {}
    hosts = host_seconds(torch, um, min(micro_batches), sequence, device, iters, warmup, progress, memory=memory)
    outside: dict = {}
    if device.type == "cuda":
        peers, outside, _ = peer_host(torch, um.recipe, min(micro_batches), sequence, device, iters, warmup,
                                      progress)
        hosts.update(peers)
    return replace(section, host_s=hosts, host_outside_s=outside, memory=memory)
