"""Published large training runs as regression tests: ``python -m autotune reproduce published``
(``autotune/cli/reproduce.py``).

Every case of ``autotune/sbp/presets/published.json`` (the paper's model, cluster, configuration and step) is
priced twice on its documented profile, one configuration for all cases, each in the precision recipe its run
used (the case's "recipe", ``autotune.sbp.memory.RECIPES``, with its source: Megatron-LM's fp16 recipe for the
SC21 runs, the bf16 one with fp32 gradients for Llama 3) and with the dropout it used (the case's "dropout", with
its source: Megatron-LM's defaults, 0.1 on the attention probabilities and the hidden states, for the SC21 runs;
none for Llama 3; ``autotune.sbp.layers.dropout_dims``):

- forced: the paper's configuration (tensor degree t inside a node, p stages of whole nodes, d data-parallel
  ranks, context-parallel groups, micro-batch size, recomputation, schedule and virtual stages, sequence
  parallelism, ZeRO stage: every technique of ``autotune.sbp.techniques``, each priced) through the Megatron
  3-D baseline (``autotune.pipeline.threed.stage_plans``), boundaries priced and the schedule simulated
  (``PipelineSearch.finish``), with the memory limit lifted (a plan over it says so); a configuration the
  model cannot lay out is a one-line error naming the fix. Where it does not fit and the paper names no
  recomputation, the same configuration with each rank re-running its fewest first blocks that make it fit
  (Megatron-LM's block method, ``fitting``) is priced beside it, and the row is judged on that one: the run
  happened, so something kept it within its GPUs' memory, and this is the least recomputation that does in the
  model;
- free: the main command's pipeline search seeded with the 3-D plans (``autotune.pipeline.threed.seeded``)
  under 1F1B and under interleaved 1F1B (its 3-D plans at ``CHUNKS`` chunks a rank too: Megatron-LM's
  ``--num-layers-per-virtual-pipeline-stage``), and for a long sequence with the attention context-parallel over
  each size ``autotune.sbp.techniques.context_sizes`` tries as well (the 3-D plans' context-parallel groups
  inside their data-parallel ranks), the fastest kept.

Each is reported with its model FLOPs utilisation (``mfu``: PaLM's count, 6 N + 12 l h s FLOPs a token, against
the datasheet peak of the profile's matmul band) beside the ceiling its profile's measured GEMMs allow
(``gemm_ceiling``: the best measured matmul rate over the peak; a plan above it is flagged). A case passes when
the forced plan is within ``TOLERANCE`` of the published step (of the nearer end of a published range) and the
free search is no slower than the published step by more than ``SEARCH_SLACK``. The command compares every
figure with the previous record and flags a step that got worse (``worse``).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from importlib import resources
from pathlib import Path

from calibrate.errors import UserError
from calibrate.jsonfile import read_json
from calibrate.records import check_header
from calibrate.profile import Profile
from models import load_model

from autotune.pipeline.search import Candidate, PipelineConfig, PipelineSearch, fewer_collections, submesh
from autotune.pipeline.threed import megatron_3d, seeded, stage_plans
from autotune.sbp.fit import least_count
from autotune.sbp.memory import RECIPES, Mode
from autotune.sbp.mesh import Cluster
from autotune.sbp.techniques import Techniques, context_parallel, context_parallel_of, context_sizes

RECORD = "commtune.published-reproduction"
VERSION = 1
TOLERANCE = 0.10  # forced plan against the published step
SEARCH_SLACK = 0.05  # the free search's step at most this much over the published one
CHUNKS = (4, 8)  # chunks a rank the free search's interleaved 3-D plans take beside the pipeline search's default
WORSE = 0.005  # a step more than this share above the previous record's is flagged


def load_cases() -> list[dict]:
    d = json.loads(resources.files("autotune.sbp.presets").joinpath("published.json").read_text())
    return d["cases"]


def recipe(case: dict) -> str:
    """The precision recipe a case's run used (its "recipe"); a one-line error naming the fix without one."""
    name = case.get("recipe")
    if name not in RECIPES or not case.get("recipe_source"):
        raise UserError(f"case {case.get('id')}: recipe {name!r} with a recipe_source is needed: set one of "
                        f"{', '.join(RECIPES)} and where the run's paper or scripts state it")
    return name


