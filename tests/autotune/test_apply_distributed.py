"""autotune.apply on 4 processes (gloo, float64) against the same model in one process: the loss of every
step and every parameter after two Adam steps (two micro-batches each) agree to 1e-9 (relative), for a tiny
Hugging Face LlamaForCausalLM and a nanoGPT-style module, with the SBP search's plan (models' llama/gpt
graph, converted through the typed plan; for the Llama also the search's plan in FSDP mode, whose qkv
weight is split over more devices than KV heads), FSDP, HSDP (full recomputation) and tensor parallelism + FSDP
(full recomputation) through fully_shard (+ parallelize_module), a plan splitting the embedding and the logits
by vocabulary over all four devices (on both clusters), and random plans that use partial sums (one with selective
recomputation), on a 2 x 2 cluster (on a 1 x 4 cluster, whose fine axes are the same, the searched and the
vocabulary-parallel plans); the vocabulary-parallel plan with one wrong placement (the residual stream declared
partial after the add) disagrees. One launch per cluster runs every plan. All but the searched
plans are written by hand through the typed plan (tests/autotune/apply_plans.py)."""
import os

import numpy as np
import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)
from torch import nn  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

from autotune.plan.layouts import fully_shard_plan  # noqa: E402
from autotune.apply.place import placement_path  # noqa: E402
from gloo_runner import run_on_gloo  # noqa: E402
from tiny_models import hf_llama  # noqa: E402
from apply_plans import (GPT, LLAMA, data_parallel, megatron_baseline, random_partial, searched, tp_data,  # noqa: E402
                         typed_plan, vocab_parallel)

STEPS, LR, SEED = 2, 1e-2, 0
RTOL = 1e-9


