"""Stages of a small GPT: slices of the layer graph, the in-flight memory, the stage figures against the
stage problem's step cost, boundaries priced by the resharding planner, and the stage DP of the search
against every split."""
import itertools
from dataclasses import replace
import math

import numpy as np
import pytest

from calibrate.collectives import Collective
from calibrate.profile import Group
from models import load_model
from autotune.pipeline.boundary import BoundaryPricer, tiles
from autotune.pipeline.search import PipelineConfig, PipelineSearch, Rung, StagePlan, _stage_cost, inflight
from autotune.pipeline.slicing import blocks, stage_graph, stage_spans, with_micro_batches
from autotune.pipeline.split import estimate
from autotune.pipeline.stage import StageProblem, figures
from autotune.sbp.boxing import Coster
from autotune.sbp.memory import strategy_memory, weight_copy_bytes
from autotune.sbp.mesh import Cluster
from kernels.reshard.spec import box_volume
from tiny_models import PIPELINE_GPT




def test_slices_cover_the_chain(graph):
    assert len(blocks(graph)) == 4
    spans = stage_spans(graph, [1, 2, 1])
    assert spans[0][0] == 0 and spans[-1][1] == len(graph.chain)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    names = [l.name for lo, hi in spans for g in (stage_graph(graph, lo, hi),) for l in (g.layers[v] for v in g.chain)]
    assert names == [graph.layers[v].name for v in graph.chain]
    mid = stage_graph(graph, *spans[1])
    assert mid.counts() == [2] * len(mid.layers)  # two blocks of tied layers
    assert with_micro_batches(graph, 8).micro_batch == 2


def test_inflight_memory_and_figures(graph, profile):
    g = with_micro_batches(graph, 4)
    span = stage_spans(g, [2, 2])[0]
    cl = Cluster(1, 2)
    base = StageProblem(stage_graph(g, *span), Coster(profile, cl), None)
    a = base.min_memory_assignment()
    # what each micro-batch in flight adds: its activations but autocast's weight copies, which they share
    acts = sum(c * (strategy_memory(s, cl, base.act_bytes).activations - weight_copy_bytes(s, cl, base.act_bytes))
               for v, c in enumerate(base.counts) for s in (base.choices[v][a[v]],))
    assert acts > 0
    for k in (2, 3):
        p = base.in_flight(k)
        assert p.memory_of(a) == pytest.approx(base.memory_of(a) + (k - 1) * acts)
        assert p.peak_memory(a) - base.peak_memory(a) == pytest.approx((k - 1) * acts)
        assert base.inflight == 1  # a copy, the base unchanged
    f = figures(base, a)
    assert base.mb * (f.forward + f.backward) + f.optimizer + f.exposed_sync == pytest.approx(base.raw_cost(a))
    assert f.forward > 0 and f.backward > f.forward


def test_the_schedule_holds_receive_buffers_and_the_last_stages_logits(graph, profile):
    """torch.distributed.pipelining's own tensors (``StageProblem.schedule_bytes``, closed form on one device a
    stage, every tensor whole): a receive buffer a micro-batch of the step for the input of a stage after the first
    (the stream, fp32 under autocast) and for the output's gradient of a stage before the last, and the last
    stage's logits (bf16), in each stage's workspace; nothing for a whole model run without a pipeline."""
    m = 4
    g = with_micro_batches(graph, m)
    c = g.config
    stream, logits = g.micro_batch * c["sequence"] * c["hidden"] * 4, g.micro_batch * c["sequence"] * c["vocabulary"] * 2
    got = []
    for span in stage_spans(g, [1, 2, 1]):
        p = StageProblem(stage_graph(g, *span), Coster(profile, Cluster(1, 1)), None)
        a = p.min_memory_assignment()
        assert p.peak_memory(a) - p._layers_breakdown(a).total == pytest.approx(p.schedule_bytes(a))
        got.append(p.schedule_bytes(a))
    assert got == [m * stream, 2 * m * stream, m * stream + logits]
    whole = StageProblem(g, Coster(profile, Cluster(1, 1)), None, pipelined=False)
    assert whole.schedule_bytes(whole.min_memory_assignment()) == 0


