"""Result records of executed plans, the predicted-against-measured table and the
targets of issue 15 (pure Python: no torch). An error is ``calibrate.measure.stats.rel_err``,
(predicted - measured) / measured: positive where the prediction is too high."""
from __future__ import annotations

import math
import re
from pathlib import Path

from calibrate.errors import UserError
from calibrate.jsonfile import write_json
from calibrate.measure.stats import rel_err, spearman
from calibrate.records import load_record
from calibrate.schema import AMOUNT, COUNT, MAYBE_AMOUNT, MAYBE_REAL, check

KIND = "commtune.execute-result"
SUMMARY_KIND = "commtune.execute-summary"
VERSION = 1
SUMMARY_FIX = "run python -m autotune execute --summarize DIR"
# the body of summary.json as its readers (the report, the markdown) use it
SUMMARY_SCHEMA = {
    "model": dict, "cluster": {"nodes": COUNT, "gpus_per_node": COUNT}, "device": str, "backend": str, "dtype": str,
    "failed?": [{"strategy": str, "error": str}],
    "rows": [{"strategy": str, "pred_step_s": MAYBE_AMOUNT, "step_s": AMOUNT, "pred_comm_s": MAYBE_AMOUNT,
              "comm_alone_s?": MAYBE_AMOUNT, "comm_s": MAYBE_AMOUNT, "pred_memory_bytes": MAYBE_AMOUNT, "memory_bytes": MAYBE_AMOUNT,
              "loss_first": MAYBE_REAL, "loss_last": MAYBE_REAL}],
    "targets": {str: {"value": MAYBE_REAL, "target": str, "met": (bool, None)}},
    "layers?": {str: [{"layer": str, "kind": str, "pred_fwd_s": MAYBE_AMOUNT,
                       "fwd_s": MAYBE_AMOUNT, "pred_bwd_s": MAYBE_AMOUNT, "bwd_s": MAYBE_AMOUNT}]},
}


def load_summary(path: str | Path) -> dict:
    """A summary.json (``--summarize``'s), its header and body checked."""
    s = load_record(path, SUMMARY_KIND, VERSION, "execute summary", SUMMARY_FIX)
    check(s, SUMMARY_SCHEMA, repr(str(path)), SUMMARY_FIX)
    return s


TARGETS = {"spearman": 0.9, "searched_within": 0.03, "step_err": 0.10, "comm_err": 0.15, "memory_err": 0.10}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:48] or "plan"


def write_record(out: Path, index: int, rec: dict) -> Path:
    return write_json(Path(out) / f"execute-{index:02d}-{slug(rec['strategy'])}.json", rec, "execute result")


def load_records(folder: Path) -> list[dict]:
    files = sorted(Path(folder).glob("execute-*.json"))
    if not files:
        raise UserError(f"no execute-*.json in {str(folder)!r}: run python -m autotune execute --out {folder} first")
    out = []
    for f in files:
        out.append(check_result(load_record(f, KIND, VERSION, "execute result", FIX), repr(str(f))))
    return out


FIX = "re-run python -m autotune execute"
MEASURED_SECONDS = ("comm_alone_s", "comm_s", "exposed_comm_s", "host_issue_s", "device_idle_s")
PREDICTED = ("step_s", "total_s", "memory_bytes", "compute_s", "exposed_comm_s")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def check_result(d: dict, origin: str) -> dict:
    """``d`` when its fields have the types and ranges the table reads; one ``UserError`` naming the
    field otherwise. A failed plan (``error``) needs only its strategy and the error."""
    def fail(field: str, problem: str):
        raise UserError(f"{origin}: {field} {problem}: {FIX}")

    if not isinstance(d.get("strategy"), str):
        fail("strategy", f"is {d.get('strategy')!r:.40}, not a string")
    if d.get("error"):
        if not isinstance(d["error"], str):
            fail("error", "is not a message")
        return d
    for key, kind in (("model", dict), ("cluster", dict), ("device", str), ("backend", str), ("dtype", str)):
        if not isinstance(d.get(key), kind):
            fail(key, f"is {d.get(key)!r:.40}, not {'an object' if kind is dict else 'a string'}")
    m = d.get("measured")
    if not isinstance(m, dict):
        fail("measured", f"is {m!r:.40}, not an object")
    if not (_finite(m.get("step_s")) and m["step_s"] > 0):
        fail("measured/step_s", f"is {m.get('step_s')!r}, not a positive finite number of seconds")
    losses = m.get("losses")
    if not (isinstance(losses, list) and losses and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                          and math.isfinite(x) for x in losses)):
        fail("measured/losses", "is not a non-empty list of finite numbers")
    for key in MEASURED_SECONDS:
        if m.get(key) is not None and not _finite(m[key]):
            fail(f"measured/{key}", f"is {m[key]!r}, not a finite number >= 0")
    peak = m.get("peak_memory_bytes")
    if peak is not None and not (isinstance(peak, list) and all(_finite(x) for x in peak)):
        fail("measured/peak_memory_bytes", "is not a list of byte counts")
    alloc = m.get("allocator")  # on GPUs: the caching allocator's retries during the steps, its reserved bytes after
    if alloc is not None and not (isinstance(alloc, dict) and all(_finite(alloc.get(k))
                                                                  for k in ("retries", "reserved_bytes"))):
        fail("measured/allocator", "is not an object of retries and reserved_bytes (numbers >= 0)")
    p = d.get("predicted", {})
    if not isinstance(p, dict):
        fail("predicted", f"is {p!r:.40}, not an object")
    for key in PREDICTED:
        if p.get(key) is not None and not _finite(p[key]):
            fail(f"predicted/{key}", f"is {p[key]!r}, not a finite number >= 0")
    stages = p.get("stage_memory_bytes")
    if stages is not None and not (isinstance(stages, list) and all(_finite(x) for x in stages)):
        fail("predicted/stage_memory_bytes", "is not a list of byte counts")
    return d


