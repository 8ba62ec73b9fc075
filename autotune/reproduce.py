"""AutoDDL's evaluation (§4.6, §5) beside ours; the command is ``python -m autotune
reproduce autoddl`` (``autotune/cli/reproduce.py``).

Every case of ``autotune/sbp/presets/autoddl.json`` (the paper's model, batch,
cluster, memory, profile and baselines) is searched under the communication
objective (the paper's) and compared with the paper's figure: the winner and
the communication saved against the best baseline that fits. A case passes when
the winner is the paper's and the reduction is within 10 percentage points.
The command writes ``reproduce.json`` (a versioned record, kind ``RECORD``) and
prints the table; the report section is ``reports.sections.sbp_reproduce``.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from calibrate.errors import UserError
from calibrate.profile import Profile
from calibrate.records import check_header
from models import load_model

from autotune.pipeline.search import PipelineConfig, PipelineSearch
from autotune.pipeline.threed import seeded
from autotune.sbp.baselines import _Index, best_mesh, data_parallel, megatron_assignment, summa_assignment
from autotune.sbp.fit import describe, search_fitting
from autotune.sbp.memory import NONE, recipe_of, tied_saving
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster, RoleMesh
from autotune.sbp.search import Budget, auto_budget, make_search

RECORD = "commtune.autoddl-reproduction"
VERSION = 3  # 2: config, per case p0 cap, sensitivity and without_p0_cap; 3: p0 cap "memory", p0_caps per case
TOLERANCE_PP = 10.0
GI = 2**30


def load_cases() -> list[dict]:
    d = json.loads(resources.files("autotune.sbp.presets").joinpath("autoddl.json").read_text())
    return d["cases"]


@dataclass(frozen=True)
class Config:
    """One configuration for the whole table (no per-case switches).

    ``p0_cap``: on the transformer cases, the most devices a matmul's or the embedding's weight is replicated
    over (the paper's p0, §4.5.2), for the search and Megatron alike (data parallelism is full replication by
    definition and SUMMA replicates no weight): "memory" (per case, ``p0_threshold``: the largest at which the
    parameters and optimizer states fit), a number, or None (no cap).
    ``micro_batches``: for a case whose micro-batch is "largest-fitting", how many power-of-two micro-batches
    the search tries, from the largest at which some plan fits downwards (None: every one, down to 1); every
    baseline (mesh, micro-batch and, for VGG's Megatron, layer order) and the search take their best over
    them, the baselines further down while one of them has no plan that fits. ``alpha_scale`` and
    ``beta_scale`` multiply the profile's alpha and beta (the Piz Daint and GCP profiles are assumed)."""
    p0_cap: int | str | None = "memory"
    micro_batches: int | None = None
    alpha_scale: float = 1.0
    beta_scale: float = 1.0


REPLICATED = ("matmul", "embedding")  # the layers whose weight replication the p0 cap bounds
PAPER_SIGNATURES = ("autoddl",)  # the paper's one SBP matmul order, I (S0, B, S1) W (B, S1, S0) O (S0, S1, P) (§4.2.2)
ALTERNATIVE_P0_CAPS = (4, None)  # every transformer case is reported under these too (4: the Fig. 3 plan's p0)
SENSITIVITY = ((0.5, 1.0), (2.0, 1.0), (1.0, 0.5), (1.0, 2.0))  # (alpha, beta) scales of the sensitivity


def scaled_profile(profile: Profile, alpha: float, beta: float) -> Profile:
    """A copy of ``profile`` with every segment's alpha and beta multiplied."""
    out = copy.deepcopy(profile)
    for colls in out.tiers.values():
        for models in colls.values():
            for m in models.values():
                m.segments = [dataclasses.replace(sg, alpha=sg.alpha * alpha, beta=sg.beta * beta)
                              for sg in m.segments]
    return out


def replication(s) -> int:
    """Devices over which a strategy's weight is replicated (B), the largest over its weights."""
    return max((math.prod(s.mesh.role_size(r) for r, p in enumerate(w.sbp) if p == "B") for w in s.weights),
               default=1)


def _limit(case: dict, profile: Profile) -> float | None:
    """Bytes a device may hold: the case's memory, at most the profile's usable capacity where it knows its GPU."""
    if not case.get("memory_gib"):
        return None
    return min(case["memory_gib"] * GI, profile.memory_bytes or math.inf)


def p0_threshold(case: dict) -> int | None:
    """The largest power-of-two p0 at which the model's parameters, gradients and optimizer states (the
    paper's recipe's bytes a parameter), replicated p0 times and split over the other devices, fit the usable
    memory: §4.5.2 bounds p0 because "the main bottleneck for memory was the model parameters and its
    optimizer states". None where the case has no memory limit."""
    limit = _limit(case, Profile.load(case["profile"]))
    if limit is None:
        return None
    g = load_model(case["model"], case["preset"], dict(case.get("overrides", {})))
    state = g.parameters() * recipe_of("autoddl", g.act_bytes).parameter_bytes
    devices = case["nodes"] * case["gpus"]
    p0 = 1 << (devices.bit_length() - 1)
    while p0 > 1 and state * p0 / devices > limit:
        p0 //= 2
    return p0


def _capped(case: dict, cap: int | str | None) -> int | None:
    """The p0 cap of ``Config.p0_cap`` on a case: none but on the transformer cases; "memory" resolved."""
    if case["model"] != "gpt" or cap is None:
        return None
    return p0_threshold(case) if cap == "memory" else cap


def _problem(case: dict, overrides: dict, config: Config, signatures=None, cap: int | None = None) -> Problem:
    g = load_model(case["model"], case["preset"], overrides)
    profile = Profile.load(case["profile"])
    if (config.alpha_scale, config.beta_scale) != (1.0, 1.0):
        profile = scaled_profile(profile, config.alpha_scale, config.beta_scale)
    limit = _limit(case, profile)
    keep = None if cap is None else (lambda layer, s: layer.kind not in REPLICATED or replication(s) <= cap)
    coster = Coster(profile, Cluster(case["nodes"], case["gpus"]))
    return Problem(g, coster, limit, signatures=signatures, require_fit=False, objective="comm", recipe="autoddl",
                   keep=keep)


def fits_at_peak(pr: Problem, assign: list[int]) -> bool:
    """Whether a plan fits the usable memory at its peak, the workspace included (``Problem.peak_memory``;
    the "autoddl" recipe's own check, ``Problem.fits_plan``, is the per-layer sum): the check of every plan
    the reproduction compares."""
    return pr.device_limit is None or pr.peak_memory(assign) <= pr.device_limit


def _megatron_make(case: dict, cap: int | None, row_first: bool):
    """Megatron on (d, t): tensor parallelism within a node on several GPUs a node (the paper's tuning, §5,
    after [31]); d at most ``cap`` devices."""
    def make(pr: Problem, d, t):
        if cap is not None and math.prod(d) > cap:
            return None
        if case["gpus"] > 1 and t[0] != 1:
            return None
        return megatron_assignment(pr, d, t, row_first)
    return make


def megatron(case: dict, pr: Problem, cap: int | None):
    """The best Megatron plan over meshes and, where the model has matmuls after convolutions, both layer
    orders (column-first and row-first): (plan, cost, detail)."""
    orders = (False, True) if case["model"].startswith("vgg") else (False,)
    best = (None, math.inf, "")
    for row_first in orders:
        a, cost, mesh = best_mesh(pr, _megatron_make(case, cap, row_first), lambda a: fits_at_peak(pr, a))
        if a is not None and (best[0] is None or cost < best[1]):
            best = (a, cost, (f"d={mesh[0]}, t={mesh[1]}" + (", row-first" if row_first else "")) if mesh else "")
    return best


def baselines(case: dict, pr: Problem, overrides: dict, config: Config, cap: int | None = None) -> dict:
    """name -> (communication s/step, peak memory bytes, detail, problem, plan); inf communication where
    nothing fits. "SUMMA" gives two: "SUMMA" (every gathered panel kept for the backward pass) and "SUMMA
    lean" (local blocks only, the panels broadcast again in the backward pass)."""
    out = {}
    for name in case["baselines"]:
        if name == "data parallel":
            a, detail, prob = data_parallel(pr), "d = all devices", pr
        elif name == "Megatron":
            a, _, detail = megatron(case, pr, cap)
            prob = pr
        elif name == "SUMMA":  # both SUMMAs: every gathered panel kept, and lean (broadcast again in backward)
            for label, sig in (("SUMMA", "summa"), ("SUMMA lean", "summa-lean")):
                try:
                    prob = _problem(case, overrides, config, (sig,))
                except UserError:
                    continue
                a, _, mesh = best_mesh(prob, lambda p, r, c: summa_assignment(p, r, c, sig),
                                       lambda a: fits_at_peak(prob, a))
                if a is not None:
                    out[label] = (prob.cost(a) if fits_at_peak(prob, a) else math.inf, prob.peak_memory(a),
                                  f"{mesh[0]} x {mesh[1]}", prob, a)
            continue
        else:
            raise UserError(f"unknown baseline {name!r} in the AutoDDL cases")
        if a is None:
            continue
        cost = prob.cost(a) if fits_at_peak(prob, a) else math.inf
        out[name] = (cost, prob.peak_memory(a), detail, prob, a)
    return out


def breakdown(pr: Problem, assign: list[int]) -> dict:
    """Where a plan's communication goes: gradient sync per layer kind, redistribution (boxing) in all."""
    from autotune.plan.build import build
    plan = build(pr, assign, "")
    sync: dict[str, float] = {}
    for layer in plan.layers:
        if layer.costs["grad_sync_s"]:
            sync[layer.kind] = sync.get(layer.kind, 0.0) + layer.costs["grad_sync_s"] * layer.count
    out = {"grad_sync_s_by_kind": sync, "redistribution_s": plan.costs.redistribution_s, "total_s": plan.costs.total_s}
    tied = [v for v, t in enumerate(pr.tied) if t]
    if tied and pr.embedding is not None:  # the logits' weight is the embedding's: synced with it where placed alike
        e = pr.choices[pr.embedding][assign[pr.embedding]]
        out["tied_logits"] = {
            "grad_sync_s": sum(float(pr.node_sync[v][assign[v]]) * pr.counts[v] for v in tied) - pr.tied_saved(assign),
            "synced_with_embedding_s": pr.tied_saved(assign),
            "placed_as_embedding": all(tied_saving(pr.choices[v][assign[v]], e, pr.cluster, pr.act_bytes,
                                                   pr.mode).parameters > 0 for v in tied)}
    return out


def micro_batch_overrides(case: dict, config: Config):
    """(overrides, search here) of each micro-batch tried: the case's own, or (micro-batch "largest-fitting")
    the power-of-two divisors of the batch from the largest at which some plan fits downwards: the search at
    the first ``config.micro_batches`` of them (every one where None), the baselines at those and further down
    while some baseline has no plan that fits (the value sent in says so), to micro-batch 1."""
    over = dict(case.get("overrides", {}))
    if case.get("micro_batch") != "largest-fitting":
        yield over, True
        return
    batch = load_model(case["model"], case["preset"], over).batch
    tried, mb = 0, batch
    while mb >= 1:
        if batch % mb == 0:
            o = dict(over, micro_batch=mb)
            try:
                fits = _problem(case, o, config).fits
            except UserError:
                fits = False
            if fits:
                tried += 1
                window = config.micro_batches
                more = yield o, window is None or tried <= window
                if window is not None and tried >= window and not more:
                    return
        mb //= 2
    if not tried:
        raise UserError(f"case {case['id']}: no micro-batch has a plan that fits; check the case's memory_gib")


def compare(case: dict, config: Config, cap: int | None) -> dict:
    """Every baseline and the search, each at its best micro-batch; the reduction and the verdict."""
    base: dict[str, tuple] = {}
    searched = None
    gen = micro_batch_overrides(case, config)
    step, needed = next(gen), True
    while True:
        o, search_here = step
        pr = _problem(case, o, config)
        for name, v in baselines(case, pr, o, config, cap).items():
            if name not in base or v[0] < base[name][0] or not math.isfinite(base[name][0]) and v[1] < base[name][1]:
                base[name] = v + (pr.graph.micro_batch,)
        named = {k.split()[0] for k in base}
        needed = any(not math.isfinite(v[0]) for v in base.values()) or any(
            b.split()[0] not in named for b in case["baselines"])
        spr = _problem(case, o, config, cap=cap) if cap is not None else pr
        if search_here and spr.fits:
            warm, warm_cost, _ = megatron(case, spr, cap)
            rng = np.random.default_rng(0)
            res = search_fitting(spr, lambda p, start: make_search("cd").run(p, auto_budget(p), rng, start),
                                 warm if warm is not None and math.isfinite(warm_cost) else None)
            if res is not None and fits_at_peak(spr, res.assignment) and (searched is None or res.cost < searched[0]):
                searched = (res.cost, spr, res.assignment, res.stopped)
        try:
            step = gen.send(needed)
        except StopIteration:
            break
    fit = {k: v for k, v in base.items() if math.isfinite(v[0])}
    cost = searched[0] if searched else math.inf
    v = verdict(case, cost, {k: x[0] for k, x in fit.items()})
    return {"p0_cap": cap, "micro_batch": searched[1].graph.micro_batch if searched else None,
            "searched_s": cost if searched else None,
            "searched_memory_gib": searched[1].peak_memory(searched[2]) / GI if searched else None,
            "memory_limit_gib": searched[1].device_limit / GI if searched and searched[1].device_limit else None,
            "baselines": {k: {"comm_s": x[0] if math.isfinite(x[0]) else None, "memory_gib": x[1] / GI,
                              "mesh": x[2], "micro_batch": x[5]} for k, x in base.items()},
            **v, "search_stopped": searched[3] if searched else None, "_plans": (searched, fit)}


def verdict(case: dict, searched_s: float, fit: dict[str, float]) -> dict:
    """The comparison of a searched plan's communication with the baselines' that fit (name -> s/step): the
    reduction against the baseline the paper compares with (its second best) where it fits here, else the
    best; the winner (AutoDDL where it saves more than 1% against the best) and the status."""
    paper = case["paper"]
    best_name = min(fit, key=fit.get) if fit else None
    named = [k for k in fit if k.split()[0] in paper.get("second", "")]
    ref_name = min(named, key=fit.get) if named else best_name
    found = math.isfinite(searched_s)
    reduction = (1 - searched_s / fit[ref_name]) * 100 if ref_name and found else None
    best_red = (1 - searched_s / fit[best_name]) * 100 if best_name and found else None
    winner = "AutoDDL" if best_red is not None and best_red > 1.0 else best_name or "AutoDDL"
    ok = winner == paper["winner"] and reduction is not None and abs(reduction - paper["reduction_pct"]) <= TOLERANCE_PP
    return {"best_baseline": best_name, "winner": winner, "reduction_pct": reduction, "compared_with": ref_name,
            "reduction_vs_best_pct": best_red,
            "difference_pp": None if reduction is None else reduction - paper["reduction_pct"],
            "status": "pass" if ok else "fail"}


def _repriced(pr: Problem, profile: Profile) -> Problem:
    """``pr`` with its costs under another profile: the same strategies (and so the same plan indices)."""
    out = copy.copy(pr)
    out.coster = Coster(profile, pr.cluster)
    out._shared, out.tables, out.derived, out.reserve = {}, None, {}, 0.0
    out._price(pr.mode)
    return out


def alpha_beta_parts(pr: Problem, assign: list[int]) -> tuple[float, float]:
    """A plan's communication split into its alpha part and its beta part (the plan costs a x alpha part +
    b x beta part with every alpha scaled by a and every beta by b): the beta part is its cost with every
    alpha zero, the alpha part the rest."""
    beta = _repriced(pr, scaled_profile(pr.coster.profile, 0.0, 1.0)).raw_cost(assign)
    return pr.raw_cost(assign) - beta, beta


def sensitivity(case: dict, searched, fit: dict) -> list[dict]:
    """The verdict at each (alpha, beta) scaling of ``SENSITIVITY``, every plan (the searched one and each
    baseline's best) held fixed and re-costed (exact for those plans: the cost is linear in alpha and beta;
    a re-search or re-tuning at the scaled profile could only lower either side)."""
    if searched is None:
        return []
    ours = alpha_beta_parts(searched[1], searched[2])
    theirs = {k: alpha_beta_parts(x[3], x[4]) for k, x in fit.items()}
    out = []
    for a, b in SENSITIVITY:
        v = verdict(case, a * ours[0] + b * ours[1], {k: a * x[0] + b * x[1] for k, x in theirs.items()})
        out.append({"alpha_scale": a, "beta_scale": b, "reduction_pct": v["reduction_pct"], "winner": v["winner"],
                    "compared_with": v["compared_with"], "status": v["status"]})
    return out


def run_case(case: dict, config: Config = Config(), with_sensitivity: bool = True) -> dict:
    """One case under ``config``: its row; transformer cases also under each cap of ``ALTERNATIVE_P0_CAPS``
    (``p0_caps``, keyed "4" and "none"); with ``with_sensitivity``, the reduction and verdict at each (alpha,
    beta) scaling of ``SENSITIVITY`` (``sensitivity``)."""
    kind = case.get("kind", "reduction")
    row = {"id": case["id"], "section": case["section"], "kind": kind, "paper": case["paper"]}
    if kind == "not-modelled":
        return dict(row, status="not modelled", reason=case["reason"])
    t0 = time.process_time()
    if kind == "search":
        return dict(row, **_search_case(case), cpu_s=time.process_time() - t0)
    if kind == "pipeline":
        return dict(row, **_pipeline_case(case, config), cpu_s=time.process_time() - t0)
    cap = _capped(case, config.p0_cap)
    if kind == "attention-volume":
        row = dict(row, **_attention_case(case, config, cap))
        if "papers_plan" in row:  # the search in the paper's setup: the drawn plan's p0, the paper's one matmul order
            setup = _attention_case(case, config, row["papers_plan"]["p0"], PAPER_SIGNATURES)
            alike = setup.get("papers_plan", {}).get("searched_alike", [])
            row["papers_setup"] = dict({k: setup.get(k) for k in ("p0_cap", "reduction_pct", "window_reduction_pct",
                                                                  "searched_comm_s", "status")},
                                       signatures=PAPER_SIGNATURES, searched_alike=alike)
            row["detail"] += f"; in the paper's setup (p0 <= {setup['p0_cap']}, its one matmul order) the search: " + (
                setup["detail"] if setup["reduction_pct"] is None else
                f"window {setup['window_reduction_pct']:.1f}% less, whole block {setup['reduction_pct']:.1f}% less, "
                f"{setup['searched_comm_s']:.4g} s, {', '.join(alike) or 'no drawn layer'} placed as drawn")
        return dict(row, **_other_caps(case, row, lambda c: _attention_case(case, config, c)),
                    cpu_s=time.process_time() - t0)
    res = compare(case, config, cap)
    searched, fit = res.pop("_plans")
    explain = {}
    if searched:
        explain["searched"] = breakdown(searched[1], searched[2])
    if res["best_baseline"]:
        explain[res["best_baseline"]] = breakdown(*fit[res["best_baseline"]][3:5])
    paper = case["paper"]
    if res["searched_s"] and paper.get("reduction_pct") is not None and paper["reduction_pct"] < 100:
        explain["baseline_s_for_papers_reduction"] = res["searched_s"] / (1 - paper["reduction_pct"] / 100)
    row = dict(row, **res, explain=explain)
    if with_sensitivity:
        row["sensitivity"] = sensitivity(case, searched, fit)
        row["flips"] = any(x["status"] != row["status"] for x in row["sensitivity"])

    def other(c):
        alt = compare(case, config, c)
        alt.pop("_plans")
        return alt
    return dict(row, **_other_caps(case, row, other), cpu_s=time.process_time() - t0)


def _other_caps(case: dict, row: dict, run) -> dict:
    """{"p0_caps": {"4": ..., "none": ...}} on a transformer case: the verdict under each cap of
    ``ALTERNATIVE_P0_CAPS`` (``run(cap)`` -> a row; the case's own where the cap is the same); {} elsewhere."""
    if case["model"] != "gpt":
        return {}
    out = {}
    for alt in ALTERNATIVE_P0_CAPS:
        same = alt == row["p0_cap"] or alt is None and row["p0_cap"] >= case["nodes"] * case["gpus"]
        r = row if same else run(alt)
        out["none" if alt is None else str(alt)] = {k: r.get(k) for k in (
            "p0_cap", "reduction_pct", "winner", "compared_with", "status", "micro_batch", "searched_s",
            "difference_pp")}
    return {"p0_caps": out}


def papers_plan(case: dict, pr: Problem, others: list[int]) -> list[int] | None:
    """The paper's own plan where the case gives it (``paper_plan``: per layer name its signature and role
    mesh, nodes per role on one GPU a node), every other layer as in ``others``; None where a layer has no such
    strategy here."""
    idx, out = _Index(pr), list(others)
    layers = case["paper_plan"]["layers"]
    for v, op in enumerate(pr.ops):
        if op.layer.name in layers:
            sig, sizes = layers[op.layer.name]
            out[v] = idx.get(v, (sig, RoleMesh(tuple((n, 1) for n in sizes))))
            if out[v] is None:
                return None
    return out


def _attention_case(case: dict, config: Config, cap: int | None, signatures=None) -> dict:
    """Fig. 3's measure, activation elements sent per device, searched plan against the best Megatron, scored
    on the whole transformer block (ln1 to the next ln1: the search minimises the whole step, and part of its
    traffic sits on the fc2 -> ln1 edge, outside the paper's ln1 -> ln2 window); the window's figure beside,
    and both for the paper's own plan (``papers_plan``) with each plan's communication seconds (the search's
    objective): where the searched plan moves less than the paper's, whether it also costs less. ``signatures``:
    the matmul signatures searched (default all)."""
    from autotune.sbp.volume import ATTENTION, BLOCK, attention_volume
    pr = _problem(case, dict(case.get("overrides", {})), config, signatures, cap=cap)
    pr.require_fit()
    mega, _, mesh = megatron(case, pr, cap)
    rng = np.random.default_rng(0)
    res = search_fitting(pr, lambda p, start: make_search("cd").run(p, auto_budget(p), rng, start), mega)
    peak = pr.peak_memory(res.assignment) / GI
    if not fits_at_peak(pr, res.assignment):
        return {"p0_cap": cap, "micro_batch": pr.graph.micro_batch, "winner": "Megatron", "reduction_pct": None,
                "difference_pp": None, "searched_memory_gib": peak,
                "detail": f"the searched plan needs {peak:.2f} GiB at its peak, over the "
                          f"{pr.device_limit / GI:.2f} GiB usable", "status": "fail"}
    ours, theirs = attention_volume(pr, res.assignment, BLOCK), attention_volume(pr, mega, BLOCK)
    win_ours, win_theirs = attention_volume(pr, res.assignment, ATTENTION), attention_volume(pr, mega, ATTENTION)
    reduction = (1 - ours / theirs) * 100
    ok = abs(reduction - case["paper"]["reduction_pct"]) <= TOLERANCE_PP
    gi = pr.mb / 2**30
    paper = papers_plan(case, pr, mega) if case.get("paper_plan") else None
    drawn = {} if paper is None else {"papers_plan": {
        "reduction_pct": (1 - attention_volume(pr, paper, BLOCK) / theirs) * 100,
        "window_reduction_pct": (1 - attention_volume(pr, paper, ATTENTION) / win_theirs) * 100,
        "comm_s": pr.raw_cost(paper), "memory_gib": pr.peak_memory(paper) / GI, "fits": fits_at_peak(pr, paper),
        "p0": max(replication(pr.choices[v][i]) for v, i in enumerate(paper) if pr.ops[v].layer.kind in REPLICATED),
        "searched_alike": [op.layer.name for v, op in enumerate(pr.ops)  # the drawn layers the search placed alike
                           if op.layer.name in case["paper_plan"]["layers"] and res.assignment[v] == paper[v]]}}
    also = "".join(f"; the paper's plan: window {d['window_reduction_pct']:.1f}% less, whole block "
                   f"{d['reduction_pct']:.1f}% less; communication a step: searched {pr.raw_cost(res.assignment):.4g} "
                   f"s, the paper's plan {d['comm_s']:.4g} s, Megatron {pr.raw_cost(mega):.4g} s"
                   for d in drawn.values())
    return {"p0_cap": cap, "micro_batch": pr.graph.micro_batch,
            "winner": "AutoDDL" if reduction > 1 else "Megatron", "reduction_pct": reduction,
            "searched_memory_gib": peak, "difference_pp": reduction - case["paper"]["reduction_pct"],
            "window_reduction_pct": (1 - win_ours / win_theirs) * 100,
            "detail": f"activation elements per device and batch, forward and backward, whole block: searched "
                      f"{ours * gi:.3g} Gi, Megatron {mesh} {theirs * gi:.3g} Gi; ln1 -> ln2 window: "
                      f"{win_ours * gi:.3g} Gi vs {win_theirs * gi:.3g} Gi ({(1 - win_ours / win_theirs) * 100:.1f}% less)"
                      + also,
            "searched_comm_s": pr.raw_cost(res.assignment), **drawn, "status": "pass" if ok else "fail"}


def _pipeline_case(case: dict, config: Config) -> dict:
    """§5.4 Table 3: end-to-end step time with pipeline stages, AutoDDL's plan (stages with the SBP search inside
    each: ``autotune.pipeline.search``) against Megatron's (tensor, pipeline and data parallelism hand-tuned:
    ``autotune.pipeline.threed``, t across nodes on one GPU a node, recomputation where no plain plan fits, no
    FSDP: the Megatron-LM of 2021, every micro-batch count down to one sequence per data-parallel rank), each at
    its best stage count of the case's
    ``stages`` (the paper: "tested the models with different pipeline stages and report the best one") and its
    best micro-batch count (every one the search allows, p to 8p, each refined and simulated: ranked by the
    balanced split's estimate, the default's two refined miss the best here; the paper takes the smallest
    micro-batch), 1F1B,
    step objective (the table's times are end-to-end). The reduction is 1 - AutoDDL's step / Megatron's; the
    verdict as the other cases'. The search is seeded with the Megatron plan (``autotune.pipeline.threed.seeded``,
    as the single-stage cases start from it), so it is never slower. Not the paper's: the searched stages may
    train under recomputation or FSDP where no plain plan fits (the stage search's modes; AutoDDL's search had
    no FSDP), try at most 8p micro-batches (Megatron here: every count) and have no p0 cap. One stage is the
    paper's "no pipeline": priced as the single-stage step (``PipelineConfig.single_stage_plain``: FSDP as
    without a pipeline), not as torch's PipelineStage would run one stage."""
    g = load_model(case["model"], case["preset"], dict(case.get("overrides", {})))
    profile = Profile.load(case["profile"])
    if (config.alpha_scale, config.beta_scale) != (1.0, 1.0):
        profile = scaled_profile(profile, config.alpha_scale, config.beta_scale)
    cluster = Cluster(case["nodes"], case["gpus"])
    limit = _limit(case, profile)
    ours = theirs = None
    per_stages = []
    for p in case["stages"]:
        # every micro-batch count and candidate refined, at the stage searches' full effort (the command's
        # cheaper defaults are measured on the large cases: reports/records/pipeline.md, speed session 6)
        # one stage: the paper's "no pipeline", the single-stage step (FSDP as without a pipeline)
        # in the single-stage cases' recipe (the paper's): not the users' torch recipe, whose pipelining keeps a
        # receive buffer for every micro-batch (16 GiB of a P100's 16 at Megatron's 256), which neither Megatron-LM
        # nor AutoDDL's runtime holds
        cfg = PipelineConfig(stages=p, micro_batch_choices=8 * p, refine=8 * p, single_stage_plain=p == 1,
                             recipe="autoddl").full_effort()
        ps = PipelineSearch(g, cluster, profile, limit, cfg)
        a, b, same = seeded(ps, tensor_in_node=case["gpus"] > 1, sharding=False, most=g.batch)
        per_stages.append({"stages": p, "searched_s": a.step if a else None, "megatron_s": b.step if b else None,
                           "searched": _piped(a), "megatron": b.name if b else None, "seeded_by_3d": same})
        ours = a if a is not None and (ours is None or a.step < ours.step) else ours
        theirs = b if b is not None and (theirs is None or b.step < theirs.step) else theirs
    fit = {"Megatron 3-D": theirs.step} if theirs is not None else {}
    v = verdict(case, ours.step if ours is not None else math.inf, fit)
    paper = case["paper"]
    return {"micro_batch": g.batch // ours.micro_batches if ours else None,
            "searched_s": ours.step if ours else None,
            "baselines": {"Megatron 3-D": {"comm_s": None, "step_s": theirs.step if theirs else None,
                                           "mesh": theirs.name if theirs else None}},
            "stages": ours.stages if ours else None, "megatron_stages": theirs.stages if theirs else None,
            "per_stages": per_stages, **v,
            "detail": f"step time: searched {_piped(ours)}, {_secs(ours)}; "
                      f"{theirs.name if theirs else 'no Megatron 3-D plan fits'}, {_secs(theirs)}; "
                      f"paper: {paper['figure']}"}


def _piped(c) -> str | None:
    if c is None:
        return None
    mode = c.plans[0].problem.mode
    return (f"{c.stages} stages, {c.micro_batches} micro-batches, split {list(c.split)}"
            + ("" if mode == NONE else f", {describe(mode)} (stage 0)"))


def _secs(c) -> str:
    return "-" if c is None else f"{c.step:.4g} s"


def _search_case(case: dict) -> dict:
    g = load_model(case["model"], case["preset"], case.get("overrides"))
    pr = Problem(g, Coster(Profile.load(case["profile"]), Cluster(case["nodes"], case["gpus"])), None,
                 precompute_tables=True)
    t = time.perf_counter()
    opt = make_search("exhaustive").run(pr, Budget(), np.random.default_rng(0))
    ex_s = time.perf_counter() - t
    cd = make_search("cd").run(pr, Budget(seconds=max(ex_s * 0.01, 1e-3)), np.random.default_rng(0))
    ratio = cd.cost / opt.cost
    return {"winner": "cd" if ratio <= 1.01 else "exhaustive", "reduction_pct": None, "difference_pp": None,
            "detail": f"coordinate descent with 1% of exhaustive's {ex_s:.3g} s: {ratio:.4f} x the optimum",
            "status": "pass" if ratio <= 1.01 else "fail"}


def records() -> list[Path]:
    """The recorded runs of this repository (reports/records/sbp_reproduce_*.json), oldest name first."""
    return sorted(Path(__file__).resolve().parents[1].joinpath("reports", "records").glob("sbp_reproduce_*.json"))


def latest_record() -> Path | None:
    """The newest recorded run of this repository, None if none."""
    found = records()
    return found[-1] if found else None


def recorded_rows(paths: list[Path]) -> list[dict]:
    """Each case's row from the newest of ``paths`` that has it (a record of a few cases does not hide the
    others' figures: the Table 3 cases' last record is not the newest file)."""
    out: dict[str, dict] = {}
    for path in paths:
        for r in previous_rows(path):
            out[r["id"]] = r
    return list(out.values())


def previous_statuses(path: Path | None) -> dict[str, str]:
    """case id -> status in a recorded run; {} without one."""
    if path is None:
        return {}
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the previous record {str(path)!r} ({e}): give a reproduce.json") from None
    check_header(d, RECORD, tuple(range(1, VERSION + 1)), "reproduction record",
                 "give a reproduce.json of this command", str(path))
    rows = d.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("id"), str)
                                             and isinstance(r.get("status"), str) for r in rows):
        raise UserError(f"{path}: 'rows' is not a list of cases with id and status: give a reproduce.json")
    return {r["id"]: r["status"] for r in rows}