class Block(nn.Module):
    """nanoGPT's block, its fused qkv laid out head by head ([q k v] of head 0, then head 1, ...)."""

    def __init__(self, c):
        super().__init__()
        h, self.hd = c["hidden"], c["head_dim"]
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = nn.Module()
        self.attn.c_attn, self.attn.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = nn.Linear(h, c["ffn"]), nn.Linear(c["ffn"], h)

    def forward(self, x):
        qkv = self.attn.c_attn(self.ln_1(x))
        b, t, _ = qkv.shape  # the attention's local batch, which may differ from the residual stream's
        q, k, v = qkv.view(b, t, -1, 3, self.hd).transpose(1, 2).unbind(3)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp.c_proj(nn.functional.gelu(self.mlp.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        h = c["hidden"]
        self.transformer = nn.Module()
        self.transformer.wte, self.transformer.wpe = nn.Embedding(c["vocabulary"], h), nn.Embedding(c["sequence"], h)
        self.transformer.h = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.transformer.ln_f = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, c["vocabulary"], bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def make_model(kind: str):
    torch.manual_seed(SEED)
    if kind == "gpt":
        return NanoGPT(GPT).double()
    return hf_llama(LLAMA, SEED)


def logits_of(model, ids):
    nano = isinstance(getattr(model, "module", model), NanoGPT)  # DDP wraps the model in .module
    out = model(ids) if nano else model(input_ids=ids, use_cache=False).logits
    return out


def next_token_loss(model, ids):
    """The cross entropy of the model's logits of ``ids[:, :-1]`` against ``ids[:, 1:]``."""
    logits = logits_of(model, ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train(model, plan, cfg, loss_of=next_token_loss):
    """STEPS Adam steps on fixed random tokens, each over the plan's micro-batches, as users step a placed model:
    each rank its piece of the batch (``data_piece``), the loss (``loss_of(model, ids)``, ids of a token more than
    the sequence) under ``loss_parallel`` (logits split by vocabulary stay split), the step's loss the mean over
    the ranks: (losses, parameters)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    import autotune
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, cfg["vocabulary"], (cfg["batch"], cfg["sequence"] + 1), generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    world = dist.get_world_size() if dist.is_initialized() else 1
    losses = []
    for _ in range(STEPS):
        total = torch.zeros((), dtype=torch.float64)
        piece = autotune.data_piece(model, ids)
        mbs = autotune.micro_batches(plan, piece)
        for mb in autotune.accumulate(model, mbs):
            with loss_parallel():
                loss = loss_of(model, mb)
                (loss / len(mbs)).backward()
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            total += loss.detach() / len(mbs)
        if world > 1:
            dist.all_reduce(total)
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / world)
    return losses, parameters(getattr(model, "module", model))  # DDP's wrapped module


def parameters(model) -> dict:
    from torch.distributed.tensor import DTensor
    out = {}
    for name, p in model.named_parameters():
        name = name.replace("parametrizations.", "").replace(".original", "")
        out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return out


def _applied(kind, plan):
    """``apply`` on the path ``placement_path`` names, then ``train``."""
    import autotune
    model = make_model(kind)
    path = placement_path(plan, model)
    model = autotune.apply(plan, model)
    if isinstance(model, FSDPModule) != _fully_sharded(plan, path) or model._autotune_path != path:
        raise RuntimeError(f"placement_path says {path} but {type(model).__name__} ran")
    return train(model, plan, GPT if kind == "gpt" else LLAMA)


def _fully_sharded(plan, path: str) -> bool:
    """Whether ``path`` wraps the model in fully_shard: the fully_shard path, and the tensor path where the plan
    has data ranks (at data degree 1 parallelize_module alone, as torchtitan)."""
    from autotune.plan.hostpace import data_ranks
    return path == "fully_shard" or (path == "tensor" and data_ranks(plan) > 1)


def plans(nodes, gpus) -> list:
    """Every plan on 2 x 2; on 1 x 4, whose fine axes are the same two of size 2 (only the search's costs
    differ), the searched and vocabulary-parallel plans and the wrong one."""
    mesh = (2, 2)
    out = []
    for kind, cfg in (("llama", LLAMA), ("gpt", GPT)):
        dp = data_parallel(cfg)
        out.append((kind, searched(cfg, nodes, gpus)))
        out.append((kind, typed_plan(cfg, nodes, gpus, vocab_parallel(cfg), "vocabulary parallel")))
        if kind == "llama":  # its qkv weight split over 4 devices, more than the 2 KV heads (the attention's over 2)
            plan = searched(cfg, nodes, gpus, fsdp_axes=(0, 1))
            assert plan.layer("qkv").weight("weight").placements == ("S1", "S1") != plan.layer("attention").input
            out.append((kind, plan))
        if nodes == 1:
            continue
        out += [(kind, typed_plan(cfg, nodes, gpus, dp, "FSDP", fsdp_axes=(0, 1))),
                (kind, typed_plan(cfg, nodes, gpus, dp, "HSDP", recompute="full", fsdp_axes=(1,))),
                (kind, typed_plan(cfg, nodes, gpus, tp_data(cfg), "TP + FSDP", recompute="full", fsdp_axes=(0,))),
                (kind, typed_plan(cfg, nodes, gpus, random_partial(cfg, mesh, 1), "random 1")),
                (kind, typed_plan(cfg, nodes, gpus, random_partial(cfg, mesh, 2), "random 2",
                                  recompute="selective"))]
    broken = vocab_parallel(LLAMA)
    i, _, w = broken["residual"]
    broken["residual"] = (i, ("S0", "P"), w)
    out.append(("llama", typed_plan(LLAMA, nodes, gpus, broken, "broken (residual output P)")))
    return out


def mismatch(ref, got) -> str | None:
    if isinstance(got, str):
        return got
    (ref_losses, ref_params), (losses, params) = ref, got
    if not np.allclose(losses, ref_losses, rtol=RTOL, atol=0):
        return f"losses {losses} != {ref_losses}"
    for name, want in ref_params.items():
        if name not in params:
            return f"parameter {name} missing"
        if not torch.allclose(params[name], want, rtol=RTOL, atol=RTOL):
            return f"parameter {name} differs by {(params[name] - want).abs().max():.3g}"
    return None


@pytest.mark.parametrize("nodes,gpus", [(2, 2), (1, 4)])
def test_apply_matches_one_process(nodes, gpus):
    jobs = plans(nodes, gpus)
    # the FSDP, HSDP and TP + FSDP baselines take fully_shard (+ parallelize_module), every other plan the DTensor
    # placement path
    assert [p.strategy for _, p in jobs if fully_shard_plan(p)] == ["FSDP", "HSDP", "TP + FSDP"] * 2 * (nodes > 1)
    # forked before this process computes anything (its imports shared: spawning re-imports transformers 4 times)
    results = run_on_gloo(_applied, jobs)[0]
    refs = {kind: train(make_model(kind), jobs[0][1], GPT if kind == "gpt" else LLAMA) for kind in ("llama", "gpt")}
    assert len(results) == len(jobs)
    for (kind, plan), got in zip(jobs[:-1], results):
        assert mismatch(refs[kind], got) is None, f"{kind} {plan.strategy} on {nodes}x{gpus}: {mismatch(refs[kind], got)}"
    assert mismatch(refs["llama"], results[-1]) is not None, "a wrong placement went unnoticed"
    assert refs["llama"][0][1] != pytest.approx(refs["llama"][0][0])  # the loss moved between the steps


def _float32(kind, plan):
    import autotune
    return train(autotune.apply(plan, make_model(kind).float()), plan, GPT)


def test_fsdp_float32_on_gloo():
    """fully_shard reduces 16- and 32-bit gradients by a pre-multiplied sum, which gloo lacks (a RuntimeError
    at the first backward, as `autotune execute --device cpu` met it): on gloo the FSDP baseline sums instead,
    and matches one process in float32."""
    plan = typed_plan(GPT, 2, 2, data_parallel(GPT), "FSDP", fsdp_axes=(0, 1))
    got = run_on_gloo(_float32, [("gpt", plan)])[0][0]
    assert not isinstance(got, str), got
    (ref_losses, ref_params), (losses, params) = train(make_model("gpt").float(), plan, GPT), got
    assert np.allclose(losses, ref_losses, rtol=1e-5, atol=0), (losses, ref_losses)
    for name, want in ref_params.items():
        # 1e-3: Adam divides float32 rounding of near-zero gradients (the key bias) by their own size
        assert torch.allclose(params[name], want, rtol=0, atol=1e-3), (name, (params[name] - want).abs().max())


def _local(kind, plan):
    """``apply``, then ``train``: (the path, the placed module's type, the result)."""
    import autotune
    model = autotune.apply(plan, make_model(kind))
    return model._autotune_path, type(model).__name__, train(model, plan, GPT if kind == "gpt" else LLAMA)


def test_ddp_and_tensor_parallel_match_one_process():
    """The data-parallel plan (DDP) and a tensor-parallel plan without FSDP (Megatron's d x t: parallelize_module
    and fully_shard on a replicate mesh, torchtitan's DDP + TP, parallelize_module alone at d = 1; the logits a
    DTensor of vocabulary columns, the
    loss under loss_parallel) of both models, and t = 4 over both fine axes (one flattened "tp" dimension): the
    losses and parameters of one process."""
    jobs = [(kind, typed_plan(cfg, 2, 2, fn(cfg), name)) for kind, cfg in (("llama", LLAMA), ("gpt", GPT))
            for fn, name in ((data_parallel, "data parallel"), (tp_data, "tensor parallel"))]
    jobs.append(("gpt", typed_plan(GPT, 2, 2, tp_data(GPT, tp=2), "tensor parallel over both axes (t = 4)")))
    # the search's Megatron baselines: the residual stream split by features (reduce-scattered, norms gathered)
    jobs += [("llama", megatron_baseline(LLAMA, (1, 2), (1, 2))), ("gpt", megatron_baseline(GPT, (1, 1), (1, 4)))]
    results = run_on_gloo(_local, jobs)[0]
    refs = {kind: train(make_model(kind), jobs[0][1], GPT if kind == "gpt" else LLAMA) for kind in ("llama", "gpt")}
    for (kind, plan), got in zip(jobs, results):
        assert not isinstance(got, str), got
        path, placed, got = got
        assert mismatch(refs[kind], got) is None, f"{kind} {plan.strategy}: {mismatch(refs[kind], got)}"
        cls = type(make_model(kind)).__name__
        assert (path, placed) == (("ddp", "DistributedDataParallel") if plan.strategy == "data parallel" else
                                  ("tensor", "FSDP" * _fully_sharded(plan, "tensor") + cls)), \
            (plan.strategy, path, placed)