def test_tiles_partition_the_tensor():
    cl = Cluster(4, 4)  # fine axes 2 x 2 | 2 x 2
    shape = (64, 32)
    for fine in [("S0", "S1", "S0", "B"), ("B", "B", "S1", "S0"), ("S1", "S1", "S1", "S1")]:
        t = tiles(shape, fine, cl, range(cl.devices))
        distinct = set(t.values())
        assert sum(box_volume(b) for b in distinct) == shape[0] * shape[1]
        copies = math.prod(n for n, p in zip(cl.axis_sizes, fine) if p == "B")
        assert all(list(t.values()).count(b) == copies for b in distinct)


def test_boundary_between_equal_placements_is_one_hop(profile):
    # stages of 2 GPUs in one node, both with rows split over their 2 GPUs: device i of stage 0 sends its
    # half to device i of stage 1, both pairs at once on the intra-node tier
    pricer = BoundaryPricer(profile, 8, 2)
    cl = Cluster(1, 2)
    shape = (512, 256)
    fwd, bwd = pricer.boundary(shape, ("S0",), ("S0",), ("S0",), cl, cl, 0)
    one = profile.time(Collective.SENDRECV, shape[0] * shape[1] * 2 / 2, Group(2, 1))
    assert fwd == pytest.approx(one, rel=1e-6) and bwd == pytest.approx(one, rel=1e-6)
    # across nodes: each of the node's devices shares the node's port, so the time is at least one inter hop
    whole = Cluster(1, 8)
    f2, _ = pricer.boundary(shape, ("S0",) * 3, ("S0",) * 3, ("S0",) * 3, whole, whole, 0)
    assert f2 >= profile.time(Collective.SENDRECV, shape[0] * shape[1] * 2 / 8, Group(2, 2)) * (1 - 1e-9)
    # a partial output is reduced before it leaves: dearer than the same tensor split
    f3, _ = pricer.boundary(shape, ("P",), ("S0",), ("S0",), cl, cl, 0)
    assert f3 > fwd


def test_stage_dp_against_every_split(graph, profile):
    ps = PipelineSearch(graph, Cluster(2, 2), profile, 80 * 2**30, PipelineConfig(stages=2, width=3))
    m, p, sub = 4, 2, Cluster(1, 2)
    c = ps.refine(ps.candidate(p, sub, m, ps.balanced(p)), width=3)
    g = ps.graph_for(m)
    best = math.inf
    for split in itertools.product(range(1, 4), repeat=p):
        if sum(split) != 4:
            continue
        spans = stage_spans(g, list(split))
        ts = []
        for i in range(p):
            sp = ps.stages.plan(m, spans[i], sub, inflight(ps.schedule, i, p, m))
            ts.append(sp.fig.forward + sp.fig.backward)
        best = min(best, estimate(ts, m))
    assert c.estimate == pytest.approx(best)
    done = ps.finish(c)
    assert np.isfinite(done.step) and done.step >= done.result.makespan


@pytest.mark.parametrize("kind,preset,config", [
    ("gpt", "gpt3-1.3b", PIPELINE_GPT),
    ("llama", "llama3-8b", {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512, "sequence": 128,
                            "vocabulary": 1024, "batch": 16, "micro_batch": 4}),
])
def test_catalogue_changes_no_figure(kind, preset, config, profile):
    """Stage problems sharing strategies and boxing tables (``Catalogue``) price every plan exactly as problems
    built alone: the same strategies, per-layer costs, memory and boxing tables, under each mode."""
    from autotune.sbp.cost import Catalogue
    from autotune.sbp.memory import Mode
    g = load_model(kind, preset, config)
    cl = Cluster(2, 2)
    cat = Catalogue(Coster(profile, cl))
    spans = stage_spans(g, [1, 2, 1]) + stage_spans(g, [2, 2])
    made = []
    for span in spans + spans:  # the second round reads the catalogue's tables and per-strategy figures
        sg = stage_graph(g, *span)
        alone = StageProblem(sg, Coster(profile, cl), 80 * 2**30)
        shared = StageProblem(sg, cat.coster, 80 * 2**30, catalogue=cat)
        for mode in (Mode("none", None), Mode("full", (0, 1)), Mode("none", (1,)), Mode("full", None)):
            a, b = alone.with_mode(mode), shared.with_mode(mode)
            assert [[s.signature for s in ss] for ss in a.choices] == [[s.signature for s in ss] for ss in b.choices]
            assert [[s.fine_out for s in ss] for ss in a.choices] == [[s.fine_out for s in ss] for ss in b.choices]
            for x, y in zip(a.node + a.mem + a.node_sync + a.node_compute + a.node_bwd + a.node_redist + a._acts,
                            b.node + b.mem + b.node_sync + b.node_compute + b.node_bwd + b.node_redist + b._acts):
                np.testing.assert_array_equal(x, y)
            for u, v in a.edge_counts:
                if u != v:
                    np.testing.assert_array_equal(a.edge_matrix(u, v), b.edge_matrix(u, v))
            # a mode's problem made from the plain one (the pipeline search's way) keeps the mode's in-flight memory
            direct = StageProblem(sg, Coster(profile, cl), 80 * 2**30, mode=mode).in_flight(3)
            for x, y in zip(direct.mem + direct.node, b.in_flight(3).mem + b.in_flight(3).node):
                np.testing.assert_array_equal(x, y)
            assert direct.min_memory == b.in_flight(3).min_memory
        made.append(len(cat.figures))
        # the modes with the same forward factors share one set of boxing tables
        assert shared.with_mode(Mode("full", (0, 1))).tables is shared.with_mode(Mode("full", None)).tables
        assert shared.with_mode(Mode("none", (1,))).tables is shared.tables
    assert cat.strategies and all(r._tables for r in cat.rows.values())
    assert made[len(spans) - 1] > 0 and made[-1] == made[len(spans) - 1]  # the second round priced nothing anew


