"""A pipeline stage in FSDP mode priced as torchtitan runs it (``autotune.pipeline.stage``'s module doc; the run
counted by tests/autotune/test_pipeline_exec_local.py): per step, a block's layers all-gathered k times in the
forward and m - k + 1 in the backward (k in flight), the layers outside the blocks once, one reduce-scatter of the
gradients after the last backward (unhidden), gradients held whole, the weights as shards (the root unit's also
whole, the blocks' gathered transiently) with the shards' optimizer states. Each check is a closed form that the
per-micro-batch rule of a single-stage FSDP plan (2m all-gathers and m reduce-scatters a step, weights and gradients
sharded) fails."""
import math

import numpy as np
import pytest

from autotune.pipeline.slicing import stage_graph, stage_spans, with_micro_batches
from autotune.pipeline.stage import StageProblem, figures, forward_cast_seconds
from autotune.sbp.boxing import Coster, Step
from autotune.sbp.memory import OUTSIDE, Mode, fsdp_axes, held_elems, weight_copy_bytes
from autotune.sbp.layers import local_elems
from autotune.sbp.mesh import Cluster
from autotune.sbp.steptime import layer_seconds

M = 4
FSDP = Mode("none", (0, 1))


def stage(graph, profile, i: int, inflight: int, mode: Mode = FSDP) -> StageProblem:
    g = with_micro_batches(graph, M)
    span = stage_spans(g, [2, 2])[i]
    return StageProblem(stage_graph(g, *span), Coster(profile, Cluster(1, 4)), None, mode=mode).in_flight(inflight)


def sharded_plan(pr: StageProblem) -> list[int]:
    """Per layer the strategy whose weights FSDP shards the most (a data-parallel plan where there is one)."""
    def saved(s):
        return sum(local_elems(w, s.mesh, pr.cluster) - held_elems(s, w, pr.cluster, pr.mode) for w in s.weights)
    return [max(range(len(ss)), key=lambda k: (saved(ss[k]), -k)) for ss in pr.choices]


def collectives(pr: StageProblem, v: int, s) -> tuple[float, float]:
    """(one all-gather, one reduce-scatter) of a layer's sharded weights, from their fp32 bytes."""
    ag = rs = 0.0
    for w in s.weights:
        axes = fsdp_axes(s, w, pr.cluster, pr.mode)
        if axes:
            nbytes = local_elems(w, s.mesh, pr.cluster) * 4
            ag += pr.coster.step_time(Step("allgather", axes, nbytes))
            rs += pr.coster.step_time(Step("reducescatter", axes, nbytes))
    return ag, rs


def test_gathers_a_step():
    """The 1F1B stage 0 of 2 (2 in flight) with 4 micro-batches: a block gathered 2 times forward, 3 backward
    (m + 1 = 5, the gloo run's count); GPipe (all in flight): m forward, 1 backward; the root once."""
    pr = StageProblem.__new__(StageProblem)
    pr.mb, pr.inflight = M, 2
    assert pr.gathers() == (2, 3, 1)
    assert pr.gathers(1) == (1, M, 1) and pr.gathers(M) == (M, 1, 1) and pr.gathers(9) == (M, 1, 1)
    assert all(sum(pr.gathers(k)[:2]) == M + 1 for k in range(1, M + 1))


