import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel
from transformers import LlamaConfig, LlamaForCausalLM

import autotune
from autotune.plan import load_plan

dist.init_process_group()  # one process per device, e.g. torchrun --nproc-per-node 4
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
plan = load_plan(sys.argv[1])  # plan.json of python -m autotune --model llama ...
m = plan.model.config
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(  # built on the CPU: apply moves this rank's part to its device
    vocab_size=m["vocabulary"], hidden_size=m["hidden"], intermediate_size=m["ffn"], num_hidden_layers=m["layers"],
    num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], head_dim=m["head_dim"]))
model = autotune.apply(plan, model)  # DDP, FSDP, tensor parallel or per-layer DTensor: the plan's path
opt = torch.optim.AdamW(autotune.param_groups(model), lr=1e-3)
for step in range(int(sys.argv[2])):
    batch = torch.randint(m["vocabulary"], (m["batch"], m["sequence"]), generator=torch.Generator().manual_seed(step))
    piece = autotune.data_piece(model, batch).to(device)  # this rank's piece of the batch (or a sampler's)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    # the plan's micro-batches, gradients accumulated and reduced once, with the last (as the plan prices them)
    for ids in autotune.accumulate(model, autotune.micro_batches(plan, piece)):
        with loss_parallel():  # logits split by vocabulary stay split: the loss is computed where they are
            mb_loss = model(input_ids=ids, labels=ids).loss / plan.micro_batches
            mb_loss.backward()
        loss += mb_loss.detach().full_tensor() if hasattr(mb_loss, "full_tensor") else mb_loss.detach()
    opt.step()
    opt.zero_grad()
    dist.all_reduce(loss)  # the mean of the ranks' pieces' losses
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item() / dist.get_world_size():.6f}")
dist.destroy_process_group()