def test_rungs_serve_the_inflight_counts_they_fit(graph, profile):
    """Each in-flight count is served by the search under the largest count at most it (one in flight searched
    first) where it fits under it, its plan that one's or a cheaper one's; a count beyond every rung's reach is
    searched itself."""
    ps = PipelineSearch(graph, Cluster(2, 2), profile, 0.03 * 2**30, PipelineConfig(stages=2))
    m, sub = 8, Cluster(1, 2)
    span = stage_spans(ps.graph_for(m), [2, 2])[0]
    for f in (5, 2, 8, 3, 6, 1, 4, 7):
        sp = ps.stages.plan(m, span, sub, f)
        assert sp.problem.inflight == f
        rung = ps.stages.rung(m, span, sub, f)
        assert rung.first <= f and (f <= rung.last or not rung.plan.problem.fits)
        own = figures(ps.stages.problem(m, span, sub, f, rung.plan.problem.mode), rung.plan.assign)
        assert _stage_cost(sp) <= _stage_cost(replace(sp, fig=own))
        if rung.plan.problem.fits:
            assert sp.fig.fits
            if math.isfinite(rung.last):
                assert not sp.problem.in_flight(int(rung.last) + 1).fits_plan(rung.plan.assign)
    rungs = ps.stages._rungs[next(iter(ps.stages._rungs))]
    assert 1 in rungs and len(rungs) >= 3 and rungs[1].last < 5 and 5 in rungs  # 5 was beyond the first's reach


def test_a_plan_searched_under_more_in_flight_serves_fewer(graph, profile):
    """A plan that fits under k in flight fits under fewer: each count's plan is the cheapest of every rung's
    that reaches it, the rungs searched under more in flight included (here the search under one in flight
    stands for a weak one: the least-memory plan, which reaches every count), whichever count was asked first."""
    ps = PipelineSearch(graph, Cluster(2, 2), profile, 0.03 * 2**30, PipelineConfig(stages=2))
    m, sub = 8, Cluster(1, 2)
    span = stage_spans(ps.graph_for(m), [2, 2])[0]
    ps.stages.plan(m, span, sub, 8)
    rungs = ps.stages._rungs_of(m, span, sub)
    one = ps.stages.problem(m, span, sub, 1)
    weak = one.min_memory_assignment()
    rungs[1] = Rung(1, one.max_inflight(weak), StagePlan(one, weak, figures(one, weak), {}))
    ps.stages._plans.clear()
    assert len(rungs) >= 2
    for f in (1, 8, 4, 2, 7, 3, 5, 6):
        sp = ps.stages.plan(m, span, sub, f)
        priced = [replace(sp, fig=figures(ps.stages.problem(m, span, sub, f, r.plan.problem.mode), r.plan.assign))
                  for r in rungs.values() if f <= r.last]
        assert sp.fig.fits and _stage_cost(sp) == min(_stage_cost(x) for x in priced)
        if f <= rungs[1].last:  # the weak plan reaches f, and a cheaper one serves it
            assert _stage_cost(sp) < _stage_cost(replace(sp, fig=figures(one.in_flight(f), weak)))
    assert ps.stages.plan(m, span, sub, 1).search["inflight_reused"] > 1


