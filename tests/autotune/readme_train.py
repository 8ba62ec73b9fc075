import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import autotune
from autotune.plan import load_plan

dist.init_process_group()  # one process per device, e.g. torchrun --nproc-per-node 4
plan = load_plan(sys.argv[1])  # plan.json of python -m autotune --model llama ...
m = plan.model.config
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=m["vocabulary"], hidden_size=m["hidden"], intermediate_size=m["ffn"], num_hidden_layers=m["layers"],
    num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], head_dim=m["head_dim"]))
model = autotune.apply(plan, model)  # parameters placed as DTensors, activations redistributed by hooks
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(int(sys.argv[2])):
    batch = torch.randint(m["vocabulary"], (m["batch"], m["sequence"]), generator=torch.Generator().manual_seed(step))
    loss = 0.0
    for ids in autotune.micro_batches(plan, batch):  # the plan's micro-batches, gradients accumulated
        mb_loss = model(input_ids=ids, labels=ids).loss / plan.micro_batches
        mb_loss.backward()
        loss += mb_loss.item()
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss:.6f}")
dist.destroy_process_group()
