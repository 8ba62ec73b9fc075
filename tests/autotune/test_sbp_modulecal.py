"""The step model priced from the user's module as measured (the profile's ``module`` section,
``autotune.sbp.modulecal``): a closed form, the fallback to the analytical model, and the plan's source."""
from __future__ import annotations

import pytest

from calibrate.module import ModulePoint, ModuleSection
from calibrate.profile import Profile
from models import load_model

from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.plan.build import build as build_plan
from autotune.sbp.steptime import accumulate_seconds

MODEL = {"kind": "llama", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocabulary": 256,
         "sequence": 32, "batch": 4, "micro_batch": 2}
SHAPE = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocabulary": 256}
BLOCK = {"forward_s": 1e-3, "backward_s": 2e-3, "recompute_s": None, "optimizer_s": 1e-4, "activation_bytes": None}
OUTSIDE = {"forward_s": 5e-4, "backward_s": 7e-4, "optimizer_s": 3e-4}


def graph():
    fields = {k: v for k, v in MODEL.items() if k != "kind"}
    return load_model("llama", None, fields)


def plan(section, devices: int = 1):
    profile = Profile.load("h200-nvlink+ib400")
    profile.module = section
    problem = Problem(graph(), Coster(profile, Cluster(1, devices)), None, require_fit=False, objective="step")
    return problem, build_plan(problem, [0] * len(problem.choices), "test")


def section(*points, model=SHAPE):
    return ModuleSection("test", "transformers:LlamaForCausalLM", dict(model), tuple(points))


def test_a_measured_block_prices_the_step_in_closed_form():
    """One device, the model's micro-batch measured: compute = m (L (block fwd + bwd) + outside fwd + bwd)
    + L block optimizer + outside optimizer + the analytical gradient accumulation ((m - 1) per micro-batch)."""
    problem, p = plan(section(ModulePoint(1, 2, 32, BLOCK, OUTSIDE)))
    m, layers = problem.mb, MODEL["layers"]
    acc = sum(c * accumulate_seconds(problem.choices[v][0], problem.cluster, problem.compute, 2)
              for v, c in enumerate(problem.counts))
    want = (m * (layers * 3e-3 + 1.2e-3) + layers * 1e-4 + 3e-4 + (m - 1) * acc)
    assert m == 2 and p.costs.compute_s == pytest.approx(want, rel=1e-9)
    assert p.compute_source == "module"
    assert {layer.compute_source for layer in p.layers} == {"module"}
    # the block measured twice as slow: the blocks' share of the step doubles, the rest does not move
    slow = dict(BLOCK, forward_s=2e-3, backward_s=4e-3, optimizer_s=2e-4)
    _, q = plan(section(ModulePoint(1, 2, 32, slow, OUTSIDE)))
    assert q.costs.compute_s - p.costs.compute_s == pytest.approx(m * layers * 3e-3 + layers * 1e-4)


def test_measured_activations_are_what_the_plan_keeps():
    """One device: the breakdown's activations are L x the block's measured bytes + the outside's, exactly; the
    peak moves by as much; the parameters do not move. Under full recomputation the blocks keep their input only
    (the measured ratio is not applied to them)."""
    kept, rest = 3e6, 7e6
    problem, p = plan(section(ModulePoint(1, 2, 32, dict(BLOCK, activation_bytes=kept),
                                          dict(OUTSIDE, activation_bytes=rest))))
    plain, q = plan(None)
    a = [0] * len(problem.choices)
    got, analytical = problem.memory_breakdown(a), plain.memory_breakdown(a)
    assert got.activations == pytest.approx(MODEL["layers"] * kept + rest, rel=1e-9)
    assert got.parameters == analytical.parameters and got.workspace == analytical.workspace
    assert p.costs.memory_bytes - q.costs.memory_bytes == pytest.approx(got.activations - analytical.activations)
    assert sum(layer.costs["memory_bytes"] * layer.count for layer in p.layers) == pytest.approx(
        problem.memory_of(a))
    from autotune.sbp.memory import Mode
    full, plain_full = (x.with_mode(Mode(recompute="full")) for x in (problem, plain))
    outside = [v for v, r in enumerate(full.roles) if r == "outside"]
    gap = full.memory_breakdown(a).activations - plain_full.memory_breakdown(a).activations
    want = sum(full.counts[v] * plain_full.layer_memory(v, plain_full.choices[v][0]).activations for v in outside)
    assert gap == pytest.approx(rest - want, rel=1e-9)


