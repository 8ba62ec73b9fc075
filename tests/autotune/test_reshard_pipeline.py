import pytest

from autotune.reshard.pipeline import (PHASES, SCHEDULES, PipelineSpec, Skip, exposed_time, hidden_fraction,
                                       simulate)
from autotune.reshard.stagecomm import pipeline_from_preset
from calibrate.errors import UserError
from calibrate.profile import Profile


def spec(S=4, M=8, F=1.0, B=2.0, c=0.0, cb=None, skips=()):
    cb = c if cb is None else cb
    return PipelineSpec("t", M, (F,) * S, (B,) * S, (c,) * (S - 1), (cb,) * (S - 1), (1.0,) * S, skips)


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


@pytest.mark.parametrize("S", [2, 4])
def test_eager_1f1b_exposes_only_the_fill_and_the_drain(S):
    # c <= F: eager-1F1B loses only the first activation's trip down and the last gradient's trip up
    M, c = 16, 0.5
    assert simulate(spec(S, M, c=c), "eager_1f1b").makespan == pytest.approx((M + S - 1) * 3.0 + 2 * (S - 1) * c)


@pytest.mark.parametrize("S", [2, 4])
def test_1f1b_steady_period_carries_the_critical_loop(S):
    # 1F1B, stage 0 holds S micro-batches: the loop stage 0 -> ... -> last stage -> ... -> stage 0 takes
    # S (F + B) + 2 (S - 1) c every S micro-batches, all its transfers on the critical path
    c = 0.5
    grow = simulate(spec(S, 16 + S, c=c), "1f1b").makespan - simulate(spec(S, 16, c=c), "1f1b").makespan
    assert grow == pytest.approx(S * 3.0 + 2 * (S - 1) * c)


def test_hidden_definition_on_closed_forms():
    lone = simulate(spec(2, 1, c=0.5), "1f1b")  # one micro-batch: every consumer idles through its transfer
    assert hidden_fraction(lone) == 0.0
    # two stages, steady phase: 1F1B overlaps one transfer in two (stage 0 holds two micro-batches), eager all
    assert hidden_fraction(simulate(spec(2, 32, c=0.5), "1f1b"), "steady") == pytest.approx(0.5)
    assert hidden_fraction(simulate(spec(2, 32, c=0.5), "eager_1f1b"), "steady") == pytest.approx(1.0)
    assert hidden_fraction(simulate(spec(2, 8), "1f1b")) == 1.0  # no communication at all
    assert hidden_fraction(simulate(spec(2, 8, c=0.5), "gpipe"), "steady") is None  # GPipe has no steady phase


def test_skip_connection_waits_and_shares_the_send_port():
    late = spec(4, 1, c=0.0, skips=(Skip(0, 3, 5.0, 0.0),))
    # F(3, 0) waits for the skip (arrives at 1 + 5), then B runs down: 4F + 4B + 5 - 2 (stages 1, 2 overlapped)
    assert simulate(late, "1f1b").makespan == pytest.approx(15.0)
    both = simulate(spec(4, 1, c=1.0, skips=(Skip(0, 3, 1.0, 0.0),)), "1f1b")
    links = {i.lane: i for i in both.intervals if i.kind == "C" and i.lane in ("link 0>1", "link 0>3")}
    assert (links["link 0>1"].start, links["link 0>3"].start) == (1.0, 2.0)  # one send port on stage 0's host


def test_u_transformer_like_target():
    sp = pipeline_from_preset("u-transformer-like", Profile.load("aws-p3-v100"))
    assert sp.stages == 4 and sp.micro_batches == 16 and [(k.src, k.dst) for k in sp.skips] == [(0, 3)]
    # each stage computes longer than it sends (or receives) per micro-batch and direction
    sends = [0.0] * 4
    for a, b, f, _ in sp.edges():
        sends[a] += f
    assert min(sp.forward) > max(sends)
    eager, one = simulate(sp, "eager_1f1b"), simulate(sp, "1f1b")
    assert hidden_fraction(eager, "steady") >= 0.9
    assert hidden_fraction(one, "steady") < 0.6
    assert exposed_time(sp, "eager_1f1b") == pytest.approx(exposed_time(sp, "gpipe"))
    assert exposed_time(sp, "1f1b") > 4 * exposed_time(sp, "eager_1f1b")


def test_bad_pipelines():
    with pytest.raises(UserError):
        PipelineSpec("x", 4, (1.0, 1.0), (1.0,), (0.1,), (0.1,), (1.0, 1.0))
    with pytest.raises(UserError, match="skip"):
        spec(4, 4, skips=(Skip(1, 2, 0.1, 0.1),))
    with pytest.raises(UserError, match="unknown pipeline schedule"):
        simulate(spec(), "zigzag")
    with pytest.raises(UserError, match="unknown pipeline phase"):
        hidden_fraction(simulate(spec(), "1f1b"), "middle")
    with pytest.raises(UserError, match="unknown pipeline"):
        pipeline_from_preset("nope", Profile.load("aws-p3-v100"))
    assert set(PHASES) == {"warmup", "steady", "cooldown"}


@pytest.mark.parametrize("S, boundaries", [(2, 1), (4, 2)])
def test_blocking_1f1b_hides_nothing_and_its_period_carries_every_transfer(S, boundaries):
    # Alpa's runtime: send/recv in the stages' streams. A stage with k boundaries spends 2k transfers
    # (forward and backward, in and out) per micro-batch blocked: period F + B + 2kc.
    F, B, c = 1.0, 2.0, 0.5
    r16, r17 = (simulate(spec(S, M, F, B, c=c), "1f1b", overlap=False) for M in (16, 17))
    assert r17.makespan - r16.makespan == pytest.approx(F + B + 2 * boundaries * c)
    assert hidden_fraction(r16) == 0.0 and hidden_fraction(r16, "steady") == 0.0
    assert r16.makespan > simulate(spec(S, 16, F, B, c=c), "1f1b").makespan
    # one micro-batch on two stages: F0, transfer, F1, B1, transfer, B0 back to back
    assert simulate(spec(2, 1, F, B, c=c), "1f1b", overlap=False).makespan == pytest.approx(2 * F + 2 * B + 2 * c)
