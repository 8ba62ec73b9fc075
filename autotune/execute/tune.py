"""``autotune tune``'s loop: search, run the K best candidates of different kinds for a few steps each in the
same job, return the measured fastest, and write what the step model missed back into the profile.

    torchrun --nproc-per-node 4 -m autotune tune --model config.json [--module pkg.mod:factory] --out DIR

Candidates (``candidates``): the searched plan, then the best-predicted plan of each kind not yet taken that
fits (data parallel on DDP; FSDP or HSDP; tensor parallel: Megatron or TP+FSDP; pipelined; then per-layer
placements), up to K. Each runs
through the execute runners (``run_module_plan``: ``autotune.apply``; ``run_pipeline_plan``:
``autotune.apply_pipeline``) for --steps steps, the median after --warmup (the slowest rank's); one that runs
out of memory is reported as not fitting and the others go on. The fastest measured is the returned plan
(DIR/plan.json's best; every candidate's predicted and measured step and memory in its ``meta.tune`` and in
DIR/tune.md). Residuals (``calibrate.residuals``): per apply path, measured / predicted, into the profile
(--profile-out), which the next search reads (``autotune.plan.hostpace.corrected``). The search is one call of
``autotune.search`` (``search_plans``).
"""
from __future__ import annotations

import time

from calibrate.errors import UserError
from calibrate.residuals import valid_key

from autotune.execute.result import stage_peaks, worst
from autotune.plan.file import PlanFile
from autotune.plan.hostpace import residual_path
from autotune.plan.layouts import column_twin
from autotune.plan.typed import ApplyPath, Plan

KINDS = {ApplyPath.DDP.value: "data parallel", ApplyPath.FULLY_SHARD.value: "FSDP",
         ApplyPath.TENSOR.value: "tensor parallel", ApplyPath.DTENSOR.value: "per-layer placements"}  # path -> kind


def kind_of(plan: Plan) -> str | None:
    """The candidate kind of a plan, by the path ``autotune.apply`` places it on (a Megatron plan of t = 1 is data
    parallel, of t > 1 tensor parallel; TP + FSDP goes with FSDP; every other plan with tensor-split layers is one
    of per-layer placements, FSDP with the embedding split by columns too), or "pipelined"; None on one device."""
    if plan.stages:
        return "pipelined"
    columns = plan.apply_path == ApplyPath.FULLY_SHARD and plan.layer("embedding") is not None and \
        column_twin(plan) is not None
    return KINDS[ApplyPath.DTENSOR.value if columns else plan.apply_path] if plan.apply_path in KINDS else None


def _step(plan: Plan) -> float:
    return float("inf") if plan.costs.step_s is None else plan.costs.step_s


# the kinds a user compares the searched plan with first (per-layer placements after them, where K leaves room)
PRIMARY_KINDS = ("data parallel", "FSDP", "tensor parallel", "pipelined")


def candidates(best: Plan, baselines: list[Plan], k: int) -> list[Plan]:
    """The searched plan, then per kind its best-predicted plan that fits, K in all: the kinds of
    ``PRIMARY_KINDS`` first, each group fastest predicted first (a SUMMA plan predicted faster than Megatron does
    not take the tensor-parallel kind's place)."""
    out, seen = [best], {kind_of(best) or "searched"}
    fitting = [p for p in sorted(baselines, key=_step) if kind_of(p) is not None and p.costs.fits_memory]
    for plan in sorted(fitting, key=lambda p: kind_of(p) not in PRIMARY_KINDS):  # stable: by step inside
        if len(out) >= k:
            break
        if kind_of(plan) not in seen:
            out.append(plan)
            seen.add(kind_of(plan))
    return out


def search_plans(search_argv: list[str], progress=None) -> PlanFile:
    """``autotune.search`` under the search's own command-line options ``search_argv`` (step objective)."""
    from autotune.cli.search import prepare
    from autotune.planner import search

    _, graph, cluster, profile, _, options = prepare([*search_argv, "--objective", "step"])
    return search(graph, cluster, profile, **options, progress=progress)


