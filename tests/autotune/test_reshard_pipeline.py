import pytest

from autotune.reshard.pipeline import SCHEDULES, PipelineSpec, exposed_time, hidden_fraction, simulate
from autotune.reshard.stagecomm import pipeline_from_preset
from calibrate.errors import UserError
from calibrate.profile import Profile


def spec(S=4, M=8, F=1.0, B=2.0, c=0.0, cb=0.0):
    return PipelineSpec("t", M, (F,) * S, (B,) * S, (c,) * (S - 1), (cb,) * (S - 1), (1.0,) * S)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("S,M", [(2, 4), (4, 8), (3, 12)])
def test_no_communication_makespan_is_closed_form(schedule, S, M):
    # with free communication every schedule ends at (M + S - 1) (F + B) (§4: 1F1B and eager-1F1B tie)
    assert simulate(spec(S, M), schedule).makespan == pytest.approx((M + S - 1) * 3.0)


def test_peak_activations_per_stage():
    S, M = 4, 8
    assert simulate(spec(S, M), "gpipe").peak_activations == [M] * S
    assert simulate(spec(S, M), "1f1b").peak_activations == [S - s for s in range(S)]
    assert simulate(spec(S, M), "eager_1f1b").peak_activations == [2 * (S - s) - 1 for s in range(S)]


def test_communication_is_exposed_in_1f1b_and_hidden_in_eager_1f1b():
    sp = spec(2, 16, F=1.0, B=2.0, c=0.8)
    one, eager = simulate(sp, "1f1b"), simulate(sp, "eager_1f1b")
    assert eager.makespan < one.makespan
    assert exposed_time(sp, "eager_1f1b") == pytest.approx(0.8)  # only the first transfer, in the fill
    assert hidden_fraction(eager) > hidden_fraction(one)


def test_u_transformer_like_target():
    sp = pipeline_from_preset("u-transformer-like", Profile.load("aws-p3-v100"))
    assert min(sp.forward) > max(sp.comm_forward)  # compute exceeds communication
    eager = simulate(sp, "eager_1f1b")
    assert hidden_fraction(eager) >= 0.9
    assert hidden_fraction(simulate(sp, "1f1b")) < hidden_fraction(eager)


def test_bad_pipelines():
    with pytest.raises(UserError):
        PipelineSpec("x", 4, (1.0, 1.0), (1.0,), (0.1,), (0.1,), (1.0, 1.0))
    with pytest.raises(UserError, match="unknown pipeline schedule"):
        simulate(spec(), "zigzag")
    with pytest.raises(UserError, match="unknown pipeline"):
        pipeline_from_preset("nope", Profile.load("aws-p3-v100"))