def test_units_are_the_tile_intersections():
    """The unit tasks are each destination tile's intersections with every source tile, in that order."""
    from autotune.pipeline.boundary import SENDERS, units
    from kernels.reshard.spec import intersect
    cl = Cluster(4, 4)
    shape = (64, 48)
    for sf, df in [(("S0", "S1", "B", "S0"), ("S1", "B", "S0", "S0")), (("B", "B", "B", "B"), ("S0", "S1", "S0", "B")),
                   (("S1", "S1", "S0", "B"), ("S0", "S0", "S1", "S1"))]:
        src = tiles(shape, sf, cl, tuple(range(16)))
        dst = tiles(shape, df, cl, tuple(range(16, 32)))
        got = units(shape, 2, src, dst)
        sg, dg = {}, {}
        for d, b in src.items():
            sg.setdefault(b, []).append(d)
        for d, b in dst.items():
            dg.setdefault(b, []).append(d)
        want = [(p, tuple(r)) for db, r in dg.items() for sb in sg for p in (intersect(sb, db),) if p is not None]
        assert [(u.box, u.receivers) for u in got] == want
        assert [u.index for u in got] == list(range(len(want)))
        assert all(u.nbytes == box_volume(u.box) * 2 and 1 <= len(u.senders) <= SENDERS for u in got)
        assert sum(u.nbytes for u in got) == sum(box_volume(b) * 2 for b in dg)  # the source tiles partition it


@pytest.mark.parametrize("mode", [("full", None), ("none", (0, 1)), ("full", (0, 1)), ("full", (1,))])
def test_figures_under_modes_are_the_problem_cost(graph, profile, mode):
    """Under recomputation and FSDP, m (forward + backward) + optimizer + exposed sync is the stage problem's
    step cost, for several plans; full recomputation makes the backward dearer, not the forward."""
    from autotune.sbp.memory import Mode
    g = with_micro_batches(graph, 4)
    cl = Cluster(1, 4)
    for span in stage_spans(g, [2, 2]):
        plain = StageProblem(stage_graph(g, *span), Coster(profile, cl), None)
        pr = StageProblem(stage_graph(g, *span), Coster(profile, cl), None, mode=Mode(*mode))
        rng = np.random.default_rng(0)
        for a in [pr.min_memory_assignment()] + [[int(rng.integers(n)) for n in pr.sizes] for _ in range(5)]:
            f = figures(pr, a)
            if not math.isfinite(f.forward + f.backward):
                continue
            assert pr.mb * (f.forward + f.backward) + f.optimizer + f.exposed_sync == pytest.approx(pr.raw_cost(a))
            if mode == ("full", None):
                p = figures(plain, a)
                assert f.forward == pytest.approx(p.forward) and f.backward > p.backward
                assert pr.memory_of(a) < plain.memory_of(a)


def test_a_stage_that_fits_only_with_a_mode_gets_its_plan(graph, profile):
    """A memory limit under which no plain plan of a stage fits but a recomputed or sharded one does: the stage
    plan is searched under those modes and fits; in-flight counts it serves take the same mode."""
    from autotune.sbp.memory import Mode
    ps0 = PipelineSearch(graph, Cluster(2, 2), profile, None, PipelineConfig(stages=2))
    m, sub = 4, Cluster(1, 2)
    span = stage_spans(ps0.graph_for(m), [2, 2])[0]
    pr = ps0.stages.problem(m, span, sub, 2)
    plain, full = pr.min_memory, ps0.stages.problem(m, span, sub, 2, Mode("full", (0,))).min_memory
    assert full < plain
    limit = (full + plain) / 2 + pr.schedule_bytes(pr.min_memory_assignment())  # the schedule's buffers besides
    ps = PipelineSearch(graph, Cluster(2, 2), profile, limit, PipelineConfig(stages=2))
    sp = ps.stages.plan(m, span, sub, 2)
    assert not ps.stages.problem(m, span, sub, 2).fits
    assert sp.fig.fits and sp.problem.mode != Mode() and sp.problem.peak_memory(sp.assign) <= limit
    assert sp.search["recompute"] == sp.problem.mode.recompute
    one = ps.stages.plan(m, span, sub, 1)
    assert one.fig.fits