def run_candidate(plan: Plan, d, module: str, steps: int, warmup: int, seed: int, progress, build=None) -> dict:
    """One candidate's row: predicted and measured step and peak memory (the largest over ranks), its apply
    path, and "ok", "out of memory" (does not fit) or the reason it could not run. ``build``: how the model is
    built (``moduletrain.BuildOnce`` for the candidates in turn; default ``build_module``)."""
    from autotune.execute.moduletrain import FactoryError, build_module, torch
    from autotune.execute.pipetrain import run_pipeline_plan
    from autotune.execute.runner import free_device, run_module_plan

    c = plan.costs
    row = {"strategy": plan.strategy, "kind": kind_of(plan) or "searched", "predicted_step_s": c.step_s,
           "predicted_uncorrected_s": c.step_s if c.step_uncorrected_s is None else c.step_uncorrected_s,
           "predicted_bytes": c.memory_bytes}
    free_device(d)
    model = None
    start = time.perf_counter()
    try:
        run = run_pipeline_plan if plan.stages else run_module_plan
        rec, model = run(plan, d, module=module, steps=steps, warmup=warmup, profile_steps=0, seed=seed,
                         progress=progress, build=build or build_module)
        m = rec["measured"]
        peak = m.get("peak_memory_bytes")
        paths = set(rec.get("paths") or [rec.get("apply_path")])  # a pipeline's stages: one path each
        row.update(status="ok", measured_step_s=m["step_s"], apply_path=paths.pop() if len(paths) == 1 else "mixed",
                   measured_steps_s=[float(t) for t in (m.get("step_times_s") or [])[warmup:]],
                   residual_path=residual_path(plan),
                   measured_bytes=max(peak) if isinstance(peak, list) and peak else peak)
        if plan.stages and isinstance(peak, list) and peak:
            row.update(stage_memory(plan, peak))
        row.update(allocator_row(m))
    except torch.OutOfMemoryError:
        row.update(status="out of memory", note="does not fit: it ran out of device memory")
    except FactoryError:  # the same for every candidate: stop at once, in one line
        raise
    except UserError as e:
        row.update(status="failed", note=str(e).splitlines()[0][:300])
    finally:
        del model
        free_device(d)
    progress(f"{row['strategy']}: " + (f"{row['measured_step_s'] * 1e3:.2f} ms measured, "
                                       f"{(row['predicted_step_s'] or 0) * 1e3:.2f} ms predicted"
                                       if row["status"] == "ok" else row.get("note", row["status"]))
             + f" ({time.perf_counter() - start:.1f} s to build, place and run it)")
    return row


def allocator_row(measured: dict) -> dict:
    """A row's allocator retries and their note, where the run had any (``moduletrain._retries``): a step slower
    than priced may come from the allocator at the device's limit, not from the plan's kernels."""
    retries = (measured.get("allocator") or {}).get("retries")
    if not retries:
        return {}
    return {"alloc_retries": retries, "note": f"the allocator retried {retries} times (its cache freed, the device "
                                              f"synchronised): near the memory limit; search after -- with "
                                              f"--expandable-segments (and launch under it) or a lower --memory-limit"}


def stage_memory(plan: Plan, peaks: list) -> dict:
    """A pipelined plan's memory by stage (``result.stage_peaks``), and the row's predicted and measured bytes those
    of its worst stage (``result.worst``)."""
    pairs = stage_peaks([st.memory_bytes for st in plan.stages], peaks) if len(peaks) == plan.cluster.devices else None
    if not pairs:
        return {}
    p, m = worst(pairs)
    return {"stage_bytes": pairs, "predicted_bytes": p, "measured_bytes": m}


def fastest(rows: list[dict]) -> dict:
    ran = [r for r in rows if r.get("status") == "ok"]
    if not ran:
        raise UserError("no candidate ran (each ran out of memory or failed): see the rows above; try a smaller "
                        "micro-batch or more devices")
    return min(ran, key=lambda r: r["measured_step_s"])


TUNE_COLUMNS = ("candidate", "kind", "path", "predicted ms", "measured ms", "error", "predicted GiB", "measured GiB",
                "note")


