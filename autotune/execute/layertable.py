"""Predicted against measured, layer by layer (pure Python: no torch): each distinct layer's
forward and backward per step (over its positions in the chain and the micro-batches, its
in-boxing included), the optimizer step, and what the layers leave of the step (the data,
the loss's sync, the wait for the gradient sync, the gaps between kernels)."""
from __future__ import annotations

from autotune.execute.result import fmt_ms, fmt_pct
from calibrate.measure.stats import rel_err


def layer_rows(rec: dict) -> list[dict]:
    """One row per distinct layer name, in chain order, plus "optimizer" and "rest of step"
    (the clocked step's time less its layers and optimizer)."""
    m = rec.get("measured") or {}
    clock, pred = m.get("layer_clock"), rec.get("predicted_layers") or {}
    if not clock:
        return []
    mb = rec.get("micro_batches", 1)
    rows: dict[str, dict] = {}
    prev = None
    for lay in clock["layers"]:
        name = lay["name"]
        r = rows.setdefault(name, {"layer": name, "kind": lay["kind"], "positions": 0, "pred_fwd_s": 0.0,
                                   "fwd_s": 0.0, "pred_bwd_s": 0.0, "bwd_s": 0.0, "pred_opt_s": 0.0})
        r["positions"] += 1
        p, edge = pred.get(name), pred.get(f"{prev}->{name}", {}) if prev else {}
        for key, mkey in (("fwd", "forward_s"), ("bwd", "backward_s")):
            r[f"{key}_s"] = None if r[f"{key}_s"] is None or lay[mkey] is None else r[f"{key}_s"] + mb * lay[mkey]
            r[f"pred_{key}_s"] = None if p is None or r[f"pred_{key}_s"] is None else \
                r[f"pred_{key}_s"] + mb * (p[mkey] + edge.get(mkey, 0.0))
        r["pred_opt_s"] = None if p is None or r["pred_opt_s"] is None else r["pred_opt_s"] + p["optimizer_s"]
        prev = name
    out = list(rows.values())
    for r in out:
        r["fwd_err"], r["bwd_err"] = rel_err(r["pred_fwd_s"], r["fwd_s"]), rel_err(r["pred_bwd_s"], r["bwd_s"])
    opt = [r["pred_opt_s"] for r in out]
    pred_opt = None if None in opt else sum(opt)
    out.append({"layer": "optimizer", "kind": "", "positions": "", "pred_fwd_s": pred_opt, "fwd_s": clock.get("optimizer_s"),
                "fwd_err": rel_err(pred_opt, clock.get("optimizer_s")), "pred_bwd_s": None, "bwd_s": None, "bwd_err": None})
    measured = [x for r in out for x in (r["fwd_s"], r["bwd_s"]) if x is not None]
    pred = [x for r in out for x in (r["pred_fwd_s"], r["pred_bwd_s"]) if x is not None]
    step, pstep = clock.get("step_s", m.get("step_s")), (rec.get("predicted") or {}).get("step_s")
    out.append({"layer": "rest of step", "kind": "", "positions": "",
                "pred_fwd_s": pstep - sum(pred) if pstep is not None and pred else None,
                "fwd_s": step - sum(measured) if step is not None else None,
                "fwd_err": None, "pred_bwd_s": None, "bwd_s": None, "bwd_err": None})
    return out


def format_layers(records: list[dict]) -> str:
    """Per plan, the layer table (ms per step); plans without a layer clock are left out."""
    head = ["layer", "kind", "n", "pred fwd ms", "fwd ms", "err", "pred bwd ms", "bwd ms", "err"]
    blocks = []
    for rec in records:
        rows = [] if rec.get("error") else layer_rows(rec)
        if not rows:
            continue
        body = [[r["layer"], r["kind"], str(r["positions"]), fmt_ms(r["pred_fwd_s"]), fmt_ms(r["fwd_s"]), fmt_pct(r["fwd_err"]),
                 fmt_ms(r["pred_bwd_s"]), fmt_ms(r["bwd_s"]), fmt_pct(r["bwd_err"])] for r in rows]
        w = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(x)) for x in [head] + body]
        blocks.append(f"{rec['strategy']} (per step: {rec.get('micro_batches', 1)} micro-batches; forward and "
                      f"backward include the boxing into the layer; optimizer in the fwd columns)\n" + "\n".join(lines))
    return "\n\n".join(blocks)