def test_the_step_measured_back_to_back_is_the_sum_the_parts_make():
    """With ``step_s`` measured (2 micro-batches accumulated and the optimizer's step, back to back), one device at
    the model's 2 micro-batches: compute = L x block step + outside step, exactly, whatever the parts alone say;
    their proportions are kept (forward / backward as measured alone)."""
    problem, p = plan(section(ModulePoint(1, 2, 32, dict(BLOCK, step_s=9e-3), dict(OUTSIDE, step_s=4e-3))))
    assert problem.mb == 2
    assert p.costs.compute_s == pytest.approx(MODEL["layers"] * 9e-3 + 4e-3, rel=1e-9)
    cal = problem.module_cal
    rf, rb = cal.ratio(True, (1, 2))[:2]
    pf, pb = plan(section(ModulePoint(1, 2, 32, BLOCK, OUTSIDE)))[0].module_cal.ratio(True, (1, 2))[:2]
    assert rf / pf == pytest.approx(rb / pb) and rf != pytest.approx(pf)


def test_a_one_block_model_peaks_where_it_was_measured():
    """The measured one-block step's peak (above parameters and optimizer states) is the one-block model's
    predicted peak exactly; a model of 4 blocks moves by the same bytes as the one-block model did."""
    fields = {k: v for k, v in MODEL.items() if k != "kind"}
    profile = Profile.load("h200-nvlink+ib400")
    point = ModulePoint(1, 2, 32, dict(BLOCK, activation_bytes=3e6), dict(OUTSIDE, activation_bytes=7e6,
                                                                           peak_bytes=5e7))

    def breakdown(layers, sec):
        profile.module = sec
        problem = Problem(load_model("llama", None, dict(fields, layers=layers)),
                          Coster(profile, Cluster(1, 1)), None, require_fit=False, objective="step")
        return problem.memory_breakdown([0] * len(problem.choices))

    one = breakdown(1, section(point))
    assert one.total - one.parameters - one.optimizer == pytest.approx(5e7, rel=1e-9)
    unmeasured = section(ModulePoint(1, 2, 32, point.block, dict(point.outside, peak_bytes=None)))
    shift = one.total - breakdown(1, unmeasured).total
    assert breakdown(4, section(point)).total - breakdown(4, unmeasured).total == pytest.approx(shift, rel=1e-9)


def test_a_blocks_forward_transient_is_held_by_every_block_at_the_forwards_end():
    """What a block holds at the forward's end beyond what it keeps (a transformers model's key/value cache): where
    the forward's end binds, a model of 4 blocks holds 4 of it and the one-block model, which the measured peak
    corrects, 1: moving the transient by dT moves the 4-block peak by 3 dT; the one-block peak stays as measured."""
    fields = {k: v for k, v in MODEL.items() if k != "kind"}
    profile = Profile.load("h200-nvlink+ib400")

    def total(layers, transient):
        profile.module = section(ModulePoint(1, 2, 32, dict(BLOCK, activation_bytes=3e6,
                                                            forward_transient_bytes=transient),
                                             dict(OUTSIDE, activation_bytes=7e6, peak_bytes=5e7)))
        problem = Problem(load_model("llama", None, dict(fields, layers=layers)),
                          Coster(profile, Cluster(1, 1)), None, require_fit=False, objective="step")
        b = problem.memory_breakdown([0] * len(problem.choices))
        return b.total, b.total - b.parameters - b.optimizer

    assert total(1, 1e9)[1] == pytest.approx(5e7, rel=1e-9) == total(1, 2e9)[1]
    assert total(4, 2e9)[0] - total(4, 1e9)[0] == pytest.approx(3e9, rel=1e-9)


