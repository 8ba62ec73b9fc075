"""The README's training script (section "Apply a plan to your model") is tests/autotune/readme_train.py,
word for word, and it trains a Hugging Face Llama on 4 gloo processes under torchrun with a plan (data x
tensor parallelism), giving the losses of the same model trained in one process without a plan."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402

from hand_plans import megatron, typed_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("readme_train.py")
LLAMA = dict(kind="llama", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, sequence=8, vocabulary=64,
             batch=8, micro_batch=4)
STEPS = 3


def test_readme_holds_the_script():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Apply a plan to your model", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block == SCRIPT.read_text()


def reference_losses() -> list[float]:
    from transformers import LlamaConfig, LlamaForCausalLM
    m = LLAMA
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=m["vocabulary"], hidden_size=m["hidden"], intermediate_size=m["ffn"], num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], head_dim=m["head_dim"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = m["batch"] // m["micro_batch"]
    out = []
    for step in range(STEPS):
        batch = torch.randint(m["vocabulary"], (m["batch"], m["sequence"]), generator=torch.Generator().manual_seed(step))
        loss = 0.0
        for ids in batch.chunk(n):
            mb = model(input_ids=ids, labels=ids).loss / n
            mb.backward()
            loss += mb.item()
        opt.step()
        opt.zero_grad()
        out.append(loss)
    return out


def test_script_trains_with_a_plan(tmp_path):
    plan = tmp_path / "plan.json"
    typed_plan(LLAMA, 2, 2, megatron, "llama megatron (2, 2)").save(plan)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        str(SCRIPT), str(plan), str(STEPS)], capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", r.stdout, re.M)]
    want = reference_losses()
    assert len(losses) == STEPS and losses == pytest.approx(want, rel=1e-5), (losses, want)