def stage_peaks(predicted: list, peaks: list) -> list[list[float]] | None:
    """A pipelined plan's [predicted, measured] peak per stage: stage i on the i-th block of its ranks (every stage
    on a submesh of the same size, as the search makes them), the largest peak over them; None where the ranks do
    not divide into the stages."""
    k, extra = divmod(len(peaks), len(predicted)) if predicted else (0, 1)
    if extra or not k:
        return None
    return [[p, max(peaks[i * k:(i + 1) * k])] for i, p in enumerate(predicted)]


def worst(pairs: list[list[float]]) -> list[float]:
    """The [predicted, measured] pair farthest apart, relative to the measurement: a pipelined plan's memory is its
    worst stage's (the largest prediction beside the largest measurement had hidden a stage 18% under its
    prediction: 2 x H200, 2026-11-30, the two peaks on different stages)."""
    return max(pairs, key=lambda pm: abs(pm[0] - pm[1]) / pm[1])


def rows(records: list[dict]) -> list[dict]:
    out = []
    for r in records:
        if r.get("error"):
            continue
        m, p = r["measured"], r["predicted"] if r.get("predicted_comparable", True) else {}
        mem = max(m["peak_memory_bytes"]) if m.get("peak_memory_bytes") else None
        pred_mem = p.get("memory_bytes")
        stages = stage_peaks(p.get("stage_memory_bytes") or [], m.get("peak_memory_bytes") or [])
        if stages:  # a pipelined plan: its worst stage
            pred_mem, mem = worst(stages)
        out.append({
            "strategy": r["strategy"],
            "pred_step_s": p.get("step_s"), "step_s": m["step_s"], "step_err": rel_err(p.get("step_s"), m["step_s"]),
            "pred_comm_s": p.get("total_s"), "comm_alone_s": m.get("comm_alone_s"),
            "comm_err": rel_err(p.get("total_s"), m.get("comm_alone_s")), "comm_s": m.get("comm_s"),
            "pred_memory_bytes": pred_mem, "memory_bytes": mem, "memory_err": rel_err(pred_mem, mem),
            "pred_compute_s": p.get("compute_s"), "pred_exposed_comm_s": p.get("exposed_comm_s"),
            "exposed_comm_s": m.get("exposed_comm_s"),
            "exposed_err": rel_err(p.get("exposed_comm_s"), m.get("exposed_comm_s")),
            "loss_first": m["losses"][0], "loss_last": m["losses"][-1],
        })
    return out


def targets(table: list[dict], searched_prefix: str = "searched") -> dict:
    """Each target of issue 15: the figure, the threshold, met or not (None: no prediction to compare)."""
    rho = spearman([r["pred_step_s"] for r in table], [r["step_s"] for r in table])
    fastest = min(r["step_s"] for r in table)
    searched = [r for r in table if r["strategy"].startswith(searched_prefix)]
    best_searched = min((r["step_s"] for r in searched), default=None)
    within = None if best_searched is None else best_searched / fastest - 1.0

    def worst(key):
        errs = [abs(r[key]) for r in table if r[key] is not None]
        return max(errs) if errs else None

    out = {"spearman_step": {"value": rho, "target": f">= {TARGETS['spearman']}",
                             "met": None if rho is None else rho >= TARGETS["spearman"]},
           "searched_vs_fastest": {"value": within, "target": f"<= {TARGETS['searched_within']:.0%}",
                                   "met": None if within is None else within <= TARGETS["searched_within"]}}
    for key, name in (("step_err", "step"), ("comm_err", "comm"), ("memory_err", "memory")):
        w = worst(key)
        out[f"worst_{name}_error"] = {"value": w, "target": f"<= {TARGETS[key]:.0%}",
                                      "met": None if w is None else w <= TARGETS[key]}
    return out


def fmt_ms(x):
    return "-" if x is None else f"{x * 1e3:.2f}"


def fmt_pct(x):
    return "-" if x is None else f"{x * 100:+.1f}%"


def fmt_gib(x):
    return "-" if x is None else f"{x / 2**30:.2f}"