def test_the_measured_peak_corrects_the_modules_own_loss_not_loss_parallel():
    """The measured step's peak is of the module's own loss on its local vocabulary: it moves a data-parallel plan
    (the loss whole) by the measured difference, and not a tensor-parallel plan whose logits are split by vocabulary
    (torch's loss_parallel, priced as measured on its own: ``memory.LOSS_PARALLEL_KEPT``)."""
    from autotune.sbp.baselines import megatron_assignment
    from autotune.sbp.memory import loss_parallel
    fields = {k: v for k, v in MODEL.items() if k != "kind"}
    profile = Profile.load("h200-nvlink+ib400")

    def totals(peak):
        outside = dict(OUTSIDE, activation_bytes=7e6, peak_bytes=peak)
        block = dict(BLOCK, activation_bytes=3e6)
        profile.module = section(ModulePoint(1, 1, 32, block, outside), ModulePoint(1, 2, 32, block, outside))
        problem = Problem(load_model("llama", None, fields), Coster(profile, Cluster(1, 2)), None, require_fit=False,
                          objective="step")
        out = []
        for d, t in (((1, 2), (1, 1)), ((1, 1), (1, 2))):
            a = megatron_assignment(problem, d, t)
            out.append((problem.memory_breakdown(a).total,
                        any(loss_parallel(problem.choices[v][i]) for v, i in enumerate(a))))
        return out

    (dp, dp_split), (tp, tp_split) = totals(5e7)
    (dp2, _), (tp2, _) = totals(9e7)
    assert (dp_split, tp_split) == (False, True)
    assert dp2 - dp == pytest.approx(4e7, rel=1e-9) and tp2 == tp


def test_a_tensor_parallel_blocks_transient_is_the_one_measured_at_its_heads_split():
    """A block's transient (its key/value cache: the heads it holds) is read at the block's own local shape: for
    Megatron t=2 the point measured at width 2, not the width-1 point of the same micro-batch (the embedding's)."""
    from autotune.sbp.baselines import megatron_assignment
    fields = {k: v for k, v in MODEL.items() if k != "kind"}
    profile = Profile.load("h200-nvlink+ib400")

    def total(whole, half):
        outside = dict(OUTSIDE, activation_bytes=7e6)
        profile.module = section(*(ModulePoint(t, 2, 32, dict(BLOCK, activation_bytes=3e6,
                                                              forward_transient_bytes=x), outside)
                                   for t, x in ((1, whole), (2, half))))
        problem = Problem(load_model("llama", None, fields), Coster(profile, Cluster(1, 2)), None, require_fit=False,
                          objective="step")
        return problem.memory_breakdown(megatron_assignment(problem, (1, 1), (1, 2))).total

    assert total(1e9, 2e9) - total(1e9, 1e9) == pytest.approx(4e9, rel=1e-9)  # 4 blocks
    assert total(3e9, 1e9) == total(1e9, 1e9)


def test_a_pipeline_stage_does_not_hold_the_users_step_transients():
    """A pipeline's stage runs the cut of the model (no key/value cache, the stage's own loss): the module's measured
    transient and peak are not added to it; the whole model run as one stage without a pipeline keeps them."""
    from autotune.pipeline.stage import StageProblem
    fields = {k: v for k, v in MODEL.items() if k != "kind"}
    profile = Profile.load("h200-nvlink+ib400")

    def total(transient, peak, pipelined):
        profile.module = section(ModulePoint(1, 2, 32, dict(BLOCK, activation_bytes=3e6,
                                                            forward_transient_bytes=transient),
                                             dict(OUTSIDE, activation_bytes=7e6, peak_bytes=peak)))
        problem = StageProblem(load_model("llama", None, fields), Coster(profile, Cluster(1, 1)), None,
                               pipelined=pipelined)
        return problem.memory_breakdown([0] * len(problem.choices)).total

    assert total(2e9, 9e7, True) == total(1e9, 5e7, True)
    assert total(2e9, 9e7, False) != total(1e9, 5e7, False)


