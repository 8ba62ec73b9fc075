"""execute's apply path on 4 processes (gloo, float64) against the same reference module trained in one process:
the loss of every step, every weight after two AdamW steps and its last gradient agree to 1e-9 (relative), for
a Llama-style plan (data x Megatron tensor parallelism, grouped-query attention, SwiGLU, RMSNorm, rotary
positions), the same plan with full recomputation, and a GPT plan (learned positions, tied logits, LayerNorm
with shift, GELU) in data parallelism over four devices (DDP) and in tensor parallelism with its embedding and tied
logits split by vocabulary over all four devices, a Llama FSDP plan (fully_shard) and a Llama plan whose last RMSNorm is split by features; a plan with one wrong
placement (the residual stream declared partial after the add) disagrees. The plans are written by hand (the
search's cost rules for these layers are another branch's)."""
import json
import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
import torch  # noqa: E402

from hand_plans import data_parallel, megatron, split_norm, typed_plan, vocab_parallel  # noqa: E402
from gloo_runner import run_on_gloo  # noqa: E402
from tiny_models import module_path_one_process  # noqa: E402

LLAMA = dict(kind="llama", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, sequence=8, vocabulary=64,
             batch=8, micro_batch=4)
GPT = dict(kind="gpt", layers=2, hidden=32, heads=4, ffn=64, sequence=8, vocabulary=48, batch=8, micro_batch=4)
STEPS, LR, SEED, RTOL = 2, 1e-2, 0, 1e-9
DEFAULT_MODULE = "models.modules:build"
# the reference module with torch's fused nn.RMSNorm (torchtitan's way): apply computes it out of place where the
# plan splits its input by features (its composite kernel adds eps in place to a partial sum, which DTensor refuses)
TORCH_RMSNORM, TORCH_RMSNORM_TAG = "hand_plans:build_with_torch_rmsnorm", ", nn.RMSNorm"
DTENSOR_TAG = ", placed by DTensor (--apply-path dtensor)"  # the same data-parallel plan on the other path


def plans() -> list[dict]:
    out = [typed_plan(LLAMA, 2, 2, megatron, "llama megatron (2, 2)"),
           typed_plan(LLAMA, 2, 2, megatron, "llama megatron (2, 2), full recomputation", "full"),
           typed_plan(GPT, 1, 4, data_parallel, "gpt data parallel (1, 4)"),
           typed_plan(GPT, 1, 4, data_parallel, "gpt data parallel (1, 4)" + DTENSOR_TAG),
           typed_plan(GPT, 2, 2, vocab_parallel, "gpt megatron, vocabulary over all four devices (2, 2), tied logits"),
           typed_plan(LLAMA, 1, 4, data_parallel, "llama FSDP (1, 4), fully_shard", fsdp_axes=(0, 1)),
           typed_plan(LLAMA, 2, 2, split_norm, "llama megatron (2, 2), the last RMSNorm split by features"),
           typed_plan(LLAMA, 2, 2, split_norm, "llama megatron (2, 2), the last RMSNorm split by features"
                      + TORCH_RMSNORM_TAG)]
    out = [p.to_dict() for p in out]
    broken = json.loads(json.dumps(out[0]))
    residual = next(lay for lay in broken["layers"] if lay["name"] == "residual")
    residual["output"] = ["S0", "P"]
    broken["strategy"] = "broken: the residual stream declared partial after the add"
    return out + [broken]



def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run_plans(plans_json):
    """execute's apply path on this rank, each plan of ``plans_json`` in turn (one group for them all)."""
    from autotune.execute.env import start, stop
    from autotune.execute.runner import run_module_plan
    d = start("cpu")
    results = []
    for plan in json.loads(plans_json):
        module = TORCH_RMSNORM if plan["strategy"].endswith(TORCH_RMSNORM_TAG) else DEFAULT_MODULE
        try:
            rec, model = run_module_plan(plan, d, module=module, steps=STEPS, warmup=0, profile_steps=0,
                                         dtype="float64", seed=SEED, lr=LR,
                                         apply_path="dtensor" if plan["strategy"].endswith(DTENSOR_TAG) else "auto")
        except Exception as e:  # the wrong plan may fail outright instead of giving other numbers
            results.append(f"{type(e).__name__}: {e}")
            continue
        results.append({"losses": rec["measured"]["losses"], "executor": rec["executor"], "path": rec["apply_path"],
                        "weights": {n: _whole(p.detach()) for n, p in model.named_parameters()},
                        "grads": {n: _whole(p.grad) for n, p in model.named_parameters()}})
    stop(d)
    return results


def reference(cfg: dict):
    """One process, whole tensors: the reference module, AdamW, the same batches."""
    return module_path_one_process(cfg, cfg["batch"] // cfg["micro_batch"], STEPS, LR, SEED)


def mismatch(ref, got) -> str | None:
    if isinstance(got, str):
        return got
    losses, ws, gs = ref
    if not all(abs(a - b) <= RTOL * abs(a) for a, b in zip(losses, got["losses"])) or len(losses) != len(got["losses"]):
        return f"losses {got['losses']} != {losses}"
    for what, want, have in (("weight", ws, got["weights"]), ("gradient", gs, got["grads"])):
        if want.keys() != have.keys():
            return f"{what} names {sorted(have)} != {sorted(want)}"
        for n in want:
            if not torch.allclose(have[n], want[n], rtol=RTOL, atol=RTOL):
                return f"{what} {n} differs by {(have[n] - want[n]).abs().max():.3g}"
    return None


def test_apply_path_matches_one_process():
    ps = plans()
    results = run_on_gloo(_run_plans, [(json.dumps(ps),)], init=False)[0][0]
    refs = {"llama": reference(LLAMA), "gpt": reference(GPT)}
    assert len(results) == len(ps)
    for plan, got in zip(ps[:-1], results):
        assert got["executor"] == "apply"
        name = plan["strategy"]
        want = "fully_shard" if "FSDP" in name else "dtensor" if name.endswith(DTENSOR_TAG) else "ddp" if \
            "data parallel" in name else "tensor" if name.startswith("llama megatron (2, 2)") and "split" not in name \
            else "dtensor"
        assert got["path"] == want, plan["strategy"]
        problem = mismatch(refs[plan["model"]["kind"]], got)
        assert problem is None, f"{plan['strategy']}: {problem}"
    assert mismatch(refs["llama"], results[-1]) is not None, "a wrong placement went unnoticed"
    assert refs["llama"][0][1] != pytest.approx(refs["llama"][0][0])  # the loss moved between the steps
