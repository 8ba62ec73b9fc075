"""fully_shard's forward all-gathers under FSDP2's implicit prefetch at the host's pace (issue 42,
``autotune.sbp.steptime.implicit_prefetch_exposed``, ``fsdp_forward_exposed``): closed forms of the recurrence,
a case simulated by hand, and the plan the command builds on the fully_shard path."""
from __future__ import annotations

from dataclasses import replace

import pytest

from calibrate.profile import Profile
from models import load_model

from autotune.plan.build import build
from autotune.sbp.baselines import data_parallel
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.memory import Mode
from autotune.sbp.mesh import Cluster
from autotune.sbp.steptime import fsdp_forward_exposed, fsdp_seconds, fsdp_steps, implicit_prefetch_exposed

N, C, G = 6, 3.0, 1.0  # units, each unit's forward compute and all-gather (seconds: the recurrence is scale-free)


def uniform(h: float, n: int = N):
    return [(C, h, G)] * n


def test_a_host_infinitely_fast_exposes_the_first_gather_only():
    exposed, backlog = implicit_prefetch_exposed(uniform(0.0))
    assert exposed == pytest.approx(G)
    assert backlog == pytest.approx(G + N * C)  # the CPU done at once: the whole forward queued behind it


def test_a_host_at_the_device_pace_of_compute_and_gather_exposes_every_gather():
    """h >= c + g: the CPU reaches each unit's hook when the device has drained: each gather starts then."""
    for h in (C + G, 2 * C + G):
        assert implicit_prefetch_exposed(uniform(h))[0] == pytest.approx(N * G)
        assert implicit_prefetch_exposed(uniform(h))[1] == pytest.approx(0.0)


def test_between_the_gathers_eat_the_lead():
    """c < h < c + g: the first gather exposed whole, then each unit h - c (the lead it leaves is g + c - h, short of
    the next gather by h - c); h = c: the first gather's lead hides every later one."""
    h = C + 0.4 * G
    assert implicit_prefetch_exposed(uniform(h))[0] == pytest.approx(G + (N - 1) * (h - C))
    assert implicit_prefetch_exposed(uniform(C))[0] == pytest.approx(G)


def test_the_first_gather_queues_behind_the_work_before():
    """The micro-batch before ends with a reduce-scatter on the same communicator: the first gather waits for the
    device's backlog, exposed whole; the lead the backlog leaves the CPU hides the rest (a fast host) or only
    part of the next (a host at the pace of compute and gather: N g less the lead)."""
    assert implicit_prefetch_exposed(uniform(0.0), backlog=G)[0] == pytest.approx(G)
    assert implicit_prefetch_exposed(uniform(C + G), backlog=0.5 * G)[0] == pytest.approx(N * G - 0.5 * G)


def test_a_case_simulated_by_hand():
    """Three units (compute, host, gather): unit 0 gathers 0-2, runs 2-3 (2 exposed); the CPU reaches unit 1 at 0.5,
    its gather waits for the stream to 2 and ends at 3.5, the device free at 3 (0.5 exposed), runs to 4.5 (the CPU
    done issuing it at 2.5); unit 2's gather 3.5-4.0 is done before the device is free: hidden. The CPU done at 3.5,
    the device at 7.5: a backlog of 4."""
    exposed, backlog = implicit_prefetch_exposed([(1.0, 0.5, 2.0), (1.0, 2.0, 1.5), (3.0, 1.0, 0.5)])
    assert (exposed, backlog) == (pytest.approx(2.5), pytest.approx(4.0))


def test_a_gather_waits_for_the_copy_out_two_units_before():
    """An instant host: unit 3's gather (5) may not start before unit 1 runs, at 11 behind unit 0's 10 of compute
    (fully_shard frees a gathered unit before the next but one gathers): done at 16, the device free at 13, 3
    exposed beside the first unit's 1 (without the wait it would start at 3 and hide)."""
    exposed, backlog = implicit_prefetch_exposed([(10.0, 0.0, 1.0), (1.0, 0.0, 1.0), (1.0, 0.0, 1.0), (1.0, 0.0, 5.0)])
    assert (exposed, backlog) == (pytest.approx(4.0), pytest.approx(17.0))


def test_micro_batches_after_the_first_start_with_the_backward_lead():
    """Two blocks of one layer each and an embedding outside (the root): with the host slower than compute and
    gather in the forward, the first micro-batch exposes every gather; a backward that leaves the CPU ahead hides
    the second's but the root's (queued behind the backward) and the first block's (behind the root's, the
    embedding computing nothing); a host slower than the backward exposes every gather again."""
    chain, blocks = [0, 1, 1], [(1, 2), (2, 3)]
    fwd, gather = [0.0, C], [2 * G, G]  # the root's gather at its hook, then each block's
    first = 2 * G + 2 * G
    host = [0.0, 4 * (C + G), 4 * (C + G)]  # forward share one half: h = 2 (c + g) a block
    assert fsdp_forward_exposed(chain, blocks, 2, fwd, [0.0, 10 * C], gather, host) == pytest.approx(first + 3 * G)
    assert fsdp_forward_exposed(chain, blocks, 2, fwd, [0.0, 0.0], gather, host) == pytest.approx(2 * first)
    assert fsdp_forward_exposed(chain, blocks, 1, fwd, [0.0, 10 * C], gather, host) == pytest.approx(first)
    # the root's reduce-scatter after the backward delays the next gathers, exposes no more of them
    assert fsdp_forward_exposed(chain, blocks, 2, fwd, [0.0, 0.0], gather, host, [G, 0.0]) == pytest.approx(2 * first)