def test_pipelined_plan_fits_at_every_stage_peak(graph, profile):
    """Under a limit the per-layer sums alone would pass but the workspace would not, every stage of the
    plan returned fits the device at its peak, workspace included."""
    loose = PipelineSearch(graph, Cluster(2, 2), profile, None, PipelineConfig(stages=2)).run()
    peak = max(sp.problem.peak_memory(sp.assign) for sp in loose.plans)
    limit = 0.8 * peak
    best = PipelineSearch(graph, Cluster(2, 2), profile, limit, PipelineConfig(stages=2)).run()
    assert best is not None
    for sp in best.plans:
        assert sp.fig.fits and sp.problem.peak_memory(sp.assign) <= limit
        assert sp.fig.memory == pytest.approx(sp.problem.peak_memory(sp.assign))


def test_a_squeezed_plain_plan_loses_to_a_mode(graph, profile):
    """A limit under which a plain plan fits but only squeezed: the stage's plan is the cheaper plan of a
    recomputation mode, not the plain plan that fits."""
    from autotune.sbp.memory import Mode
    ps0 = PipelineSearch(graph, Cluster(2, 2), profile, None, PipelineConfig(stages=2))
    m, sub = 4, Cluster(1, 2)
    span = stage_spans(ps0.graph_for(m), [2, 2])[0]
    pr = ps0.stages.problem(m, span, sub, 2)
    limit = 1.07 * pr.min_memory + pr.schedule_bytes(pr.min_memory_assignment())  # the schedule's buffers besides
    ps = PipelineSearch(graph, Cluster(2, 2), profile, limit, PipelineConfig(stages=2))
    plain = ps.stages.problem(m, span, sub, 2)
    a, cost, _ = ps.stages._search(plain)
    assert plain.fits_plan(a)
    sp = ps.stages.plan(m, span, sub, 2)
    assert sp.problem.mode != Mode() and sp.fig.fits
    assert sp.problem.cost(sp.assign) < cost * 0.95


def test_a_mode_dearer_under_fewer_in_flight_is_not_searched_again(graph, profile):
    """FSDP's plan under 1 in flight costs more than the plain plan found under 2 (a roomy limit), while its
    lower bound under 2 does not: the cost found under fewer in flight is what keeps it from being searched under
    2 (a tighter limit cannot make it cheaper), and an FSDP search there finds nothing cheaper than the plan
    kept."""
    from autotune.pipeline.search import _lower_bound
    from autotune.sbp.memory import Mode
    # fp32: no autocast casts, which a pipeline's plain stage makes once a step, making it the cheaper under 1 in
    # flight too (``StageProblem.one_cast``)
    graph = load_model("gpt", "gpt3-1.3b", dict(PIPELINE_GPT, act_bytes=4))
    ps0 = PipelineSearch(graph, Cluster(2, 2), profile, None, PipelineConfig(stages=2))
    m, sub, fsdp = 4, Cluster(1, 2), Mode("none", (0,))
    span = stage_spans(ps0.graph_for(m), [2, 2])[0]
    ps = PipelineSearch(graph, Cluster(2, 2), profile, 1.8 * ps0.stages.problem(m, span, sub, 2).min_memory,
                        PipelineConfig(stages=2))
    st, seen = ps.stages, []
    search = st._search
    st._search = lambda pr, share=1.0, start=None, others=(): (seen.append((pr.inflight, pr.mode)),
                                                               search(pr, share, start, others))[1]
    st._search_modes(m, span, sub, 1)
    assert (1, fsdp) in seen
    pr, a, _ = st._search_modes(m, span, sub, 2)
    fsdp_one = min(c for k, c in st._costs[next(iter(st._costs))][fsdp] if k == 1)
    sharded = st.problem(m, span, sub, 2, fsdp)
    assert pr.mode == Mode() and _lower_bound(sharded) < pr.cost(a) <= fsdp_one and sharded.fits
    assert (2, fsdp) not in seen
    b, cost, _ = search(sharded)
    assert not sharded.fits_plan(b) or cost >= pr.cost(a)


