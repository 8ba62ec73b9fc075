"""Megatron-LM's block recomputation (``Mode.blocks``: ``--recompute-method block --recompute-num-layers N``, the
first N of a stage's blocks re-run) against closed forms: each per-layer figure of a block's layer is the mix of
every block re-run and none by the share N / L of blocks re-run, and so is the plan's activation memory; the forward
boxing re-runs inside the re-run blocks only; the peak falls as N grows; the searches' refinement
(``autotune.sbp.fit.fewest_blocks``) takes the fewest blocks under which the plan fits, which a scan of every N
confirms; the typed plan keeps the count and refuses one that cannot run, in one line."""
import json
from dataclasses import replace

import numpy as np
import pytest

from autotune.pipeline.slicing import stage_graph, stage_spans, with_micro_batches
from autotune.pipeline.stage import StageProblem, figures
from autotune.plan.build import build
from autotune.plan.typed import Plan
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem, forward_factors
from autotune.sbp.fit import fewest_blocks, least_count
from autotune.sbp.memory import Mode
from autotune.sbp.mesh import Cluster
from calibrate.errors import UserError
from models import load_model

L = 4  # the model's blocks
GPT = {"layers": L, "hidden": 256, "heads": 4, "sequence": 128, "vocabulary": 1024, "batch": 16, "micro_batch": 4}


@pytest.fixture(scope="module")
def problem(profile):
    return Problem(load_model("gpt", "gpt3-1.3b", GPT), Coster(profile, Cluster(1, 2)), None, objective="step")


def _mode(problem, b):
    return problem.with_mode(Mode("full", blocks=b) if b < L else Mode("full")) if b else problem


@pytest.mark.parametrize("b", [1, 2, 3])
def test_each_layer_figure_is_the_mix_of_every_block_rerun_and_none(problem, b):
    a = problem.min_memory_assignment()
    none, full, part = problem, _mode(problem, L), _mode(problem, b)
    w = b / L
    for name in ("node_redist", "node_compute", "node_fwd", "node_bwd"):
        for x, y, z in zip(getattr(none, name), getattr(full, name), getattr(part, name)):
            np.testing.assert_allclose(z, w * y + (1 - w) * x, rtol=1e-12, err_msg=name)
    acts = [p.memory_breakdown(a).activations for p in (none, full, part)]
    assert acts[2] == pytest.approx(w * acts[1] + (1 - w) * acts[0], rel=1e-12)
    again, every = forward_factors(problem.graph, b), forward_factors(problem.graph)
    assert again.keys() == every.keys() and all(again[e] - 1 == pytest.approx(w * (every[e] - 1)) for e in every)


def test_the_peak_falls_as_more_blocks_rerun_and_the_fewest_that_fit_are_taken(problem):
    a = _mode(problem, L).min_memory_assignment()
    peaks = [_mode(problem, b).peak_memory(a) for b in range(L + 1)]
    steps = [_mode(problem, b).raw_cost(a) for b in range(L + 1)]
    assert all(x > y for x, y in zip(peaks, peaks[1:])) and all(x < y for x, y in zip(steps, steps[1:]))
    def under(limit):  # the problem under full recomputation with a memory limit (its mode copies share it)
        return Problem(problem.graph, problem.coster, limit, objective="step", require_fit=False,
                       mode=Mode("full"))
    for b in (1, 2, 3):
        full = under((peaks[b] + peaks[b - 1]) / 2)  # b blocks fit, b - 1 do not
        assert fewest_blocks(full, a) == b == min(k for k in range(1, L) if full.with_mode(
            Mode("full", blocks=k)).fits_plan(a))
    assert fewest_blocks(under(peaks[L] + 1.0), a) == 0  # only every block re-run fits: no fewer


def test_a_stage_prices_its_first_blocks_rerun(graph, profile):
    g = with_micro_batches(graph, 4)
    stage = StageProblem(stage_graph(g, *stage_spans(g, [3, 1])[0]), Coster(profile, Cluster(1, 2)), None, inflight=2)
    a = stage.min_memory_assignment()
    figs = [figures(stage.with_mode(m), a) for m in (Mode(), Mode("full", blocks=1), Mode("full"))]
    assert figs[1].backward == pytest.approx(figs[0].backward + (figs[2].backward - figs[0].backward) / 3, rel=1e-12)
    assert figs[0].memory > figs[1].memory > figs[2].memory
    p = stage.with_mode(Mode("full", blocks=1))
    assert p.mb * (figs[1].forward + figs[1].backward) + figs[1].optimizer + figs[1].exposed_sync == \
        pytest.approx(p.raw_cost(a))
    with pytest.raises(UserError, match="blocks 3: model .* has 3 blocks here"):
        stage.with_mode(Mode("full", blocks=3))


def test_the_plan_keeps_the_count_and_refuses_one_that_cannot_run(problem):
    part = _mode(problem, 1)
    plan = build(part, part.min_memory_assignment(), "searched (test)")
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["recompute_blocks"] == 1 and Plan.from_dict(d).recompute_blocks == 1
    for bad in ({"recompute": "none"}, {"recompute_blocks": -1}, {"recompute_blocks": True},
                {"sharding": {"mode": "fsdp", "axes": [0]}}):
        with pytest.raises(UserError, match="recompute_blocks"):
            Plan.from_dict(dict(d, **bad))
    for bad in (dict(recompute="none", blocks=1), dict(recompute="full", fsdp_axes=(0,), blocks=1),
                dict(recompute="full", blocks=-1)):
        with pytest.raises(UserError, match="recompute blocks"):
            Mode(**bad)
    assert replace(plan, recompute_blocks=0).to_dict().keys() == {k for k in d if k != "recompute_blocks"}


@pytest.mark.parametrize("most", [1, 2, 7, 8])
def test_the_least_count_is_the_first_that_fits(most):
    """``least_count``'s binary search against a scan, for every threshold (none fits, all fit, each between)."""
    for t in range(0, most + 3):
        asked = []
        got = least_count(most, lambda k: asked.append(k) or k >= t)
        assert got == next((k for k in range(1, most + 1) if k >= t), 0), (most, t)
        assert len(asked) <= 2 + most.bit_length()
