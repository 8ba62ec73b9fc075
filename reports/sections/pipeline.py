"""The pipeline stages of a pipelined plan (``plan["best"]["stages"]``, autotune.pipeline.record): a table
per stage and the simulated schedule as a timeline, one lane per stage."""
from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from reports.html import Section


def stage_table(plan: dict) -> pd.DataFrame:
    rows = []
    for s in plan["stages"]:
        sub = s["submesh"]
        rows.append({
            "stage": s["stage"], "layers": f"{s['first_layer']} .. {s['last_layer']}", "blocks": s["blocks"],
            "submesh": f"{sub['nodes']} x {sub['gpus_per_node']}", "in flight": s["inflight"],
            "forward ms": s["forward_s"] * 1e3, "backward ms": s["backward_s"] * 1e3,
            "boundary ms (fwd/bwd)": f"{s['boundary_forward_s'] * 1e3:.3g} / {s['boundary_backward_s'] * 1e3:.3g}",
            "grad sync s (exposed)": f"{s['grad_sync_s']:.3g} ({s['exposed_sync_s']:.3g})",
            "memory GiB": s["memory_bytes"] / 2**30,
            **({"apply path (host ms / micro-batch)": f"{s['apply_path']} ({s['host_pass_s'] * 1e3:.3g})"}
               if "apply_path" in s else {}),
        })
    return pd.DataFrame(rows)


def timeline_fig(plan: dict):
    """Forward (light) and backward (dark) of every micro-batch on each stage's lane, then the exposed
    gradient sync and the optimizer (hatched)."""
    stages = plan["stages"]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.3 * len(stages)))
    for s in stages:
        i = s["stage"]
        spans = {"F": [], "B": []}
        for kind, _, a, b in s["timeline"]:
            spans[kind].append((a, b - a))
        ax.broken_barh(spans["F"], (i - 0.4, 0.8), facecolors="tab:blue", alpha=0.45)
        ax.broken_barh(spans["B"], (i - 0.4, 0.8), facecolors="tab:blue")
        tail = s["exposed_sync_s"] + s["optimizer_s"]
        ax.broken_barh([(s["end_s"], tail)], (i - 0.4, 0.8), facecolors="tab:orange", hatch="//")
    ax.set_yticks(range(len(stages)), [f"stage {s['stage']}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the step")
    return fig


def add(sec: Section, plan: dict) -> None:
    pl, t = plan["pipeline"], plan["totals"]
    sec.heading("Pipeline stages")
    sec.text(f"{pl['stages']} stages, schedule {pl['schedule']}, {pl['micro_batches']} micro-batches, blocks per "
             f"stage {pl['split']}; simulated step {t['step_s']:.4g} s, of which bubble {t['bubble_s']:.4g} s; "
             f"boundary transfers {t['boundary_s'] * 1e3:.3g} ms per micro-batch over all boundaries, both ways.")
    sec.table(stage_table(plan), "Per stage: its layers, submesh, the micro-batches whose activations it keeps "
                                 "(the schedule's warm-up), per-micro-batch forward and backward, the boundary to "
                                 "the next stage (resharding planner), gradient sync and peak memory; where the "
                                 "profile has host figures, the path apply places the stage by and the host's "
                                 "time to issue a micro-batch on it (a floor under forward + backward).")
    sec.figure(timeline_fig(plan), "The simulated schedule: forward (light), backward (dark), then each stage's "
                                   "exposed gradient sync and optimizer (hatched).")