def stage(profile, pipelined=True, micro_batches=None):
    from autotune.pipeline.slicing import with_micro_batches
    from autotune.pipeline.stage import StageProblem
    g = load_model("llama", None, {k: v for k, v in MODEL.items() if k != "kind"})
    g = with_micro_batches(g, micro_batches) if micro_batches else g
    return StageProblem(g, Coster(profile, Cluster(1, 1)), None, pipelined=pipelined)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_stages_figures_are_its_problems_cost_with_the_users_module(pipelined):
    """The forward and backward a micro-batch the schedule is simulated with are priced as the stage problem prices
    them, the user's module as measured: m (forward + backward) + optimizer + exposed sync is the problem's cost, and
    the module's ratios move both."""
    from dataclasses import replace
    from autotune.pipeline.stage import figures
    profile = Profile.load("h200-nvlink+ib400")
    profile = replace(profile, compute=replace(profile.compute, host_s={}))  # the device's figures, no host floor
    plain = stage(profile, pipelined)
    profile.module = section(ModulePoint(1, 2, 32, dict(BLOCK, forward_s=5e-3), OUTSIDE))
    pr = stage(profile, pipelined)
    a = [0] * len(pr.choices)
    f, g = figures(pr, a), figures(plain, a)
    assert pr.mb * (f.forward + f.backward) + f.optimizer + f.exposed_sync == pytest.approx(pr.raw_cost(a), rel=1e-9)
    assert f.forward > 1.5 * g.forward


def test_a_pipelined_stage_casts_its_weights_once_and_shares_their_copies():
    """torch's schedule runs a step's micro-batches in one autocast context: the stage's forward casts its weights in
    the first micro-batch only ((m - 1) / m of the casts off each forward), and the micro-batches in flight share one
    bf16 copy of the weights (2 bytes a matmul parameter), where the same stage stepped without a pipeline keeps one
    a micro-batch."""
    from dataclasses import replace
    from autotune.pipeline.stage import figures
    from autotune.sbp.steptime import weight_cast_seconds
    profile = Profile.load("h200-nvlink+ib400")
    profile = replace(profile, compute=replace(profile.compute, host_s={}))  # the device's figures, no host floor
    one, plain = stage(profile, micro_batches=4), stage(profile, False, micro_batches=4)
    a = [0] * len(one.choices)
    m = one.mb
    casts = sum(c * weight_cast_seconds(one.choices[v][0], one.cluster, one.compute, 2)[0]
                for v, c in enumerate(one.counts))
    f, g = figures(one, a), figures(plain, a)
    assert m == 4 and casts > 0
    assert f.forward == pytest.approx(g.forward - (m - 1) / m * casts, rel=1e-9)
    assert f.backward == pytest.approx(g.backward, rel=1e-9)
    assert m * (f.forward + f.backward) + f.optimizer + f.exposed_sync == pytest.approx(one.raw_cost(a), rel=1e-9)
    h, kv = MODEL["hidden"], MODEL["hidden"] // MODEL["heads"] * MODEL["kv_heads"]
    matmul = MODEL["layers"] * (2 * h * h + 2 * h * kv + 3 * h * MODEL["ffn"]) + h * MODEL["vocabulary"]
    per = plain.memory_breakdown(a).activations - 2 * matmul  # what each micro-batch keeps but the copies
    for k in (1, 2, 3):
        got = one.in_flight(k)
        assert got.memory_breakdown(a).activations == pytest.approx(k * per + 2 * matmul, rel=1e-9)
        b = got.memory_breakdown(a)
        assert sum(float(x[i]) for x, i in zip(got.mem, a)) == pytest.approx(b.total - b.workspace, rel=1e-9)


@pytest.mark.parametrize("points, model", [
    ((ModulePoint(1, 2, 64, BLOCK, OUTSIDE),), SHAPE),  # another sequence
    ((ModulePoint(1, 2, 32, BLOCK, OUTSIDE),), dict(SHAPE, ffn=256)),  # another model
])
def test_unmeasured_shapes_keep_the_analytical_price(points, model):
    _, analytical = plan(None)
    _, p = plan(section(*points, model=model))
    assert p.costs.compute_s == pytest.approx(analytical.costs.compute_s, rel=1e-12)
    assert p.compute_source == "analytical"


