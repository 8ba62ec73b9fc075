"""The user's own transformer module, built and run as users run it: either a Hugging Face ``config.json``
(LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, GPT2LMHeadModel: transformers' own classes, built from
the config with random weights, SDPA attention) or a factory ``package.module:factory`` called with a dict of the
model's fields (kind, layers, hidden, heads, kv_heads, head_dim, ffn, vocabulary, sequence, micro_batch, batch)
that returns an ``nn.Module`` whose ``forward(ids, targets)`` returns the mean loss (what ``python -m autotune
execute --module`` trains), at any number of blocks and tensor width (``UserModule``), and one such model on a
device with its optimizer and what it runs (``Timed``): what ``calibrate.moduletime`` times at each local shape
and ``calibrate.modulehost`` times the host's cost of each apply path on. The recipe is the one users run: fp32
parameters, bf16 autocast on CUDA, AdamW (fused on CUDA). torch is imported by the caller and passed in.
"""
from __future__ import annotations

import contextlib
import importlib
import warnings
from dataclasses import dataclass
from typing import Callable

from calibrate.errors import UserError
from calibrate.module import STEP_MICRO_BATCHES

# transformers' classes and their model_type (a config saved by XConfig.save_pretrained has no architectures)
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                    "GPT2LMHeadModel": "gpt2"}
REFERENCE = {"hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 688, "vocabulary": 1024}  # host-bound on any GPU
MORE = 3  # the larger model of a measurement has 1 + MORE blocks (a block's figure: the difference over MORE)


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

    return UserModule("calibrate.usermodule:reference_module", dict(REFERENCE), build,
                      lambda model, ids: model(ids, ids), _divisors(*REFERENCE.values()), lambda model, on: False,
                      ("reference",))


class Timed:
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
