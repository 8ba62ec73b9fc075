"""Tables of the project's records as Markdown, rendered from the JSON records themselves, so
that no figure in ``reports/records/*.md`` is typed by hand.

A record renders as a provenance line (kind, development or evaluation, date, machine, commit,
command; "not recorded" where the record lacks one) and its table (``render``), one renderer
per record kind (``RENDERERS``). A record is a JSON file with a kind header, a folder of
execute results (``python -m autotune execute --out DIR``), or the one-GPU transformer check's
output, which has no header and is known by its fields. In a Markdown file, the lines between

    <!-- table: nccl_tune_h200x2_2026-11-23_run3.json -->
    <!-- end table -->

(the path relative to the Markdown file) are the rendering of that record: ``update``
rewrites them, ``python -m reports tables --check FILE.md`` fails where one is stale.
The prose around the blocks explains; the blocks are data.
"""
from __future__ import annotations

import re
from pathlib import Path

from calibrate.errors import UserError
from calibrate.jsonfile import read_json
from calibrate.measure import stats
from calibrate.outputs import write_atomic
from calibrate.records import kind_of

from autotune.execute.result import fmt_ms, fmt_pct

EXECUTE_FOLDER = "commtune.execute-result"   # a folder of them (python -m autotune execute --out DIR)
BLOCK = re.compile(r"(<!-- table: (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _provenance(kind: str, basis: str, d: dict) -> str:
    """Kind, development or evaluation, date, machine, commit and command: each as the record holds it."""
    none = "not recorded"
    parts = [f"kind `{kind}`", f"**{basis}**", f"date {d.get('date') or none}", f"device {d.get('device') or none}",
             f"commit `{d['commit'][:12]}`" if d.get("commit") else f"commit {none}",
             f"command `{d['command']}`" if d.get("command") else f"command {none}"]
    if d.get("heldout", {}).get("sha256"):
        parts.append(f"held-out declaration sha256 `{d['heldout']['sha256'][:12]}`")
    return "; ".join(parts)


def _nccl(path: Path, d: dict, evaluation: bool) -> str:
    from autotune.nccl import record as rec

    r = (rec.EvaluateRecord if evaluation else rec.TuneRecord).load(path)
    arms = list(dict.fromkeys(a["name"] for c in r.compare for a in c.arms if a["name"] not in ("default", "tuned")))
    head = ["collective", "size", "default us", "tuned us", "default / tuned"] + [f"{a} / tuned" for a in arms] + \
        ["setting", "#wrong", "NCCL ran (default -> tuned)", "missing"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in r.compare:
        missing = "; ".join(f"{a['name']}: {a['status']}" for a in c.arms if a["status"] != "ok")
        cells = [c.collective, str(c.bytes), _f(c.default_us), _f(c.tuned_us), _f(c.ratio, ".3f")]
        cells += [_f(None if c.arm_us(a) is None or c.tuned_us is None else c.arm_us(a) / c.tuned_us, ".3f")
                  for a in arms]
        ran = f"{c.default_runs or '?'} -> {c.tuned_runs or '?'}" if c.default_runs or c.tuned_runs else "-"
        cells += [c.setting, str(max(c.default_wrong, 0) + max(c.tuned_wrong, 0)), ran, missing]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if r.seconds:
        lines.append("- seconds: " + ", ".join(f"{k} {_f(v, '.1f')}" for k, v in r.seconds.items()))
    if not evaluation:
        lines.append(f"- sweep: {len(r.sweep)} points measured, {len(r.pruned)} not measured (pruned), "
                     f"#wrong {sum(max(s.wrong, 0) for s in r.sweep)}; table {len(r.table_rows)} rows"
                     + ("; plugin counters (rank 0): " + ", ".join(f"{k} {v}" for k, v in r.plugin_counters.items())
                        if r.plugin_counters else ""))
    for coll, s in rec.summary(r.compare).items():
        verdicts = ", ".join(f"{v['target']} {v['state']}" for v in s.get("verdicts", []))
        parts = ", ".join(f"{n} {_f(x, '.3f')}x" for n, x in s["against_default"].items())
        lines.append(f"- {coll}: default / tuned geomean {_f(s['geomean'], '.3f')}x, worst {_f(s['worst'], '.3f')}x, "
                     f"at the largest size {_f(s['largest_ratio'], '.3f')}x; each arm over the default: "
                     f"{parts or '-'}; {verdicts}")
    return "\n".join(lines)


def _schedule_dev(path: Path, d: dict) -> str:
    from autotune.schedule.result import NCCL, TuneResult

    r = TuneResult.load(path)
    lines = ["| collective | band size | choice | measured us | NCCL us | NCCL / choice | Spearman (as ranked) |",
             "|---|---|---|---|---|---|---|"]
    for c in r.collectives:
        for b in c.bands:
            row = b.row(b.choice)
            mine = b.nccl_measured_us if b.choice == NCCL else (row.measured_us if row else None)
            lines.append(f"| {c.collective} | {b.rep} | {b.choice} | {_f(mine)} | {_f(b.nccl_measured_us)} | "
                         f"{_f(b.nccl_measured_us / mine if mine and b.nccl_measured_us else None, '.3f')} | "
                         f"{_f(b.spearman)} |")
    lines.append("")
    if r.seconds:
        lines.append("- seconds: " + ", ".join(f"{k} {_f(v, '.1f')}" for k, v in r.seconds.items()))
    for c in r.collectives:
        s = c.summary
        below = s.get("bands_below_0.8") or []
        lines.append(f"- {c.collective} (development: the best of the measured candidates per band against NCCL "
                     f"beside them, at the sizes chosen on; not a figure to quote): over NCCL geomean "
                     f"{_f(s.get('speedup_over_nccl_geomean'), '.3f')}x (worst band "
                     f"{_f(s.get('speedup_over_nccl_min'), '.3f')}x, {s.get('bands_nccl', 0)} of {s.get('bands', 0)} "
                     f"bands left to NCCL), over the fixed {c.fixed_baseline or '-'} "
                     f"{_f(s.get('speedup_over_fixed_geomean'), '.3f')}x; Spearman min {_f(s.get('spearman_min'))} "
                     f"(with the per-protocol correction {_f(s.get('spearman_corrected_min'))}), "
                     f"{len(below)} band(s) below 0.8" + (f" ({', '.join(map(str, below))})" if below else ""))
    return "\n".join(lines)


def _schedule_eval(path: Path, d: dict) -> str:
    from autotune.schedule.evaluate import NCCL_BEST, EvaluateRecord, summary

    r = EvaluateRecord.load(path)
    arms = list(dict.fromkeys(a["name"] for p in r.points for a in p.arms))
    head = ["collective", "size"] + [f"{a} us" for a in arms] + ["NCCL / tuned", "NCCL best / tuned",
                                                                 "NCCL best ran", "tuned ran", "missing"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in r.points:
        t, n, b = p.median_us("tuned"), p.median_us("nccl"), p.median_us(NCCL_BEST)
        missing = "; ".join(f"{a['name']}: {a['status']}" for a in p.arms if a["status"] != "ok")
        lines.append("| " + " | ".join([p.collective, str(p.bytes)] + [_f(p.median_us(a)) for a in arms]
                                       + [_f(n / t if n and t else None, ".3f"), _f(b / t if b and t else None, ".3f"),
                                          p.nccl_best or "-", p.tuned_choice, missing]) + " |")
    lines.append("")
    if r.nccl_run:
        lines.append(f"- NCCL's best setting per size: the table of {r.nccl_run['path']} ({r.nccl_run['device']}, "
                     f"NCCL {r.nccl_run['nccl_version']}), chosen from its development sweep")
    for k in r.skipped:
        lines.append(f"- {k['collective']} {k['bytes']} B: not measured ({k['why']})")
    for coll, s in summary(r.points, r.skipped).items():
        knobs = ", ".join(f"{k} {_f(v['share_geomean'], '.3f')}x ({v['timed']}/{v['sizes']} sizes)"
                          for k, v in s["knob_share"].items())
        lines.append(f"- {coll}: over NCCL geomean {_f(s['over_nccl_geomean'], '.3f')}x (worst "
                     f"{_f(s['over_nccl_min'], '.3f')}x), over NCCL's best setting geomean "
                     f"{_f(s['over_nccl_best_geomean'], '.3f')}x (worst {_f(s['over_nccl_best_min'], '.3f')}x), over "
                     f"the best fixed {s['fixed'] or '-'} geomean {_f(s['over_fixed_geomean'], '.3f')}x; "
                     + (f"each knob's share {knobs}; " if knobs else "")
                     + ", ".join(f"{v['target']} {v['state']}" for v in s["verdicts"]))
    return "\n".join(lines)


def _compute_eval(path: Path, d: dict) -> str:
    from calibrate.computeeval import EvaluateRecord, pct, summary

    r = EvaluateRecord.load(path)
    lines = ["| item | shape | part | predicted us | measured us | error | status |", "|---|---|---|---|---|---|---|"]
    for row in r.rows:
        us = [None if x is None else x * 1e6 for x in (row.predicted_s, row.measured_s)]
        status = row.status + (f" ({row.reason})" if row.reason else "")
        lines.append(f"| {row.item} | {row.shape} | {row.part} | {_f(us[0], '.1f')} | {_f(us[1], '.1f')} | "
                     f"{pct(row.rel_err)} | {status} |")
    lines += ["", "Error: (predicted - measured) / measured, positive where the model is too slow."]
    for part, s in summary(r.rows).items():
        lines.append(f"- {part}: {s['measured']} of {s['rows']} measured; median error {pct(s['median_err'])}, "
                     f"median |error| {pct(s['median_abs_err'], '')}, worst |error| {pct(s['worst_abs_err'], '')}; Spearman "
                     f"{_f(s['spearman'], '.3f')}, Kendall {_f(s['kendall'], '.3f')}"
                     + (f"; {len(s['missing'])} without a figure (the rows say why)" if s["missing"] else ""))
    return "\n".join(lines)


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return stats.geomean(xs) if xs else None


BENCH_RANGES = ((0, 256 << 10, "1 B..256 KiB"), (256 << 10, 64 << 20, "256 KiB..64 MiB"), ((64 << 20) + 1, 1 << 62, "> 64 MiB"))


def _bench(path: Path, d: dict) -> str:
    from kernels.interp.peer_table import human
    from kernels.interp.records import BenchRecord

    r = BenchRecord.load(path)
    lines = [f"Preset `{r.preset}`, {r.nranks} ranks; timing: {r.timing}.", "",
             "| collective | size | dtype | program | protocol | split | interp us | NCCL us | NCCL / interp | "
             "interp busbw GB/s | NCCL busbw GB/s | correct |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r.rows:
        ok = "yes" if row.get("correct") and row.get("nccl_correct", True) else f"NO {row.get('why', '')}".strip()
        lines.append(f"| {row['collective']} | {human(row['bytes'])} | {row.get('dtype', '-')} | {row.get('program', '-')} | "
                     f"{row.get('protocol', '-')} | {row.get('split', '-')} | {_f(row.get('interp_us'))} | "
                     f"{_f(row.get('nccl_us'))} | {_f(row.get('speedup'))} | {_f(row.get('interp_busbw_gbs'), '.1f')} | "
                     f"{_f(row.get('nccl_busbw_gbs'), '.1f')} | {ok} |")
    lines.append("")
    for (coll, dtype) in dict.fromkeys((row["collective"], row.get("dtype", "-")) for row in r.rows):
        rows = sorted((x for x in r.rows if x["collective"] == coll and x.get("dtype", "-") == dtype),
                      key=lambda x: x["bytes"])
        worst = min(rows, key=lambda x: x.get("speedup") or 0.0)
        ranges = ", ".join(f"{name} {_f(_geomean([x.get('speedup') for x in rows if lo <= x['bytes'] <= hi]))}x"
                           for lo, hi, name in BENCH_RANGES if any(lo <= x["bytes"] <= hi for x in rows))
        lines.append(f"- {coll} {dtype}: NCCL / interp geomean {_f(_geomean([x.get('speedup') for x in rows]))}x "
                     f"({ranges}); worst {_f(worst.get('speedup'))}x at {human(worst['bytes'])}; at "
                     f"{human(rows[-1]['bytes'])} {_f(rows[-1].get('speedup'))}x, busbw "
                     f"{_f(rows[-1].get('interp_busbw_gbs'), '.1f')} GB/s (NCCL {_f(rows[-1].get('nccl_busbw_gbs'), '.1f')}); "
                     f"{sum(1 for x in rows if x.get('correct'))} of {len(rows)} correct")
    return "\n".join(lines)


def _sweep(path: Path, d: dict) -> str:
    from kernels.interp.peer_table import human
    from kernels.interp.records import SweepRecord

    r = SweepRecord.load(path)
    lines = []
    for run in r.runs:
        rows = run.get("rows", [])
        lines += [f"Sweep `{run.get('sweep', '?')}`: {len(rows)} forced configurations, "
                  f"{sum(1 for x in rows if x.get('correct'))} correct; the machine's ceilings measured in the same run:",
                  "", "| ceiling | size | us | NCCL us beside it | GB/s |", "|---|---|---|---|---|"]
        for c in run.get("ceilings", []):
            nccl = c.get("nccl_us")
            lines.append(f"| {c['ceiling']} | {human(c['bytes']) if c['bytes'] else '-'} | {_f(c.get('us'))} | "
                         f"{_f(nccl if nccl == nccl else None)} | {_f(c.get('gbs'), '.1f') if c.get('gbs') else '-'} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def _peers(path: Path, d: dict) -> str:
    from kernels.interp import peer_table

    r = peer_table.load(path)
    summary = peer_table.summarize(r["rows"])
    targets = peer_table.targets_text(peer_table.targets(summary, r.get("peers", {}), int(r.get("nranks") or 2)))
    return "```\n" + peer_table.table(summary) + "\n```\n\n" + "\n".join(f"- {t}" for t in targets.splitlines())


def _tp_mlp(path: Path, d: dict) -> str:
    from calibrate.records import check_header
    from kernels.interp.cli.tp_mlp import RESULT_KIND

    check_header(d, RESULT_KIND, 1, "TP MLP record", "write one with python -m kernels tp-mlp --out FILE", repr(str(path)))
    lines = [f"hidden {d['hidden']}, ffn {d['ffn']} split over {d['nranks']} ranks, {d['dtype']}; timing: {d['timing']}; "
             "microseconds per step, speedup = NCCL / interp.", "",
             "| tokens | allreduce bytes | interp (graph) | NCCL (graph) | speedup | interp (eager) | NCCL (eager) | "
             "eager speedup | ok |", "|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        ok = "yes" if r.get("correct") else f"NO {r.get('graph_error', '')}".strip()
        lines.append(f"| {r['tokens']} | {r['allreduce_bytes']} | {_f(r.get('interp_step_us'), '.1f')} | "
                     f"{_f(r.get('nccl_step_us'), '.1f')} | {_f(r.get('speedup'), '.3f')} | "
                     f"{_f(r.get('interp_eager_step_us'), '.1f')} | {_f(r.get('nccl_eager_step_us'), '.1f')} | "
                     f"{_f(r.get('eager_speedup'), '.3f')} | {ok} |")
    return "\n".join(lines)


def _layer_lines(strategy: str, rows: list[dict]) -> list[str]:
    lines = [f"{strategy}, per step (forward and backward include the boxing into the layer; optimizer in the fwd "
             f"columns):", "", "| layer | kind | n | pred fwd ms | fwd ms | err | pred bwd ms | bwd ms | err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r.get('kind', '')} | {r.get('positions', '')} | {fmt_ms(r.get('pred_fwd_s'))} | "
                     f"{fmt_ms(r.get('fwd_s'))} | {fmt_pct(r.get('fwd_err'))} | {fmt_ms(r.get('pred_bwd_s'))} | "
                     f"{fmt_ms(r.get('bwd_s'))} | {fmt_pct(r.get('bwd_err'))} |")
    return lines + [""]


def _execute_summary(path: Path, d: dict) -> str:
    from autotune.execute import result

    s = result.load_summary(path)
    c = s["cluster"]
    lines = [f"{s['model'].get('name', '')} on {c['nodes']} x {c['gpus_per_node']} {s['device']} ({s['backend']}, "
             f"{s['dtype']})", "", "```", result.format_table(s["rows"]), "```", "", result.COLUMNS]
    if not any("comm_alone_s" in r for r in s["rows"]):
        lines.append("This record predates the replay of the collectives alone: its comm error compares the plan's "
                     "communication with the NCCL kernel time inside the step (kernel ms).")
    lines.append("")
    lines += [f"- {line}" for line in result.format_targets(s["targets"]).splitlines()]
    lines += [f"- not measured: {f['strategy']}: {f['error']}" for f in s.get("failed", [])]
    for strategy, rows in (s.get("layers") or {}).items():
        lines += [""] + _layer_lines(strategy, rows)
    return "\n".join(lines).rstrip("\n")


def _execute_folder(path: Path, d: dict) -> str:
    from autotune.execute import result

    return ("Device time per step by kernel family, the collectives replayed alone and the memory peaks by phase "
            "(`python -m autotune execute --summarize` writes the same as breakdown.txt):\n\n```\n"
            + result.format_breakdown(result.load_records(path)) + "\n```")


def _sbp_validate(path: Path, d: dict) -> str:
    from autotune.plan.validate import KIND, VERSION
    from calibrate.records import check_header

    check_header(d, KIND, VERSION, "plan validation record", "write one with python -m autotune validate --out DIR",
                 repr(str(path)))
    lines = [f"Backend {d['backend']}, {d['cluster']}, mode {d['mode']}, {d['dtype']}; predicted with the profile "
             f"`{d['profile']}`; plans in measured order.", "",
             "| plan | predicted s | measured s | error |", "|---|---|---|---|"]
    rows = sorted(d["plans"], key=lambda r: r["measured_s"])
    for r in rows:
        err = (r["predicted_s"] - r["measured_s"]) / r["measured_s"] if r["measured_s"] else None
        lines.append(f"| {r['plan']} | {r['predicted_s']:.4g} | {r['measured_s']:.4g} | "
                     f"{'-' if err is None else format(err * 100, '+.1f') + '%'} |")
    errs = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows if r["measured_s"]]
    lines += ["", f"- Spearman rank correlation (predicted vs measured, {len(rows)} plans): {_f(d.get('spearman'), '.3f')}; "
                  f"worst |error| {_f(max(errs) * 100 if errs else None, '.1f')}%"]
    return "\n".join(lines)


RESHARD_BASELINE = "greedy_in_order"   # the paper's load-balancing baseline, in Alpa's task order


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _reshard(path: Path, d: dict) -> str:
    from kernels.reshard.results import ReshardResults

    r = ReshardResults.load(path)
    lines = [f"Profile `{r.profile}`."]
    if r.cases:
        lines += ["", f"Strategies timed with the solver `{RESHARD_BASELINE}` (the paper's baseline); \"Alpa\": all-gather "
                  "over each slice's receivers (global_allgather); chosen: the plan picked (strategy and solver).", "",
                  "| case | unit tasks | send/recv s | local all-gather s | Alpa s | chosen s | lower bound s | "
                  "chosen / bound | x vs send/recv | x vs Alpa |", "|---|---|---|---|---|---|---|---|---|---|"]
        for c in r.cases:
            t = {k: v.get(RESHARD_BASELINE) for k, v in c["times"].items()}
            chosen, bound = c["chosen"]["makespan"], c["lower_bound"]
            sr, la, ga = t.get("send_recv"), t.get("local_allgather"), t.get("global_allgather")
            lines.append(f"| {c['case'].removeprefix('case ')} | {c['unit_tasks']} | {_f(sr, '.3f')} | {_f(la, '.3f')} | "
                         f"{_f(ga, '.3f')} | {_f(chosen, '.3f')} | {_f(bound, '.3f')} | {_f(chosen / bound, '.3f')} | "
                         f"{_f(sr / chosen if sr else None)} | {_f(ga / chosen if ga else None)} |")
    for pipe in r.pipelines:
        lines += ["", f"Pipeline `{pipe['name']}`: hidden = share of each transfer during which its consumer stage "
                  "computes, by phase (warm-up, steady, cool-down); exposed = makespan with minus without communication.",
                  "", "| schedule | iteration s | micro-batches/s | hidden, all | warm-up | steady | cool-down | exposed s | "
                  "peak activations per stage |", "|---|---|---|---|---|---|---|---|---|"]
        for name, sc in pipe["schedules"].items():
            ph = sc.get("hidden_by_phase") or {}
            steady = "(no steady phase)" if "steady" in ph and ph["steady"] is None else _pct(ph.get("steady"))
            lines.append(f"| {name} | {sc['makespan']:.3f} | {sc['throughput']:.2f} | {_pct(sc['hidden'])} | "
                         f"{_pct(ph.get('warmup'))} | {steady} | {_pct(ph.get('cooldown'))} | {sc['exposed']:.3f} | "
                         f"{sc['peak_activations']} |")
    if r.executed:
        lines += ["", "Executed plans (every destination tile checked):", "",
                  "| scenario | strategy | bytes | jobs | predicted ms | measured ms | measured / predicted | wrong |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in r.executed:
            lines.append(f"| {e.get('scenario', '-')} | {e.get('strategy', '-')} | {e.get('bytes', '-')} | "
                         f"{e.get('jobs', '-')} | {e['predicted_s'] * 1e3:.3f} | {e['measured_s'] * 1e3:.3f} | "
                         f"{_f(e['measured_s'] / e['predicted_s'] if e['predicted_s'] else None)} | {e.get('wrong', '-')} |")
        ratios = [e["measured_s"] / e["predicted_s"] for e in r.executed if e["predicted_s"]]
        lines += ["", f"- measured / predicted from {_f(min(ratios))} to {_f(max(ratios))}; wrong tiles "
                      f"{sum(e.get('wrong', 0) for e in r.executed)} in {len(r.executed)} plans"]
    return "\n".join(lines)


REPRODUCE_COLUMNS = ("case", "section", "paper", "ours", "difference pp", "micro-batch", "p0 cap", "status",
                     "p0 cap 4", "p0 cap none")


def _reproduce(path: Path, d: dict) -> str:
    from autotune.reproduce import RECORD, TOLERANCE_PP, VERSION, passes_by_cap, table
    from calibrate.records import check_header

    check_header(d, RECORD, tuple(range(1, VERSION + 1)), "reproduction record",
                 "write one with python -m autotune reproduce autoddl --out DIR", repr(str(path)))
    rows = table(d["rows"])
    cols = [c for c in REPRODUCE_COLUMNS if any(r[c] != "-" for r in rows)] if d.get("config") else \
        ["case", "section", "paper", "ours", "difference pp", "micro-batch", "status"]
    lines = [f"Configuration: {d.get('config') or 'not recorded (version 1)'}; pass: the paper's winner and reduction "
             f"within {TOLERANCE_PP:g} pp.", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    passed = sum(r["status"] == "pass" for r in d["rows"])
    by_cap = ", ".join(f"{n} under p0 cap {k}" for k, n in passes_by_cap(d["rows"]).items()) if d.get("config") else ""
    lines += ["", f"- {passed} of {len(rows)} cases pass" + (f" ({by_cap})" if by_cap else "")]
    return "\n".join(lines)


TRANSFORMER_CHECK = "transformer-check"   # tests/gpu/transformer_check.py --out: no header; known by its fields


def _transformer(path: Path, d: dict) -> str:
    import statistics

    rows = d["rows"]
    lines = [f"Shapes sha256 `{d['shapes_sha256']}`, recomputation {d['recompute']}; error = (predicted - measured) / "
             "measured (positive: over-predicted).", "",
             "| shape | set | family | predicted ms | measured ms | error | predicted GiB | peak GiB | error | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['id']} | {r['set']} | {r.get('family', '-')} | {_f(r.get('pred_step_s') and r['pred_step_s'] * 1e3)} | "
                     f"{_f(r.get('step_s') and r['step_s'] * 1e3)} | {fmt_pct(stats.rel_err(r.get('pred_step_s'), r.get('step_s')))} | "
                     f"{_f(r.get('pred_bytes') and r['pred_bytes'] / 2**30)} | {_f(r.get('peak_bytes') and r['peak_bytes'] / 2**30)} | "
                     f"{fmt_pct(stats.rel_err(r.get('pred_bytes'), r.get('peak_bytes')))} | {r.get('note') or ''} |")
    lines.append("")
    for kind in dict.fromkeys(r["set"] for r in rows):
        part = [r for r in rows if r["set"] == kind]
        parts = []
        for what, pk, mk in (("step", "pred_step_s", "step_s"), ("memory", "pred_bytes", "peak_bytes")):
            errs = [(r["id"], e) for r in part for e in (stats.rel_err(r.get(pk), r.get(mk)),) if e is not None]
            if not errs:
                parts.append(f"{what}: no figure")
                continue
            worst = max(errs, key=lambda x: abs(x[1]))
            parts.append(f"{what} median {fmt_pct(statistics.median(e for _, e in errs))}, median |error| "
                         f"{statistics.median(abs(e) for _, e in errs) * 100:.1f}%, worst {fmt_pct(worst[1])} ({worst[0]})")
        lines.append(f"- {kind} ({len(part)} shapes): " + "; ".join(parts))
    return "\n".join(lines)


RENDERERS = {
    "commtune.nccl-tune": ("development", lambda p, d: _nccl(p, d, False)),
    "commtune.nccl-evaluate": ("evaluation", lambda p, d: _nccl(p, d, True)),
    "schedule-tune": ("development", _schedule_dev),
    "commtune.schedule-evaluate": ("evaluation", _schedule_eval),
    "calibrate.compute-evaluate": ("evaluation", _compute_eval),
    "commtune.execute-summary": ("development", _execute_summary),
    "reshard": ("development", _reshard),
    "commtune.autoddl-reproduction": ("development", _reproduce),
    TRANSFORMER_CHECK: ("evaluation for the held-out rows, development for the others", _transformer),
    "commtune.sbp-validate": ("development", _sbp_validate),   # plans not declared held out
    EXECUTE_FOLDER: ("development", _execute_folder),
    "commtune.interp-peers": ("development", _peers),
    "commtune.interp-tp-mlp": ("development", _tp_mlp),
    "kernels-bench": ("development", _bench),
    "interp-tune": ("development", _sweep),   # "basis" evaluation: a --heldout run
}


def _read(path: Path) -> tuple[str | None, dict]:
    """A record's kind and content; a folder of execute results is one record (its first plan's header)."""
    if path.is_dir():
        from autotune.execute.result import load_records

        return EXECUTE_FOLDER, load_records(path)[0]
    d = read_json(path, "record", f"give one of the records {', '.join(RENDERERS)} (a JSON file, or a folder of "
                  "execute results)")
    kind = kind_of(d)
    if kind is None and isinstance(d, dict) and {"shapes_sha256", "recompute", "rows"} <= set(d):
        kind = TRANSFORMER_CHECK
    return kind, d


def render(path: str | Path) -> str:
    """The provenance line and the table of one record."""
    path = Path(path)
    kind, d = _read(path)
    if kind not in RENDERERS:
        raise UserError(f"{str(path)!r} is of kind {kind!r}; tables are rendered for {', '.join(RENDERERS)}")
    basis, fn = RENDERERS[kind]
    basis = d.get("basis") if d.get("basis") in ("development", "evaluation") else basis
    name = f"{path.parent.name}/{path.name}" if path.is_dir() else path.name
    return f"Rendered from `{name}`: {_provenance(kind, basis, d)}.\n\n{fn(path, d)}\n"


def update(md: str | Path, check: bool = False) -> list[str]:
    """Rewrite every table block of ``md`` from its record (``check``: write nothing); the stale blocks' paths."""
    md = Path(md)
    text = md.read_text()
    stale = []

    def sub(m):
        body = render(md.parent / m.group("path"))
        if body != m.group("body"):
            stale.append(m.group("path"))
        return m.group(1) + body + m.group(4)

    new = BLOCK.sub(sub, text)
    if not check and new != text:
        write_atomic(md, new, "document")
    return stale