def test_the_modes_lower_bound_is_made_once_for_every_inflight_count(graph, profile):
    """``_lower_bound`` leaves the memory out: each in-flight copy's is the bound a fresh problem gives, and the
    copies share one computation, but in FSDP mode, where the in-flight count sets the gathers a step (here the
    bound's plan gathers: the bounds of 1, 3 and 8 in flight differ, and one made for 1 would be wrong for 3)."""
    from autotune.pipeline.search import _lower_bound
    from autotune.sbp.fit import lower_bound
    from autotune.sbp.memory import Mode
    ps = PipelineSearch(graph, Cluster(2, 2), profile, 0.03 * 2**30, PipelineConfig(stages=2))
    m, sub = 8, Cluster(1, 2)
    span = stage_spans(ps.graph_for(m), [2, 2])[0]
    for mode, per_count in ((Mode(), False), (Mode("full", (0,)), True)):
        one = ps.stages.problem(m, span, sub, 1, mode)
        first, bounds = _lower_bound(one), set()
        for f in (1, 3, 8):
            pr = ps.stages.problem(m, span, sub, f, mode)
            fresh = StageProblem(pr.graph, pr.coster, pr.device_limit, inflight=f).with_mode(mode)
            assert _lower_bound(pr) == pytest.approx(lower_bound(fresh), rel=1e-12)
            assert _lower_bound(one.in_flight(f)) is _lower_bound(pr)
            bounds.add(_lower_bound(pr))
        assert len(bounds) == (3 if per_count else 1) and first in bounds
    assert _lower_bound(ps.stages.problem(m, span, sub, 2, Mode("full", (0,)))) != \
        _lower_bound(ps.stages.problem(m, span, sub, 2))


def test_a_rung_searched_for_one_slice_leaves_the_other_slices_bounds(graph, profile):
    """``StageSearch.bound``'s cache is dropped per slice: a search for one slice keeps the other's bounds,
    and both slices' bounds are those of a search that met the slices in the other order."""
    def search():
        return PipelineSearch(graph, Cluster(2, 2), profile, 0.04 * 2**30, PipelineConfig(stages=2))
    m, sub, counts = 8, Cluster(1, 2), range(1, 9)
    ps, fresh = search(), search()
    a, b = stage_spans(ps.graph_for(m), [2, 2])
    first_b = [ps.stages.bound(m, b, sub, f) for f in counts]
    rungs = len(ps.stages._rungs_of(m, a, sub))
    ps.stages.plan(m, a, sub, 8)
    assert len(ps.stages._rungs_of(m, a, sub)) > rungs  # a was searched ...
    assert set(ps.stages._bounds[(ps.stages.signature(m, b), sub, m)]) == set(counts)  # ... b's bounds kept
    fresh.stages.plan(m, a, sub, 8)
    assert [ps.stages.bound(m, x, sub, f) for x in (a, b) for f in counts] == \
        [fresh.stages.bound(m, x, sub, f) for x in (a, b) for f in counts]
    assert first_b == [fresh.stages.bound(m, b, sub, f) for f in counts]


def test_pair_moves_of_an_inflight_copy_mask_by_its_own_memory(graph, profile):
    """``Problem.pair_local`` keeps each problem's pair memory (``_pair_memory``): a copy under more micro-batches
    in flight, made after the first problem's pair moves, masks the pairs its own memory puts over the limit."""
    ps = PipelineSearch(graph, Cluster(2, 2), profile, 0.03 * 2**30, PipelineConfig(stages=2))
    m, sub = 8, Cluster(1, 2)
    span = stage_spans(ps.graph_for(m), [2, 2])[0]
    one = ps.stages.problem(m, span, sub, 1)
    a = one.min_memory_assignment()
    masked = []
    for pr in (one, one.in_flight(6), one.in_flight(6).in_flight(2)):
        for u, v in pr.pairs:
            rest = pr.memory_of(a) - pr.mem[u][a[u]] - pr.mem[v][a[v]]
            over = np.add.outer(pr.mem[u], pr.mem[v]) > pr.memory_limit - rest
            got = pr.pair_local(a, u, v)
            assert np.array_equal(np.isinf(got) & over, over)
            assert np.isfinite(got[~over]).all()
            masked.append(int(over.sum()))
    n = len(one.pairs)
    assert sum(masked[n:2 * n]) > sum(masked[:n])  # six in flight: more pairs over the limit