def test_an_unmeasured_width_takes_the_nearest_measured_widths_ratios():
    """A layer whose tensor width was not measured is priced by the nearest measured width's ratios (nearest width
    first, then micro-batch), and says so ("nearest"): not analytically, which the search would take for cheap
    wherever the analytical model is optimistic (2 x H200, GPT-2 medium's blocks: 2.4 x its forward)."""
    problem, p = plan(section(ModulePoint(2, 2, 32, BLOCK, OUTSIDE)))  # one device: every layer at width 1
    cal = problem.module_cal
    assert cal.ratio(True, (1, 2)) == cal.ratio(True, (2, 2)) and not cal.measured((1, 2)) and cal.measured((2, 2))
    _, analytical = plan(None)
    assert p.compute_source == "nearest" and p.costs.compute_s != pytest.approx(analytical.costs.compute_s)
    problem, _ = plan(section(ModulePoint(1, 4, 32, BLOCK, OUTSIDE), ModulePoint(2, 1, 32, dict(BLOCK, forward_s=2e-3),
                                                                                   OUTSIDE)))
    cal = problem.module_cal
    assert cal.ratio(True, (2, 4)) == cal.ratio(True, (2, 1)) != cal.ratio(True, (1, 4))  # its width, any batch
    assert cal.ratio(True, (4, 4)) == cal.ratio(True, (2, 1))  # width 4: 2 is the nearest measured


def test_each_layer_reads_the_point_of_its_local_shape():
    """Two devices: a data-parallel layer runs micro-batch 1 at width 1, a column-parallel one width 2."""
    problem, _ = plan(section(ModulePoint(1, 1, 32, BLOCK, OUTSIDE), ModulePoint(2, 2, 32, BLOCK, OUTSIDE)), 2)
    cal = problem.module_cal
    keys = {cal.key(op, s, problem.cluster) for op, ss in zip(problem.ops, problem.choices) for s in ss}
    assert {(1, 1), (2, 2), (1, 2)} <= keys
    assert cal.ratio(True, (2, 2)) != cal.ratio(True, (1, 1))


def test_the_allocators_fragmentation_is_an_allowance_under_the_limit():
    from dataclasses import replace

    from autotune.cli.search import memory_limit
    profile = Profile.load("h200-nvlink")
    plain, _ = memory_limit(profile, None)
    assert plain == pytest.approx(profile.device.usable_bytes * (1 - profile.fragmentation_fraction))
    profile.module = replace(section(ModulePoint(1, 2, 32, BLOCK, OUTSIDE)), memory={"fragmentation": 0.1})
    limit, note = memory_limit(profile, None)  # the module's measured allowance replaces the profile's, not both
    assert limit == pytest.approx(profile.device.usable_bytes / 1.1) and "fragmentation" in note
    profile.module = replace(profile.module, memory={"fragmentation": 0.0})  # measured: none
    assert memory_limit(profile, None)[0] == pytest.approx(profile.device.usable_bytes)
    assert memory_limit(profile, 10.0)[0] == 10 * 2**30  # a limit the user gives is theirs
    # a job under expandable segments: the profile's allowance for them, whatever the module measured (under the
    # default allocator, another allocator's; under expandable segments, the unconstrained gap that overstates it)
    for measured in ({"fragmentation": 0.1}, {"fragmentation": 0.08, "allocator": "expandable_segments"}):
        profile.module = replace(profile.module, memory=measured)
        assert memory_limit(profile, None, "expandable_segments")[0] == \
            profile.memory_bytes_under("expandable_segments")
    assert memory_limit(profile, None)[0] == plain  # measured under expandable segments: not the default's


