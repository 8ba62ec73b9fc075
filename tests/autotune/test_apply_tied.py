"""A tied embedding and head (GPT-2's, a small Qwen2's) under the plans the search returns for their config.json:
the search may place the two uses of the one weight differently (the embedding by columns, the head by
vocabulary rows), and ``autotune.apply`` now honours that on the DTensor path (the weight stored as the
embedding places it, redistributed to the head's placement at use, its gradient flowing back through that
redistribution) instead of refusing such a plan. Two Adam steps on 4 gloo processes match one process in float64
and the head computes in its own placement (planted bug, the head left in the embedding's: fails). One launch."""
import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401

from gloo_runner import run_on_gloo  # noqa: E402
from test_apply_distributed import mismatch, train  # noqa: E402
from test_apply_property import _float64_norms  # noqa: E402

SHAPE = dict(sequence=8, batch=8)


def _configs(tmp_path) -> dict:
    """config.json of each family as a user saves it (save_pretrained), tied."""
    import transformers as tf
    out = {"gpt2": tf.GPT2Config(vocab_size=48, n_embd=32, n_layer=2, n_head=4, n_positions=8, resid_pdrop=0.0,
                                 embd_pdrop=0.0, attn_pdrop=0.0),
           "qwen2": tf.Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
                                   tie_word_embeddings=True)}
    for name, c in out.items():
        c.save_pretrained(tmp_path / name)
    return {name: tmp_path / name / "config.json" for name in out}


def _build(path):
    import transformers as tf
    torch.manual_seed(0)
    c = tf.AutoConfig.from_pretrained(path.parent, attn_implementation="sdpa")
    return _float64_norms(tf.AutoModelForCausalLM.from_config(c).double())


def _tied_differs(plan) -> bool:
    emb = plan.layer("embedding").weight("weight").placements
    head = plan.layer("logits").weight("weight").placements
    return tuple({"S0": "S1", "S1": "S0"}.get(p, p) for p in head) != emb


def _run(path, plan):
    import autotune
    model = autotune.apply(plan, _build(path))
    uses = (model.get_input_embeddings().weight.placements, model.lm_head.weight.placements)  # as each computes
    return model._autotune_path, train(model, plan, dict(plan.model.config)), uses


def test_tied_weight_placed_twice_matches_one_process(tmp_path):
    import autotune
    from autotune.sbp.mesh import Cluster
    from models import load_model
    configs = _configs(tmp_path)
    jobs = []
    for name, path in configs.items():
        for mb, cluster in ((1, Cluster(2, 2)), (2, Cluster(1, 4))):
            graph = load_model(str(path), None, dict(SHAPE, micro_batch=mb))
            # the communication objective: the search's own per-layer plan (at the step objective the host's pace
            # of the DTensor path makes a baseline the cheaper on these tiny models)
            plan = autotune.search(graph, cluster, "h200-nvlink+ib400", memory_limit=None, pipeline="off",
                                   compare=(), objective="comm").best
            jobs.append((path, plan))
    assert sum(_tied_differs(p) for _, p in jobs) >= 3, [p.strategy for _, p in jobs]
    results = run_on_gloo(_run, jobs)[0]
    for (path, plan), got in zip(jobs, results):
        assert not isinstance(got, str), (path.parent.name, plan.cluster, got)
        path_name, got, (emb, head) = got
        want = train(_build(path), plan, dict(plan.model.config))
        assert path_name == "dtensor" and mismatch(want, got) is None, \
            (path.parent.name, plan.cluster, mismatch(want, got))
        # the head computes in its own placement (the weight redistributed at use) where the plan says so
        assert (emb != head) == _tied_differs(plan), (path.parent.name, plan.cluster, emb, head)