def test_the_relaxations_programs_without_memory_are_shared_by_the_inflight_copies(graph, profile):
    """``relax``'s programs without the memory term are solved once for a stage problem's in-flight copies: each
    copy's relaxation (plans, bound, plans over the limit) is a fresh problem's, with fewer programs solved (as
    many in FSDP mode, whose costs the in-flight count moves)."""
    from autotune.sbp.dp import LayerDP, relax
    from autotune.sbp.memory import Mode
    calls = []
    solve = LayerDP.solve

    def counted(self, unary):
        calls.append(1)
        return solve(self, unary)
    ps = PipelineSearch(graph, Cluster(2, 2), profile, 0.03 * 2**30, PipelineConfig(stages=2))
    m, sub = 8, Cluster(1, 2)
    span = stage_spans(ps.graph_for(m), [2, 2])[0]
    LayerDP.solve = counted
    try:
        for mode in (Mode(), Mode("full", (0,))):
            for f in (1, 3, 8):
                pr = ps.stages.problem(m, span, sub, f, mode)
                fresh = StageProblem(pr.graph, pr.coster, pr.device_limit, inflight=f).with_mode(mode)
                calls.clear()
                got = relax(pr)
                shared = len(calls)
                calls.clear()
                want = relax(fresh)
                assert (got.plans, got.over, got.bound, got.exact) == (want.plans, want.over, want.bound, want.exact)
                assert [list(u) for u in got.unary] == [list(u) for u in want.unary]
                # FSDP mode's costs move with the in-flight count (its gathers a step): nothing to share there
                assert shared < len(calls) if f > 1 and mode.fsdp_axes is None else shared == len(calls)
    finally:
        LayerDP.solve = solve


def test_the_collector_runs_less_often_during_a_search_and_as_before_after(graph, profile):
    import gc
    from autotune.pipeline.search import GC_THRESHOLDS, fewer_collections
    before = gc.get_threshold()
    seen = []
    with fewer_collections():
        seen.append(gc.get_threshold())
        with fewer_collections():
            seen.append(gc.get_threshold())
        seen.append(gc.get_threshold())
    assert seen == [GC_THRESHOLDS] * 3 and gc.get_threshold() == before != GC_THRESHOLDS
    with pytest.raises(ZeroDivisionError):
        with fewer_collections():
            1 / 0
    assert gc.get_threshold() == before



def test_search_effort_settings_reach_the_stage_searches(graph, profile):
    """``PipelineConfig.patience`` caps each stage search's restarts and ``relax_rounds`` its relaxation's
    bisection steps (fewer search steps at 1 than at the full 8, the patience the same; ``budget_scale`` 1, which
    would scale the patience too); the reference keeps the full effort."""
    m, sub, f = 8, Cluster(1, 2), 3

    def searched(cfg):
        ps = PipelineSearch(graph, Cluster(2, 2), profile, 0.03 * 2**30, cfg)
        prob = ps.stages.problem(m, stage_spans(ps.graph_for(m), [2, 2])[0], sub, f)
        return ps.stages._search(prob)[2]

    full = searched(PipelineConfig(stages=2, patience=None, relax_rounds=8, budget_scale=1.0))
    capped = searched(PipelineConfig(stages=2, patience=1, relax_rounds=8, budget_scale=1.0))
    assert "converged (1 restarts" in capped["stopped"] and "converged (1 restarts" not in full["stopped"]
    rounds = searched(PipelineConfig(stages=2, patience=1, relax_rounds=1, budget_scale=1.0))
    assert rounds["steps"] < capped["steps"]
    ref = PipelineConfig(patience=1, relax_rounds=1).reference()
    assert ref.patience is None and ref.relax_rounds == 8 and ref.split_dps == ref.refine
    full = PipelineConfig(stages=2, patience=1, relax_rounds=1, refine=3).full_effort()
    assert (full.patience, full.relax_rounds, full.split_dps, full.refine, full.stages) == (None, 8, 3, 3, 2)


def test_split_dp_for_the_fastest_balanced_candidates(graph, profile):
    """The ``refine`` best candidates are simulated on their balanced splits; the split DP runs for the
    ``split_dps`` fastest of them, from the fastest on, and the plan is never slower than any balanced one."""
    for dps in (1, 2):
        ps = PipelineSearch(graph, Cluster(2, 2), profile, 80 * 2**30, PipelineConfig(refine=2, split_dps=dps))
        finished, refined = [], []
        finish, refine = ps.finish, ps.refine
        ps.finish = lambda c: finished.append(finish(c)) or finished[-1]
        ps.refine = lambda c, *a: refined.append(c) or refine(c, *a)
        best = ps.run()
        balanced = finished[:2]
        assert len(balanced) == 2 and {c.stages for c in balanced} == {2, 4}
        assert all(c.split == ps.balanced(c.stages) for c in balanced)
        order = sorted(balanced, key=lambda c: c.step)
        assert refined == order[:dps]
        assert best.step <= order[0].step