def previous_rows(path: Path | None) -> list[dict]:
    """The rows of a recorded run (checked as ``previous_statuses`` checks them); [] without one."""
    if path is None:
        return []
    previous_statuses(path)
    return json.loads(path.read_text())["rows"]


WORSE = 0.005  # a searched figure more than this share above the previous record's is flagged


def worse_figures(rows: list[dict], previous: list[dict]) -> list[str]:
    """Cases whose searched figure (communication, or the step on the pipeline cases) got worse than the previous
    record's by more than ``WORSE``, each with both figures: a case can keep its verdict and still lose ground
    (Table 3's pipeline-wide-64 found 129.5 s where its record said 113.3 s)."""
    before = {r["id"]: r.get("searched_s") for r in previous}
    out = []
    for r in rows:
        a, b = before.get(r["id"]), r.get("searched_s")
        if a is not None and (b is None or b > a * (1 + WORSE)):
            out.append(f"{r['id']} {a:.4g} s -> {'no plan' if b is None else f'{b:.4g} s'}")
    return out


def rebaselined(rows: list[dict], previous: list[dict]) -> list[str]:
    """For each case run whose previous row re-baselines its record (a "rebaseline" field: the figure it replaced
    and why, written by hand where the model was corrected and the old figure priced a step that does not run),
    one line saying which figure the comparison is against and why."""
    ran = {r["id"] for r in rows}
    return [f"{r['id']} compared with its re-baselined record {r['searched_s']:.4g} s (was "
            f"{r['rebaseline']['was_s']:.4g} s: {r['rebaseline']['reason']})"
            for r in previous if r["id"] in ran and isinstance(r.get("rebaseline"), dict)]