def tune_rows(rows: list[dict], chosen: dict | None) -> list[dict]:
    """The candidates as the table's rows (``TUNE_COLUMNS``), the returned one marked: tune.md's and the report's."""
    def ms(v):
        return f"{v * 1e3:.2f}" if v else "-"

    def gib(v):
        return f"{v / 2**30:.2f}" if v else "-"

    out = []
    for r in rows:
        p, m = r.get("predicted_step_s"), r.get("measured_step_s")
        out.append(dict(zip(TUNE_COLUMNS, (
            f"{r['strategy']}{' (returned)' if r is chosen else ''}", r["kind"], r.get("apply_path") or "-", ms(p),
            ms(m), f"{(p - m) / m * 100:+.1f}%" if p and m else "-", gib(r.get("predicted_bytes")),
            gib(r.get("measured_bytes")), r.get("note", "")))))
    return out


def tune_notes(rows: list[dict]) -> list[str]:
    """What the table's figures mean beyond their columns: a pipelined row's memory, and Kendall's tau of the
    predicted against the measured order."""
    lines = ["A pipelined plan's GiB: the stage whose measured peak is farthest from its prediction."] \
        if any(r.get("stage_bytes") for r in rows) else []
    ok = [r for r in rows if r.get("status") == "ok" and r.get("predicted_step_s")]
    if len(ok) >= 2:
        steps = [r["measured_step_s"] for r in ok]
        lines.append(f"Kendall tau of the predicted against the measured order: {kendall(ok):+.2f} over {len(ok)} plans "
                     f"(their measured steps within {(max(steps) / min(steps) - 1) * 100:.1f}% of the fastest)")
        pairs, every = resolved_pairs(ok), len(ok) * (len(ok) - 1) // 2
        if pairs is not None and len(pairs) < every:
            lines.append(f"Of its {every} pairs, {len(pairs)} are measured apart by more than "
                         f"their own steps' spread (half the range of each one's timed steps, added)"
                         + (f": tau over those {kendall_pairs(pairs):+.2f}" if pairs else "")
                         + "; the others are ties at this run's noise")
    return lines


def resolved_pairs(rows: list[dict]) -> list[tuple[dict, dict]] | None:
    """The pairs of ``rows`` whose measured steps differ by more than half the range of each one's timed steps,
    added (the run's own noise); None where a row has fewer than two timed steps."""
    if any(len(r.get("measured_steps_s") or []) < 2 for r in rows):
        return None
    spread = [max(r["measured_steps_s"]) - min(r["measured_steps_s"]) for r in rows]
    return [(a, b) for i, a in enumerate(rows) for j, b in enumerate(rows) if i < j and
            abs(a["measured_step_s"] - b["measured_step_s"]) > (spread[i] + spread[j]) / 2]


def tune_table(rows: list[dict], chosen: dict | None) -> str:
    """The candidates as a markdown table (``tune_rows``), then ``tune_notes``."""
    lines = ["| " + " | ".join(TUNE_COLUMNS) + " |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    lines += ["| " + " | ".join(row.values()) + " |" for row in tune_rows(rows, chosen)]
    return "\n".join(lines + [f"\n{line}" for line in tune_notes(rows)])


def kendall(rows: list[dict]) -> float:
    return kendall_pairs([(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]])


def kendall_pairs(pairs: list[tuple[dict, dict]]) -> float:
    """Kendall's tau over ``pairs`` of rows: concordant less discordant, over the pairs."""
    s = sum((1 if (a["predicted_step_s"] - b["predicted_step_s"]) * (a["measured_step_s"] - b["measured_step_s"]) > 0
             else -1) for a, b in pairs)
    return s / len(pairs)


def residual_runs(rows: list[dict]) -> list[dict]:
    """The rows as residual runs (``calibrate.residuals.fitted``): the uncorrected prediction per path."""
    return [{"strategy": r["strategy"], "path": r["residual_path"], "predicted_s": r["predicted_uncorrected_s"],
             "measured_s": r["measured_step_s"]}
            for r in rows
            if r.get("status") == "ok" and valid_key(r.get("residual_path")) and r.get("predicted_uncorrected_s")]
