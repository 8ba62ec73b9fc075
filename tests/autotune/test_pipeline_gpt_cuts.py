"""``autotune.apply_pipeline`` cuts transformers' GPT2LMHeadModel and nanoGPT-style modules (the pipelined plans
the search returns for a GPT-2 config.json or a gpt model JSON by default were refused before): the search's
plans of 2 stages x 2 devices (tensor parallel: GPT-2's on the DTensor path, its fused c_attn split in its
thirds there too, which crashed; nanoGPT's second stage on the tensor path, torch's ParallelStyles, its first,
whose embedding is split by features, on the DTensor path) and (GPT-2) of 4 stages of one device, 1F1B and
GPipe, on 4 gloo processes in float64 give the losses of one process over three SGD steps (so a gradient of the
wrong scale shows), GPT-2's head tied to
its embedding (their gradients summed between the first and the last stage), the nanoGPT module's tied as
nanoGPT ties them. Planted bug: a later stage adding to the stream where GPT-2 adds positions (the cut's
no-position table returning ones) fails. One launch."""
import json
import os
from unittest import mock

import numpy as np
import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401

from gloo_runner import run_on_gloo  # noqa: E402
from test_apply_distributed import NanoGPT  # noqa: E402

from autotune.apply import cuts  # noqa: E402

SHAPE = dict(sequence=8, batch=8, micro_batch=2)
NANO = dict(kind="gpt", layers=4, hidden=32, heads=4, ffn=128, vocabulary=48, bias=True, tied=True,
            positions="learned", **SHAPE)
STEPS, LR = 3, 0.5


def _gpt2_config(tmp_path):
    import transformers as tf
    tf.GPT2Config(vocab_size=48, n_embd=32, n_layer=4, n_head=4, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0).save_pretrained(tmp_path / "gpt2")
    return str(tmp_path / "gpt2" / "config.json")


def _model(kind: str, source):
    """The model in float64, the same weights in every process: GPT-2 from its config.json, or the nanoGPT-style
    module with its head tied to its embedding as nanoGPT ties them."""
    torch.manual_seed(0)
    if kind == "gpt2":
        import transformers as tf
        c = tf.AutoConfig.from_pretrained(os.path.dirname(source), attn_implementation="sdpa")
        return tf.AutoModelForCausalLM.from_config(c).double()
    model = NanoGPT(dict(NANO, head_dim=8)).double()
    model.transformer.wte.weight = model.lm_head.weight
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 48, (SHAPE["batch"], SHAPE["sequence"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _one_process(kind, source, micro_batches: int) -> list[float]:
    model = _model(kind, source)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ids, targets = _batch()
    out = []
    for _ in range(STEPS):
        total = 0.0
        for i, t in zip(ids.chunk(micro_batches), targets.chunk(micro_batches)):
            logits = model(i) if kind == "nanogpt" else model(input_ids=i, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten()) / micro_batches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        out.append(total)
    return out


def _pipelined(kind, source, plan):
    import autotune
    pipe = autotune.apply_pipeline(plan, _model(kind, source))
    opt = torch.optim.SGD(pipe.module.parameters(), lr=LR)
    ids, targets = _batch()
    out = []
    for _ in range(STEPS):
        out.append(float(pipe.step(ids, targets)))
        opt.step()
        opt.zero_grad()
    return out, pipe.paths


def _again(self, positions):
    """The planted bug: a later stage's stream shifted, as if positions were added again (not by a constant:
    the norms would take it out)."""
    return torch.linspace(0, 1, 32, dtype=torch.float64)

def _search(model_file, stages: int, schedule: str):
    """The pipeline search's plan (the one ``autotune.search`` returns where pipelining wins) of the model JSON
    a user writes for ``NANO`` (GPT-2's config.json reads as the same model) in ``stages`` stages on one node of
    4, at a small effort."""
    from autotune.pipeline.record import pipeline_plans
    from autotune.pipeline.search import PipelineConfig
    from autotune.sbp.mesh import Cluster
    from calibrate.profile import Profile
    from models import load_model
    graph = load_model(str(model_file), None, SHAPE)
    plan, _ = pipeline_plans(graph, Cluster(1, 4), Profile.load("h200-nvlink+ib400"), 80 * 2**30,
                             PipelineConfig(stages, schedule, search="cd", budget_scale=0.2, micro_batch_choices=1))
    assert len(plan.stages) == stages
    return plan


def replace_schedule(plan, schedule: str = "gpipe"):
    from dataclasses import replace
    return replace(plan, pipeline=replace(plan.pipeline, schedule=schedule))


def test_gpt2_and_nanogpt_pipelines_match_one_process(tmp_path):
    from autotune.apply.pipeplan import load_pipelined, stage_paths
    from models import load_model
    gpt2 = _gpt2_config(tmp_path)
    model_file = tmp_path / "nanogpt.json"
    model_file.write_text(json.dumps(NANO))
    assert load_model(gpt2, None, SHAPE).config["tied"]
    two, four = _search(model_file, 2, "1f1b"), _search(model_file, 4, "gpipe")
    # stages of 2 devices splitting GPT-2's fused c_attn by features (its q, k, v thirds each split: DTensor path)
    assert two.stages[0].plan.layer("qkv").output == ("S1",)
    jobs = [("gpt2", gpt2, two, None), ("gpt2", gpt2, four, None), ("nanogpt", None, replace_schedule(two), None)]
    jobs.append(("gpt2", gpt2, jobs[1][2], "again"))  # the bug last: a failing job may leave the groups unusable
    bugs = {"again": lambda: mock.patch.object(cuts._NoPositions, "forward", _again)}
    results = run_on_gloo(_pipelined, jobs, bugs=bugs, timeout=120)[0]
    for (kind, source, plan, bug), got in zip(jobs, results):
        want = _one_process(kind, source, plan.micro_batches)
        if bug:
            assert isinstance(got, str) or not np.allclose(got[0], want, rtol=1e-9, atol=0), "the bug went unnoticed"
            continue
        assert not isinstance(got, str), (kind, plan.strategy, got)
        assert np.allclose(got[0], want, rtol=1e-9, atol=0), (kind, plan.strategy, got, want)
        asks = stage_paths(load_pipelined(plan))  # GPT-2's Conv1D projections take no ParallelStyle: DTensor's
        assert got[1] == tuple("dtensor" if kind == "gpt2" and p == "tensor" else p for p in asks), (got[1], asks)
        if plan is four:  # stages of one device
            assert got[1] == ("none",) * 4, got[1]
        elif kind == "gpt2":  # the fused c_attn split by features
            assert got[1] == ("dtensor",) * 2, got[1]
    assert want[0] != pytest.approx(want[-1])  # the loss moved