def dropout(case: dict) -> tuple[float, float]:
    """The dropout a case's run used, (on the attention probabilities, on the hidden states) (its "dropout", with
    its "source"), priced in Megatron-LM's recipes; a one-line error naming the fix without one."""
    d = case.get("dropout")
    if not isinstance(d, dict) or not d.get("source") or not all(
            isinstance(d.get(k), (int, float)) and 0 <= d[k] < 1 for k in ("attention", "hidden")):
        raise UserError(f"case {case.get('id')}: a dropout {{\"attention\": p, \"hidden\": p, \"source\": ...}} is "
                        f"needed (0 <= p < 1, 0 where the run used none), with where the run's paper or code states it")
    return float(d["attention"]), float(d["hidden"])


def published_step(case: dict) -> tuple[float, float]:
    """The published step (low, high) in seconds from the paper's own figures (the data file's arithmetic):
    Megatron-LM's count 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) FLOPs a step, or 6 N T without and with causal
    attention (6 l s h T), over GPUs x the published TFLOP/s per GPU."""
    g = load_model(case["model"], case["preset"], dict(case.get("overrides", {})))
    pub = case["published"]
    rate = case["nodes"] * case["gpus"] * pub["tflops_per_gpu"] * 1e12
    cfg = g.config
    b, s, l, h, v = g.batch, cfg["sequence"], cfg["layers"], cfg["hidden"], cfg["vocabulary"]
    if pub["count"] == "megatron":
        flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        return flops / rate, flops / rate
    if pub["count"] == "6N-range":
        tokens = b * s
        low = 6 * g.parameters() * tokens
        return low / rate, (low + 6 * l * s * h * tokens) / rate
    raise UserError(f"case {case['id']}: unknown FLOP count {pub['count']!r}: use megatron or 6N-range")


def model_flops(g) -> float:
    """Model FLOPs of one step, PaLM's count (recomputation not counted): 6 N + 12 l h s a token."""
    cfg = g.config
    tokens = g.batch * cfg["sequence"]
    return (6 * g.parameters() + 12 * cfg["layers"] * cfg["hidden"] * cfg["sequence"]) * tokens


def gemm_ceiling(profile: Profile, act_bytes: int) -> tuple[float, float]:
    """(the best matmul rate the profile's band has measured or cites, its datasheet peak)."""
    band = profile.compute.matmul[str(act_bytes)]
    best = max((f / t for f, t in band.points), default=band.peak_flops)
    return best, band.peak_flops


MEGATRON_DROPOUT = (0.1, 0.1)  # Megatron-LM's defaults: --attention-dropout, --hidden-dropout (arguments.py)


def megatron_terms(t: int, p: int, d: int, mbs: int, batch: int, tech: Techniques, layers: int,
                   drop: tuple[float, float] = MEGATRON_DROPOUT) -> str:
    """A configuration in Megatron-LM's flags (and torchtitan's degrees); ``drop``: the run's dropout, its flags
    where it is not Megatron-LM's default."""
    flags = [f"--tensor-model-parallel-size {t}", f"--pipeline-model-parallel-size {p}",
             f"--micro-batch-size {mbs}", f"--global-batch-size {batch}"]
    if tuple(drop) != MEGATRON_DROPOUT:
        flags.append(f"--attention-dropout {drop[0]:g} --hidden-dropout {drop[1]:g}")
    if tech.virtual_stages > 1:  # as ``autotune.export`` writes it (megatron-core 0.16's name)
        uneven = " (layers uneven over the chunks)" if layers % (p * tech.virtual_stages) else ""
        flags.append(f"--num-virtual-stages-per-pipeline-rank {tech.virtual_stages}{uneven}")
    if tech.recompute != "none":
        flags.append(f"--recompute-granularity {tech.recompute}" + (
            "" if tech.recompute != "full" else _blocks_flags(tech) if tech.recompute_blocks else
            " --recompute-method uniform"))
    if tech.sequence_parallel:
        flags.append("--sequence-parallel")
    if tech.zero_stage:
        flags.append("--use-distributed-optimizer")
    if tech.overlap_grad_reduce:
        flags.append("--overlap-grad-reduce")
    if tech.context_parallel > 1:
        flags.append(f"--context-parallel-size {tech.context_parallel}")
    sched = "Interleaved1F1B" if tech.virtual_stages > 1 else "1F1B"
    return " ".join(flags) + f" (torchtitan: tp {t}, pp {p} {sched}, dp {d})"