def test_the_modules_own_host_cost_paces_its_blocks():
    """A plan on the DDP path: blocks at the module section's measured host pace, the rest at the compute section's
    per layer occurrence: host step = m (L h_block + n_out h) + L s_block + n_out s."""
    from autotune.plan.hostpace import at_host_pace
    problem, _ = plan(None, devices=2)
    from autotune.sbp.baselines import data_parallel
    dp = build_plan(problem, data_parallel(problem), "data parallel")
    cm = problem.compute
    pace = at_host_pace(dp, cm)
    assert pace.apply_path == "ddp"
    own = replace_host(section(ModulePoint(1, 2, 32, BLOCK, OUTSIDE)), {"ddp": (0.5, 0.25)})
    with_own = at_host_pace(dp, cm, own)
    g = dp.model.graph()
    outside = len(g.chain) - sum(e - s for s, e in g.blocks)
    h, s = cm.host_s["ddp"]
    m = dp.micro_batches
    want = m * (len(g.blocks) * 0.5 + outside * h) + len(g.blocks) * 0.25 + outside * s
    assert with_own.costs.host_step_s == pytest.approx(want)
    assert with_own.costs.step_s == pytest.approx(max(dp.costs.step_s, want))
    other = replace_host(section(ModulePoint(1, 2, 32, BLOCK, OUTSIDE), model=dict(SHAPE, ffn=256)), {"ddp": (0.5, 0.25)})
    assert at_host_pace(dp, cm, other).costs == pace.costs  # another model's section: not used


def replace_host(sec, host):
    from dataclasses import replace
    return replace(sec, host_s=host)


def test_a_tensor_or_dtensor_plan_priced_without_the_users_module_says_so():
    """The search's note: a plan on the tensor or DTensor path for several devices whose compute (and host) is the
    analytical model's names the command that measures the user's module; none for DDP, one device, the
    communication objective, or a plan priced from the module."""
    from types import SimpleNamespace

    from autotune.cli.search import host_note

    def plan(path, source="analytical"):
        return SimpleNamespace(apply_path=path, compute_source=source)
    assert "python -m calibrate module" in host_note(plan("tensor"), "step", 4, "h200-nvlink")
    assert "dtensor path" in host_note(plan("dtensor"), "step", 2, "h200-nvlink")
    # a profile without the tensor path's figure outside the blocks says so too, one with it does not
    bare, measured = (SimpleNamespace(host_outside_s=x) for x in ({}, {"tensor": (0.03, 0.004)}))
    assert "outside the blocks" in host_note(plan("tensor"), "step", 4, "h200-nvlink", bare)
    assert "outside the blocks" not in host_note(plan("tensor"), "step", 4, "h200-nvlink", measured)
    assert "outside the blocks" not in host_note(plan("dtensor"), "step", 4, "h200-nvlink", bare)
    for args in ((plan("ddp"), "step", 4), (plan("tensor"), "step", 1), (plan("tensor"), "comm", 4),
                 (plan("tensor", "module"), "step", 4)):
        assert host_note(*args, "h200-nvlink") is None


def test_the_search_slows_fsdps_compute_by_the_modules_own_overlap():
    """``autotune.search`` prices the model's compute beside fully_shard's collectives at its module section's slowdown
    (``Profile.for_model``), not the compute section's: FSDP's exposed communication (the compute's slowdown beside
    it included; the tiny model's step is the host's) rises with the module's figure, DDP's (its all-reduce beside
    one micro-batch's backward) far less, and another model's section changes nothing."""
    import autotune
    from dataclasses import replace
    from autotune.sbp.search import Budget

    def steps(overlap, model=SHAPE):
        profile = Profile.load("h200-nvlink")
        if overlap is not None:
            profile.module = replace(section(ModulePoint(1, 2, 32, BLOCK, OUTSIDE), model=model), overlap=overlap)
        found = autotune.search(graph(), Cluster(1, 2), profile, memory_limit=None, budget=Budget(steps=20),
                                compare=(), pipeline="off")
        return {p.strategy: p.costs.exposed_comm_s for p in found.baselines}

    same = dict(Profile.load("h200-nvlink").compute.overlap)
    slow = {**same, "all_gather": 1.5, "reduce_scatter": 1.5, "all_reduce": 1.5}
    base, slowed = steps(same), steps(slow)
    fsdp = next(k for k in base if "FSDP" in k)
    ddp = next(k for k in base if k.startswith("data parallel"))
    assert slowed[fsdp] > base[fsdp] * 1.05
    assert slowed[fsdp] - base[fsdp] > 2 * (slowed[ddp] - base[ddp])
    assert steps(slow, model=dict(SHAPE, ffn=256)) == steps(None)  # measured on another model: not this one's
