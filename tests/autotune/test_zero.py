"""ZeRO-1/2 (issue 43): optimizer states (and gradients) sharded over each weight's data-parallel axes, the
optimizer stepping the shard; against the closed form on the data-parallel plan."""
import math

import pytest

from calibrate.errors import UserError
from calibrate.profile import Profile
from models import load_model
from tiny_models import PIPELINE_GPT
from autotune.sbp.baselines import data_parallel
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.memory import Mode, grad_sync_axes, strategy_memory
from autotune.sbp.mesh import Cluster
from autotune.sbp.steptime import optimizer_seconds


def test_zero_shards_states_then_gradients_over_the_data_parallel_group():
    g = load_model("gpt", "gpt3-1.3b", PIPELINE_GPT)
    cl = Cluster(2, 2)
    prof = Profile.load("h200-nvlink+ib400")
    pr = Problem(g, Coster(prof, cl), None)
    a = data_parallel(pr)
    checked = 0
    for v, i in enumerate(a):
        s = pr.choices[v][i]
        if not s.weights:
            continue
        dp = {w.name: math.prod(cl.axis_sizes[x] for x in grad_sync_axes(s, w, cl)) for w in s.weights}
        assert set(dp.values()) == {4}  # data parallel: every weight's gradient summed over all 4 devices
        plain, z1, z2 = (strategy_memory(s, cl, 2, Mode(zero=z)) for z in (0, 1, 2))
        assert z1.optimizer == pytest.approx(plain.optimizer / 4) and z1.gradients == plain.gradients
        assert z2.optimizer == z1.optimizer and z2.gradients == pytest.approx(plain.gradients / 4)
        assert z2.parameters == plain.parameters > 0  # the weights themselves stay whole (ZeRO-3 is FSDP)
        t0, t1 = (optimizer_seconds(s, cl, prof.compute, 2, Mode(zero=z)) for z in (0, 1))
        assert t1 < t0
        checked += 1
    assert checked >= 3
    with pytest.raises(UserError, match="ZeRO"):
        Mode(zero=1, fsdp_axes=(0,))