@pytest.mark.parametrize("mode", [("none", (0, 1)), ("full", (0, 1)), ("full", (1,))])
def test_the_whole_model_without_a_pipeline_is_the_single_stage_plans_fsdp(graph, profile, mode):
    """A stage holding the whole model, not pipelined (``PipelineConfig.single_stage_plain``: "1 stage" as
    AutoDDL's Table 3 means it): its figures, memory and cost are the single-stage ``Problem``'s under FSDP (each
    micro-batch's gradients reduce-scattered), not torch's PipelineStage's, which it is when pipelined."""
    from autotune.sbp.cost import Problem
    from autotune.sbp.memory import Mode
    g = with_micro_batches(graph, 4)
    cl = Cluster(1, 4)
    span = stage_spans(g, [4])[0]
    whole = StageProblem(stage_graph(g, *span), Coster(profile, cl), None, mode=Mode(*mode), pipelined=False)
    piped = StageProblem(stage_graph(g, *span), Coster(profile, cl), None, mode=Mode(*mode))
    single = Problem(stage_graph(g, *span), Coster(profile, cl), None, objective="step", mode=Mode(*mode),
                     require_fit=False)
    rng = np.random.default_rng(0)
    differ = 0
    for a in [whole.min_memory_assignment()] + [[int(rng.integers(n)) for n in whole.sizes] for _ in range(5)]:
        f = figures(whole, a)
        if not math.isfinite(f.forward + f.backward):
            continue
        assert whole.mb * (f.forward + f.backward) + f.optimizer + f.exposed_sync == pytest.approx(single.raw_cost(a))
        assert whole.peak_memory(a) == pytest.approx(single.peak_memory(a))
        differ += piped.raw_cost(a) != pytest.approx(single.raw_cost(a))
    assert differ  # pipelined, the same plans are priced as PipelineStage runs them


@pytest.mark.parametrize("every", [0.0, math.inf])
def test_stage_searches_print_a_line_when_long(graph, profile, monkeypatch, every):
    # the phases between the candidates' own lines (their bounds, the split DP) search stage after stage: a line
    # after each search that ends PROGRESS_EVERY seconds or more after the last one (here: after every one, or never)
    from autotune.pipeline import search as pipeline_search
    monkeypatch.setattr(pipeline_search, "PROGRESS_EVERY", every)
    lines = []
    ps = PipelineSearch(graph, Cluster(2, 2), profile, 80 * 2**30, PipelineConfig(stages=2), progress=lines.append)
    ps.run()
    said = [x for x in lines if "stage searches so far" in x]
    rungs = sum(len(r) for r in ps.stages._rungs.values())
    assert len(said) == (rungs if every == 0 else 0) and (not said or "the last: blocks " in said[0]), said


def test_the_last_stage_keeps_the_default_allocators_room_for_the_losss_logits(graph, profile):
    """With ``loss_room`` (the command's default allocator) the last stage, which holds the loss, is searched under
    the usable memory less the loss's fp32 copy of a device's logits, as the single-stage plans are
    (``planner.headroom_limit``); the other stages and a search without it keep the limit given."""
    from autotune.sbp.memory import largest_block
    usable = profile.device.usable_bytes
    m, sub = 4, Cluster(1, 2)
    ps = PipelineSearch(graph, Cluster(2, 2), profile, usable, PipelineConfig(stages=2, loss_room=True))
    first, last = stage_spans(ps.stages.graph_for(m), [2, 2])
    room = 4 * (16 // m // 2) * 128 * 1024  # fp32 x a device's sequences of the micro-batch x sequence x vocabulary
    assert largest_block(ps.stages.graph_for(m), 2) == room
    assert ps.stages.stage_limit(m, last, sub) == ps.stages.problem(m, last, sub, 1).memory_limit == usable - room
    assert ps.stages.stage_limit(m, first, sub) == ps.stages.problem(m, first, sub, 1).memory_limit == usable
    plain = PipelineSearch(graph, Cluster(2, 2), profile, usable, PipelineConfig(stages=2))
    assert plain.stages.stage_limit(m, last, sub) == usable
    assert PipelineSearch(graph, Cluster(2, 2), profile, None, PipelineConfig(stages=2, loss_room=True)).stages \
        .stage_limit(m, last, sub) is None