@pytest.mark.parametrize("i,inflight", [(0, 2), (1, 1), (0, M)])
def test_stage_collectives_closed_form(graph, profile, i, inflight):
    """Against the same plan without FSDP (the same compute and boxing): the step's forwards carry k exposed
    gathers of each block's layer and 1 of each other layer's, and autocast's weight casts of every micro-batch
    (the plan without FSDP casts in the first micro-batch only: ``StageProblem.one_cast``), the backwards m - k + 1
    gathers of a block's layer; the gradient sync is the reduce-scatters once, exposed whole."""
    pr = stage(graph, profile, i, inflight)
    plain = stage(graph, profile, i, inflight, Mode("none"))
    nf, nb, _ = pr.gathers()
    a = sharded_plan(pr)
    f, p = figures(pr, a), figures(plain, a)
    fwd = bwd = sync = casts = 0.0
    for v, (k, c) in enumerate(zip(a, pr.counts)):
        s = pr.choices[v][k]
        ag, rs = collectives(pr, v, s)
        lf, lb = layer_seconds(pr.ops[v], s, pr.cluster, pr.compute, pr.act_bytes, "none", pr.roles[v])
        outside = pr.roles[v] == OUTSIDE
        fwd += c * (1 if outside else nf) * max(0.0, ag - lf)
        bwd += c * (0 if outside else nb) * max(0.0, ag - lb)
        sync += c * rs
        casts += c * forward_cast_seconds(None, pr.ops[v], s, pr.cluster, pr.compute, pr.act_bytes, pr.roles[v])
    assert sync > 0 and fwd + bwd > 0 and casts > 0 and plain.one_cast and not pr.one_cast
    assert M * (f.forward - p.forward) == pytest.approx(fwd + (M - 1) * casts)
    assert M * (f.backward - p.backward) == pytest.approx(bwd)
    assert f.redistribution - p.redistribution == pytest.approx(fwd + bwd)
    assert f.grad_sync == pytest.approx(sync) and f.exposed_sync == pytest.approx(sync)
    assert M * (f.forward + f.backward) + f.optimizer + f.exposed_sync == pytest.approx(pr.raw_cost(a))


def test_stage_memory_closed_form(graph, profile):
    """Parameters: the fp32 shards, and the whole fp32 weights of the layers outside the blocks (the root unit,
    kept gathered); gradients whole (fp32); optimizer states of the shards (8 bytes an element); activations as
    without FSDP but autocast's weight copies, one per micro-batch in flight (shared without FSDP); workspace
    without FSDP's plus the blocks' gathered weights, at least the two largest blocks'."""
    for i, inflight in ((0, 2), (1, 1)):
        pr = stage(graph, profile, i, inflight)
        plain = stage(graph, profile, i, inflight, Mode("none"))
        a = sharded_plan(pr)
        whole = held = root = copies = 0.0
        for v, (k, c) in enumerate(zip(a, pr.counts)):
            s = pr.choices[v][k]
            copies += c * weight_copy_bytes(s, pr.cluster, pr.act_bytes)
            for w in s.weights:
                n = local_elems(w, s.mesh, pr.cluster)
                whole += c * n
                held += c * held_elems(s, w, pr.cluster, pr.mode)
                if pr.roles[v] == OUTSIDE and fsdp_axes(s, w, pr.cluster, pr.mode):
                    root += c * n
        blocks = [sum(4 * local_elems(w, s.mesh, pr.cluster)  # whole, beside the shards
                      for p in range(lo, hi) for s in (pr.choices[pr.graph.chain[p]][a[pr.graph.chain[p]]],)
                      for w in s.weights if fsdp_axes(s, w, pr.cluster, pr.mode)) for lo, hi in pr.graph.blocks]
        assert held < whole / 2 and min(blocks) > 0
        m, p = pr.memory_breakdown(a), plain.memory_breakdown(a)
        assert m.parameters == pytest.approx(4 * (held + root))
        assert m.gradients == pytest.approx(4 * whole)
        assert m.optimizer == pytest.approx(8 * held)
        assert copies > 0 and m.activations == pytest.approx(p.activations + (inflight - 1) * copies)
        assert m.workspace - p.workspace >= sum(sorted(blocks)[-2:]) * (1 - 1e-12)
        assert m.workspace - p.workspace <= sum(blocks) * (1 + 1e-12)
        assert pr.peak_memory(a) == pytest.approx(m.total)
        assert pr.memory_of(a) == pytest.approx(m.total - m.workspace)


def test_in_flight_copies_price_their_own_gathers(graph, profile):
    """The in-flight copies share the strategies but not the gathers: more in flight, more forward gathers."""
    one = stage(graph, profile, 0, 1)
    a = sharded_plan(one)
    costs = [one.in_flight(k).raw_cost(a) for k in (1, 2, M)]
    fig = [figures(one.in_flight(k), a) for k in (1, 2, M)]
    for k, f, c in zip((1, 2, M), fig, costs):
        assert M * (f.forward + f.backward) + f.optimizer + f.exposed_sync == pytest.approx(c)
    assert len({round(f.forward, 15) for f in fig}) == 3
    assert all(math.isfinite(c) for c in costs) and not np.allclose(costs[0], costs[2])
