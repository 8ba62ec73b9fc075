"""What the multi-process tests of apply, execute and pipelining share (beside ``gloo_runner``, which launches
them): a tiny Hugging Face Llama in float64 whose norms stay in float64, and the execute module path's training in
one process (the reference those tests compare with)."""
from __future__ import annotations

import types


# the small GPT (gpt3-1.3b's shape, shrunk) the pipeline tests plan (conftest.py's ``graph``)
PIPELINE_GPT = {"layers": 4, "hidden": 256, "heads": 4, "sequence": 128, "vocabulary": 1024, "batch": 16,
                "micro_batch": 4}


def _rms_norm(self, x):
    """Llama's RMSNorm in the model's dtype (Hugging Face's computes in float32 whatever the model's dtype, and
    float32 sums in another order than one process's would hide a wrong gradient under 1e-9)."""
    import torch
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def hf_llama(cfg: dict, seed: int):
    """transformers' LlamaForCausalLM of a model config (random weights from ``seed``, nothing downloaded), in
    float64 with its RMSNorms in float64."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    torch.manual_seed(seed)
    hf = LlamaConfig(vocab_size=cfg["vocabulary"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                     num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                     num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["sequence"],
                     attn_implementation="sdpa")
    model = LlamaForCausalLM(hf).double()
    for m in model.modules():
        if isinstance(m, LlamaRMSNorm):
            m.forward = types.MethodType(_rms_norm, m)
    return model


def module_path_one_process(config: dict, micro_batches: int, steps: int, lr: float, seed: int):
    """(losses, weights, last gradients): the execute module path's steps in one process, whole tensors, float64:
    the reference module built as ``python -m autotune execute`` builds it, AdamW, the same micro-batches."""
    import torch

    from autotune.execute.moduletrain import build_module, token_batch
    cpu = torch.device("cpu")
    model = build_module("models.modules:build", config, seed, torch.float64, cpu)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(micro_batches):
            ids, targets = token_batch(config, seed, s, j, cpu)
            loss = model(ids, targets) / micro_batches
            loss.backward()
            total += float(loss)
        opt.step()
        losses.append(total)
    return (losses, {k: p.detach() for k, p in model.named_parameters()},
            {k: p.grad for k, p in model.named_parameters()})