def regressions(rows: list[dict], previous: dict[str, str]) -> list[str]:
    """Cases that passed in ``previous`` and fail in ``rows``."""
    return [r["id"] for r in rows if r["status"] == "fail" and previous.get(r["id"]) == "pass"]


def _cap_cell(alt: dict | None) -> str:
    if alt is None:
        return "-"
    if alt["reduction_pct"] is None:
        return f"no searched plan fits ({alt['status']})"
    return f"{-alt['reduction_pct']:+.1f}% ({alt['status']})"


def passes_by_cap(rows: list[dict]) -> dict[str, int]:
    """Cases passing under each cap of ``ALTERNATIVE_P0_CAPS`` (a case without one: its own status)."""
    return {k: sum((r.get("p0_caps", {}).get(k) or r)["status"] == "pass" for r in rows) for k in ("4", "none")}


def table(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        p = r["paper"]
        ours = r.get("reduction_pct")
        out.append({
            "case": r["id"], "section": r["section"],
            "paper": f"{p.get('winner', '')}" + (f", -{p['reduction_pct']:g}% vs {p.get('second', '')}"
                                                  if p.get("reduction_pct") is not None else ""),
            "ours": r.get("reason", "") if r["status"] == "not modelled" else
            f"{r.get('winner', '')}" + (f", {-ours:+.1f}% vs {r.get('compared_with') or 'Megatron'}" if ours is not None else "")
            + (f"; best baseline here {r['best_baseline']} ({-r['reduction_vs_best_pct']:+.1f}%)"
               if r.get("best_baseline") and r.get("best_baseline") != r.get("compared_with") else "")
            + (f" ({r['detail']})" if r.get("detail") else ""),
            "difference pp": "-" if r.get("difference_pp") is None else f"{r['difference_pp']:+.1f}",
            "micro-batch": r.get("micro_batch", "-"),
            "status": r["status"] + (" (flips)" if r.get("flips") else "")
            + (" (p0 cap)" if any(v["status"] != r["status"] for v in r.get("p0_caps", {}).values()) else ""),
            "p0 cap": "-" if r.get("p0_cap") is None else r["p0_cap"],
            **{f"p0 cap {k}": _cap_cell(r.get("p0_caps", {}).get(k)) for k in ("4", "none")},
            "sensitivity": "-" if "sensitivity" not in r else "alpha, beta scaled: " + ", ".join(
                f"a x{s['alpha_scale']:g} b x{s['beta_scale']:g}: "
                + ("-" if s["reduction_pct"] is None else f"{-s['reduction_pct']:+.1f}%") + f" {s['status']}"
                for s in r["sensitivity"]),
        })
    return out