MODEL = {"layers": 4, "hidden": 512, "heads": 4, "kv_heads": 2, "ffn": 2048, "vocabulary": 256, "sequence": 256,
         "batch": 8, "micro_batch": 4}


def fsdp_plan(host_s: dict):
    base = Profile.load("h200-nvlink")
    p = replace(base, compute=replace(base.compute, host_s=host_s))
    pr = Problem(load_model("llama", None, MODEL), Coster(p, Cluster(1, 2)), None, require_fit=False,
                 objective="step").with_mode(Mode(fsdp_axes=(0,)))
    return pr, build(pr, data_parallel(pr), "FSDP")


def test_the_fully_shard_plan_prices_its_forward_gathers_at_the_host_pace():
    """A host far slower than the device: every forward gather of every micro-batch exposed (closed form), in place
    of the per-layer rule's max(0, gather - forward); no host figure of the path: the per-layer rule as before."""
    pr, slow = fsdp_plan({"fully_shard": (1.0, 0.0), "ddp": (1.0, 0.0), "dtensor": (1.0, 0.0)})
    assert slow.apply_path == "fully_shard"
    assign = data_parallel(pr)
    gather = [sum(pr.coster.step_time(st) for _, d, st in fsdp_steps(pr.choices[v][i], pr.cluster, pr.mode)
                  if d == "fwd") for v, i in enumerate(assign)]
    fwd = [float(pr.node_fwd[v][i]) for v, i in enumerate(assign)]
    every = pr.mb * sum(n * g for n, g in zip(pr.counts, gather))
    per_layer = pr.mb * sum(n * max(0.0, g - f) for n, g, f in zip(pr.counts, gather, fwd))
    assert slow.costs.gather_exposed_s == pytest.approx(every) and every > per_layer
    _, none = fsdp_plan({"ddp": (1.0, 0.0), "dtensor": (1.0, 0.0)})
    assert none.costs.gather_exposed_s is None
    assert slow.costs.exposed_comm_s - none.costs.exposed_comm_s == pytest.approx(every - per_layer)
    assert slow.costs.compute_s == none.costs.compute_s


def dtensor_fsdp_plan(recompute: str = "none"):
    """The FSDP plan of ``fsdp_plan`` with the embedding, tied to the logits, split by columns: the DTensor path (an
    untied one runs on fully_shard beside it, ``layouts.column_twin``)."""
    pr = Problem(load_model("llama", None, dict(MODEL, tied=True)), Coster(Profile.load("h200-nvlink"), Cluster(1, 2)),
                 None, require_fit=False, objective="step").with_mode(Mode(fsdp_axes=(0,), recompute=recompute))
    assign = data_parallel(pr)
    v = next(v for v, op in enumerate(pr.ops) if op.layer.kind == "embedding")
    for i in range(len(pr.choices[v])):
        plan = build(pr, assign[:v] + [i] + assign[v + 1:], "per-layer")
        if plan.apply_path == "dtensor" and "S1" in plan.layers[v].weights[0].placements:
            return pr, assign[:v] + [i] + assign[v + 1:], plan
    raise AssertionError("no strategy of the embedding puts the FSDP plan on the DTensor path")


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_dtensor_path_prices_fsdps_collectives_in_series_with_the_compute(recompute):
    """On the DTensor path each all-gather at use and each reduce-scatter runs in series with the compute (closed
    form: the forward's gathers, again in the backward where the forward re-runs, and the reduce-scatters, at
    their own time), in place of the per-layer rule's hidden share; the same layers on the fully_shard path keep
    the rule."""
    pr, assign, plan = dtensor_fsdp_plan(recompute)
    serial = 0.0
    for v, (i, n) in enumerate(zip(assign, pr.counts)):
        steps = fsdp_steps(pr.choices[v][i], pr.cluster, pr.mode)
        gather = sum(pr.coster.step_time(st) for _, d, st in steps if d == "fwd")
        scatter = sum(pr.coster.step_time(st) for _, _, st in steps if st.op == "reducescatter")
        again = recompute == "full" and pr.roles[v] != "outside"
        serial += pr.mb * n * (gather * (2 if again else 1) + scatter)
    assert plan.costs.fsdp_serial_s == pytest.approx(serial) and serial > 0
    per_layer = pr.mb * sum(n * fsdp_seconds(pr.choices[v][i], pr.cluster, pr.coster, pr.mode,
                                             float(pr.node_fwd[v][i]), float(pr.node_bwd[v][i]))
                            for v, (i, n) in enumerate(zip(assign, pr.counts)))
    assert plan.costs.exposed_comm_s == pytest.approx(plan.costs.redistribution_s + pr.exposed_sync(assign)
                                                      + serial - per_layer)
    fs = build(pr, data_parallel(pr), "FSDP")
    assert fs.apply_path == "fully_shard" and fs.costs.fsdp_serial_s is None


def test_the_dtensor_path_gathers_again_in_the_backward_only_where_the_forward_reruns():
    _, _, none = dtensor_fsdp_plan("none")
    _, _, full = dtensor_fsdp_plan("full")
    assert full.costs.fsdp_serial_s > none.costs.fsdp_serial_s
