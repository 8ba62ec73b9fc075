"""Context parallelism applied on ONE GPU with the image's transformers and torch: the search's Megatron plan with
context parallelism over 2 (``autotune.apply``, the DDP path) on a bf16 LlamaForCausalLM, under torch's fake
process group of 2 whose all-gather is made to copy this rank's piece to every slot (the group writes nothing):
the hook, the attention interface and the cuDNN blocks run forward and backward, the README's step, each
micro-batch under DDP's ``no_sync`` (the fake group's all-reduce hands DDP's hook no tensor). Prints the loss
(about ln 512 for random weights) and whether every gradient is finite; exit 1 otherwise.

    PYTHONPATH=$PWD timeout 150 python3 tests/gpu/context_apply.py     # nvidia-h200, ~15 s
"""
from unittest import mock

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autotune
from autotune.plan import load_plan
from autotune.plan.build import build as build_plan
from autotune.sbp.baselines import megatron_cp
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.sbp.techniques import context_parallel
from calibrate.profile import Profile
from models import load_model

CFG = dict(layers=2, hidden=256, heads=8, kv_heads=2, head_dim=32, ffn=512, sequence=1024, vocabulary=512, batch=4,
           micro_batch=2)


def gather(out, x, group=None, async_op=False):
    """Every rank's piece this one's (the fake group writes nothing)."""
    out.copy_(torch.cat([x] * (out.shape[0] // x.shape[0])))


def main() -> int:
    print("transformers", transformers.__version__, "torch", torch.__version__)
    torch.cuda.set_device(0)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    graph = context_parallel(load_model("llama", None, dict(CFG, attention="flash")), 2)
    pr = Problem(graph, Coster(Profile.load("h200-nvlink+ib400"), Cluster(1, 2)), require_fit=False, runnable=False)
    plan = load_plan(build_plan(pr, megatron_cp(pr, (1, 2), (1, 1), 2), "Megatron, context parallel 2"))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=CFG["vocabulary"], hidden_size=CFG["hidden"], intermediate_size=CFG["ffn"],
        num_hidden_layers=CFG["layers"], num_attention_heads=CFG["heads"], num_key_value_heads=CFG["kv_heads"],
        head_dim=CFG["head_dim"], max_position_embeddings=CFG["sequence"])).to(torch.bfloat16)
    placed = autotune.apply(plan, model, mesh=init_device_mesh("cuda", plan.mesh.sizes))
    print("path", placed._autotune_path, "attention", model.config._attn_implementation)
    ids = torch.randint(0, CFG["vocabulary"], (CFG["batch"], CFG["sequence"]), device="cuda")
    ok = True
    with mock.patch.object(dist, "all_gather_into_tensor", gather):
        for mb in autotune.micro_batches(plan, autotune.data_piece(placed, ids)):
            with placed.no_sync():
                loss = placed(input_ids=mb, labels=mb).loss
                loss.backward()
            finite = all(p.grad is None or torch.isfinite(p.grad).all().item() for p in model.parameters())
            print("micro-batch", tuple(mb.shape), "loss", loss.item(), "finite gradients", finite)
            ok = ok and finite and bool(torch.isfinite(loss))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