def _blocks_flags(tech: Techniques) -> str:
    """Megatron-LM's block method for a plan re-running each rank's first ``recompute_blocks`` blocks: it counts
    per chunk a rank, so with several chunks the flag re-runs at least as many (said where more)."""
    v = max(tech.virtual_stages, 1)
    per = -(-tech.recompute_blocks // v)
    more = f" (Megatron-LM counts per chunk: {per} in each of a rank's {v} chunks, where the plan re-runs " \
           f"{tech.recompute_blocks} blocks a rank)" if per * v > tech.recompute_blocks else ""
    return f" --recompute-method block --recompute-num-layers {per}{more}"


def _search(g, cluster: Cluster, profile: Profile, limit, cfg: PipelineConfig) -> PipelineSearch:
    return PipelineSearch(g, cluster, profile, limit, cfg)


def forced(case: dict) -> dict:
    """The paper's configuration priced (module docstring): its step, memory and configuration."""
    g = load_model(case["model"], case["preset"], dict(case.get("overrides", {})))
    profile = Profile.load(case["profile"])
    cluster = Cluster(case["nodes"], case["gpus"])
    plan = case["plan"]
    t, p, d, mbs = plan["tensor"], plan["stages"], plan["data"], plan["micro_batch_size"]
    tech = Techniques.of(plan)
    cp = tech.context_parallel
    if t * cp * p * d != cluster.devices or case["gpus"] % t:
        raise UserError(f"case {case['id']}: t {t} x cp {cp} x p {p} x d {d} is not the {cluster.devices} GPUs, or t "
                        f"does not divide a node's {case['gpus']}: fix the case")
    if g.batch % (d * mbs):
        raise UserError(f"case {case['id']}: batch {g.batch} is not a multiple of d {d} x micro-batch size {mbs}")
    g = context_parallel(g, cp)
    cfg = PipelineConfig(stages=p, schedule=tech.schedule, virtual_stages=max(tech.virtual_stages, 2),
                         recipe=recipe(case), dropout=dropout(case), overlap_grad_reduce=tech.overlap_grad_reduce)
    search = _search(g, cluster, profile, None, cfg)  # priced whatever it needs; checked against the limit below
    m = g.batch // (d * mbs)
    sub = submesh(cluster, p)
    mesh = ((sub.nodes, case["gpus"] // t), (1, t))
    if cp > 1:  # the context-parallel groups inside the data-parallel ranks, a node's GPUs first (Megatron's order)
        inside = math.gcd(cp, case["gpus"] // t)
        mesh += ((cp // inside, inside),)
    with fewer_collections():
        plans = stage_plans(search, p, sub, m, mesh, Mode(tech.recompute, None, tech.zero_stage, tech.recompute_blocks),
                            tech.sequence_parallel)
        if plans is None:
            raise UserError(f"case {case['id']}: the Megatron plan does not lay out on t {t}, d {d} at micro-batch "
                            f"size {mbs}: fix the case")
        c = search.finish(search.candidate(p, sub, m, search.balanced(p), plans))
    peak = max(x.fig.memory for x in c.plans)
    out = {"step_s": c.step if math.isfinite(c.step) else None, "micro_batches": m, "memory_gib": peak / 2**30,
           "parts": parts(c),
           "limit_gib": None if profile.memory_bytes is None else profile.memory_bytes / 2**30,
           "fits": profile.memory_bytes is None or peak <= profile.memory_bytes,
           "config": megatron_terms(t, p, d, mbs, g.batch, tech, g.config["layers"], dropout(case))}
    if not out["fits"] and tech.recompute == "none":
        out["fitting"] = fitting(case, min(len(x.problem.graph.blocks) for x in c.plans))
    return out


def fitting(case: dict, blocks: int) -> dict | None:
    """The case's configuration with each rank re-running its first N of ``blocks`` blocks (Megatron-LM's block
    method), the fewest N under which every stage fits (memory falls as N grows: a binary search), priced as
    ``forced`` prices it, with N; None where no N below ``blocks`` fits."""
    @functools.cache
    def at(n: int) -> dict:
        return forced(dict(case, plan=dict(case["plan"], recompute="full", recompute_blocks=n)))
    n = least_count(blocks - 1, lambda n: at(n)["fits"])
    return dict(at(n), recompute_blocks=n) if n else None


def parts(c: Candidate) -> dict:
    """The step of a priced candidate split on its binding stage (the one whose last backward, exposed gradient
    sync and optimizer end last): its layers' compute (with DTensor's copies and the gradient accumulation), the
    communication between and inside its layers (tensor parallelism's, exposed), the pipeline's bubble (the rest
    of the time to its last backward: the schedule's idle time and the boundaries' transfers), the exposed
    gradient sync and the optimizer; with the limit lifted they add up to the step. Beside them, the stage's whole
    gradient sync (``grad_sync_s``), of which the exposed part is what the schedule does not hide."""
    i = max(range(len(c.plans)), key=lambda k: c.ends[k] + c.exposed[k] + c.plans[k].fig.optimizer)
    f = c.plans[i].fig
    return {"stage": i, "compute_s": f.compute - f.optimizer, "tensor_parallel_s": f.redistribution,
            "bubble_s": c.ends[i] - c.micro_batches * (f.forward + f.backward), "exposed_sync_s": c.exposed[i],
            "optimizer_s": f.optimizer, "grad_sync_s": f.grad_sync}


def _describe(c: Candidate, schedule: str, g) -> str:
    mode = c.plans[0].problem.mode
    name = c.name or f"{c.stages} stages"
    return (f"{name}; {c.stages} stages of {c.sub}, {c.micro_batches} micro-batches "
            f"(micro-batch {g.batch // c.micro_batches} sequences), {schedule}"
            + (f" with {c.virtual} chunks a rank" if c.virtual > 1 else "")
            + (f", recompute {mode.recompute}" if mode.recompute != "none" else "")
            + (f" (each stage's first {mode.blocks} blocks)" if mode.blocks else "")
            + (", FSDP over the data-parallel group" if mode.fsdp_axes is not None else ""))


def _flags(c: Candidate, schedule: str, g, cluster: Cluster, drop: tuple[float, float]) -> str:
    """A 3-D plan in Megatron-LM's flags; a plan of searched stages says so (its per-layer placements are no
    single flag set: the plan record has them)."""
    if not c.tensor:
        return "; searched SBP placements per layer on each stage (the plan record lists them)"
    mode = c.plans[0].problem.mode
    cp = context_parallel_of(g)  # a 3-D plan of a graph offering it runs its groups (threed.candidates)
    d = cluster.devices // (c.tensor * c.stages * cp)
    tech = Techniques(mode.recompute, schedule, c.virtual, bool(c.plans[0].search.get("sequence_parallel")),
                      mode.zero, context_parallel=cp, recompute_blocks=mode.blocks)
    return "; " + megatron_terms(c.tensor, c.stages, d, g.batch // (c.micro_batches * d), g.batch, tech,
                                 g.config["layers"], drop)


def free(case: dict, schedules=("1f1b", "interleaved-1f1b")) -> dict:
    """The free search (module docstring): the fastest plan over ``schedules`` (and context-parallel sizes)."""
    g0 = load_model(case["model"], case["preset"], dict(case.get("overrides", {})))
    profile = Profile.load(case["profile"])
    cluster = Cluster(case["nodes"], case["gpus"])
    sizes = (1,) + context_sizes(g0, cluster.devices)
    best = None
    for cp in sizes:
        try:
            g = context_parallel(g0, cp)
        except UserError:  # a sequence that does not split into 2 cp chunks: that size is not a plan
            continue
        for sched in schedules:
            cfg = PipelineConfig(schedule=sched, recipe=recipe(case), dropout=dropout(case))
            search = _search(g, cluster, profile, profile.memory_bytes, cfg)
            c, _, is3d = seeded(search)
            found = [c] + [megatron_3d(_search(g, cluster, profile, profile.memory_bytes,
                                                replace(cfg, virtual_stages=v)))
                           for v in (CHUNKS if sched == "interleaved-1f1b" else ())]
            for c in found:
                if c is not None and (best is None or c.step < best[0].step):
                    best = (c, sched, g)
    if best is None:
        return {"step_s": None, "plan": "no plan fits"}
    c, sched, g = best
    return {"step_s": c.step, "plan": _describe(c, sched, g) + _flags(c, sched, g, cluster, dropout(case)), "stages": c.stages, "micro_batches": c.micro_batches,
            "memory_gib": max(x.fig.memory for x in c.plans) / 2**30}


def run_case(case: dict, with_search: bool = True) -> dict:
    """One case's row: the published step, the forced and the free plan with their MFU, and the verdict."""
    g = load_model(case["model"], case["preset"], dict(case.get("overrides", {})))
    profile = Profile.load(case["profile"])
    lo, hi = published_step(case)
    best_rate, peak = gemm_ceiling(profile, g.act_bytes)
    gpus = case["nodes"] * case["gpus"]

    def mfu(step):
        return None if not step else model_flops(g) / (gpus * peak * step)
    row = {"id": case["id"], "source": case["source"], "profile": case["profile"], "recipe": recipe(case),
           "published_s": [lo, hi], "published_mfu": [mfu(hi), mfu(lo)], "gemm_ceiling": best_rate / peak}
    f = forced(case)
    row["forced"] = dict(f, mfu=mfu(f["step_s"]))
    near = lo if f["step_s"] is not None and f["step_s"] < lo else hi
    row["forced_ratio"] = None if f["step_s"] is None else f["step_s"] / near
    judged = f if f["fits"] or not f.get("fitting") else f["fitting"]  # the least recomputation that fits
    if judged is not f:
        row["forced_fitting_ratio"] = judged["step_s"] / (lo if judged["step_s"] < lo else hi)
    ratio = row.get("forced_fitting_ratio", row["forced_ratio"])
    ok = ratio is not None and abs(ratio - 1) <= TOLERANCE and judged["fits"]
    if with_search:
        s = free(case)
        row["searched"] = dict(s, mfu=mfu(s["step_s"]))
        over = row["searched"]["mfu"] is not None and row["searched"]["mfu"] > row["gemm_ceiling"]
        row["searched"]["above_gemm_ceiling"] = over
        ok = ok and s["step_s"] is not None and s["step_s"] <= hi * (1 + SEARCH_SLACK) and not over
    row["status"] = "pass" if ok else "fail"
    if not f["fits"]:
        row["reason"] = (f"the forced plan needs {f['memory_gib']:.1f} GiB at its binding stage, over the "
                         f"{f['limit_gib']:.1f} GiB usable (step priced with the limit lifted)")
        if judged is not f:
            row["reason"] += (f"; with each rank re-running its first {judged['recompute_blocks']} blocks it fits at "
                              f"{judged['memory_gib']:.1f} GiB, {judged['step_s']:.4g} s, "
                              f"{row['forced_fitting_ratio']:.2f} of published (judged on that)")
    return row


def worse(rows: list[dict], previous: list[dict]) -> list[str]:
    """Cases whose forced or searched step got worse than in the previous record (more than ``WORSE``), each
    with the two figures."""
    before = {r["id"]: r for r in previous}
    out = []
    for r in rows:
        old = before.get(r["id"])
        if old is None:
            continue
        for key in ("forced", "searched"):
            a, b = (old.get(key) or {}).get("step_s"), (r.get(key) or {}).get("step_s")
            if a is not None and (b is None or b > a * (1 + WORSE)):
                out.append(f"{r['id']} {key} {a:.4g} s -> {'none' if b is None else f'{b:.4g} s'}")
    return out


def latest_record() -> Path | None:
    """The newest recorded run of this repository (reports/records/published_reproduce_*.json): by the time the
    command wrote into it ("recorded"), then by name (records before the stamp, oldest first); None if none."""
    def order(path: Path) -> tuple[str, str]:
        d = read_json(path, "recorded run", "give a reproduce.json of python -m autotune reproduce published")
        return str(d.get("recorded", "")) if isinstance(d, dict) else "", path.name

    found = Path(__file__).resolve().parents[1].joinpath("reports", "records").glob("published_reproduce_*.json")
    return max(found, key=order, default=None)


def previous_rows(path: Path | None) -> list[dict]:
    """The rows of a recorded run, checked; [] without one."""
    if path is None:
        return []
    d = read_json(path, "previous record", "give a reproduce.json of python -m autotune reproduce published")
    check_header(d, RECORD, (VERSION,), "published-runs reproduction record",
                 "give a reproduce.json of python -m autotune reproduce published", str(path))
    rows = d.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("id"), str) for r in rows):
        raise UserError(f"{path}: 'rows' is not a list of cases with ids: give a reproduce.json of this command")
    return rows


def _s(x) -> str:
    return "-" if x is None else f"{x:.4g} s"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def lines(row: dict) -> list[str]:
    """A case's row as the command prints it: published, forced and free side by side with MFU."""
    lo, hi = row["published_s"]
    pub = f"{lo:.3g} s" if abs(hi - lo) < 0.005 else f"{lo:.3g}-{hi:.3g} s"
    f = row["forced"]
    ratio = "-" if row["forced_ratio"] is None else f"{row['forced_ratio']:.2f}"
    out = [f"published: {pub} (MFU {_pct(row['published_mfu'][0])}"
           + (f"-{_pct(row['published_mfu'][1])}" if abs(hi - lo) >= 0.005 else "") + f"); {row['source']}; recipe {row.get('recipe', 'autocast')}",
           f"forced:    {_s(f['step_s'])} ({ratio} of published), "
           f"MFU {_pct(f['mfu'])}, {f['memory_gib']:.1f} GiB of {f['limit_gib']:.1f} usable; {f['config']}"]
    if f.get("parts"):
        out.append("           binding stage {stage}: compute {compute_s:.3f} s, tensor-parallel communication "
                   "{tensor_parallel_s:.3f} s, bubble {bubble_s:.3f} s, exposed gradient sync {exposed_sync_s:.3f} s, "
                   "optimizer {optimizer_s:.3f} s (of a gradient sync of {grad_sync_s:.3f} s)".format(**f["parts"]))
    if row.get("reason"):
        out.append(f"           {row['reason']}")
    s = row.get("searched")
    if s is not None:
        out.append(f"searched:  {_s(s['step_s'])}, MFU {_pct(s['mfu'])} (GEMM ceiling {_pct(row['gemm_ceiling'])}"
                   + (", ABOVE IT" if s.get("above_gemm_ceiling") else "") + f"); {s['plan']}")
    out.append(f"status: {row['status']}")
    return out