def format_table(table: list[dict]) -> str:
    head = ("plan", "pred step ms", "step ms", "err", "pred comm ms", "comm ms", "err", "kernel ms",
            "pred exp ms", "exp ms", "err", "pred mem GiB", "mem GiB", "err", "loss first->last")
    body = [(r["strategy"], fmt_ms(r["pred_step_s"]), fmt_ms(r["step_s"]), fmt_pct(r["step_err"]), fmt_ms(r["pred_comm_s"]),
             fmt_ms(r.get("comm_alone_s")), fmt_pct(r["comm_err"]), fmt_ms(r["comm_s"]),
             fmt_ms(r.get("pred_exposed_comm_s")), fmt_ms(r.get("exposed_comm_s")),
             fmt_pct(r.get("exposed_err")), fmt_gib(r["pred_memory_bytes"]), fmt_gib(r["memory_bytes"]),
             fmt_pct(r["memory_err"]), f"{r['loss_first']:.4f}->{r['loss_last']:.4f}") for r in table]
    w = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w[i]) if i == 0 else str(c).rjust(w[i]) for i, c in enumerate(x))
                     for x in [head] + body)


COLUMNS = ("pred comm: the plan's total communication time per step; comm ms: the same step's collectives "
           "replayed alone (same calls, sizes, order and groups, no compute): on GPUs the time inside their NCCL kernels, "
           "each the minimum over the devices (no waiting for a late peer), the figure the communication target "
           "compares (the replay's wall time, which adds the host's dispatch, is in breakdown.txt); kernel ms: time inside the NCCL kernels of a training step (torch "
           "profiler), which also counts their waiting for the peer and their slowdown by the compute they overlap. "
           "exp ms: the part of the NCCL kernel time during which no other GPU activity runs; pred exp: the plan's "
           "exposed communication.")


def format_breakdown(records: list[dict]) -> str:
    """Per plan: device time per step by kernel family (ms), the replayed redistribution and
    gradient sync (ms), and the memory peaks of one step by phase (GiB), where measured."""
    fams, phases = [], []
    for r in records:
        m = r.get("measured") or {}
        fams += [f for f in (m.get("device_time_s") or {}) if f not in fams]
        phases += [p for p in (m.get("peak_memory_phases_bytes") or {}) if p not in phases]
    head = ["plan", "step ms", "host issue ms", "idle ms"] + [f"{f} ms" for f in fams] + \
        ["replay red ms", "replay sync ms", "pred red ms", "pred sync ms", "replay wall ms"] + \
        [f"{p} GiB" for p in phases]
    body = []
    for r in records:
        if r.get("error"):
            continue
        m, p = r["measured"], r.get("predicted", {})
        dev, ph = m.get("device_time_s") or {}, m.get("peak_memory_phases_bytes") or {}
        body.append([r["strategy"], fmt_ms(m.get("step_s")), fmt_ms(m.get("host_issue_s")), fmt_ms(m.get("device_idle_s"))] +
                    [fmt_ms(dev.get(f)) for f in fams] +
                    [fmt_ms(m.get("redistribution_alone_s")), fmt_ms(m.get("grad_sync_alone_s")),
                     fmt_ms(p.get("redistribution_s")), fmt_ms(p.get("grad_sync_s")), fmt_ms(m.get("comm_alone_wall_s"))] +
                    [fmt_gib(ph.get(q)) for q in phases])
    w = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w[i]) if i == 0 else str(c).rjust(w[i]) for i, c in enumerate(x))
                     for x in [head] + body)


def format_targets(t: dict) -> str:
    lines = []
    for name, v in t.items():
        val = v["value"]
        shown = "-" if val is None else f"{val:.3f}" if name == "spearman_step" else f"{val * 100:.1f}%"
        state = "n/a (no prediction)" if v["met"] is None else "met" if v["met"] else "NOT met"
        lines.append(f"{name}: {shown} (target {v['target']}): {state}")
    return "\n".join(lines)


def summary(records: list[dict]) -> dict:
    table = rows(records)
    first = next((r for r in records if not r.get("error")), records[0])
    failed = [{"strategy": r["strategy"], "error": r["error"]} for r in records if r.get("error")]
    if not table:
        raise UserError("every executed plan failed (" + ", ".join(f"{f['strategy']}: {f['error']}" for f in failed)
                        + "): run plans that fit the devices")
    return {"failed": failed, "kind": SUMMARY_KIND, "version": VERSION, "model": first["model"], "cluster": first["cluster"],
            "device": first["device"], "backend": first["backend"], "dtype": first["dtype"], "rows": table,
            "targets": targets(table)}


def markdown(s: dict, command: str = "") -> str:
    """The summary as a markdown block for reports/records/."""
    c = s["cluster"]
    lines = [f"Executed plans: {s['model'].get('name', '')} on {c['nodes']} x {c['gpus_per_node']} {s['device']} "
             f"({s['backend']}, {s['dtype']}){f'; command: `{command}`' if command else ''}", "", "```",
             format_table(s["rows"]), "```", "", COLUMNS, ""]
    lines += [f"- {line}" for line in format_targets(s["targets"]).splitlines()]
    lines += [f"- not measured: {f['strategy']}: {f['error']}" for f in s.get("failed", [])]
    return "\n".join(lines) + "\n"
