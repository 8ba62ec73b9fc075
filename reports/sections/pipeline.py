"""The pipeline stages of a pipelined plan (``Plan.stages``, autotune.pipeline.record): a table
per stage and the simulated schedule as a timeline, one lane per stage."""
from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from reports.html import Section


def stage_table(plan) -> pd.DataFrame:
    rows = []
    for i, s in enumerate(plan.stages):
        sub = s.plan.cluster
        rows.append({
            "stage": i, "layers": f"{s.first_layer} .. {s.last_layer}", "blocks": s.blocks,
            "submesh": f"{sub.nodes} x {sub.gpus_per_node}", "in flight": s.inflight,
            "forward ms": s.forward_s * 1e3, "backward ms": s.backward_s * 1e3,
            "boundary ms (fwd/bwd)": f"{s.boundary_forward_s * 1e3:.3g} / {s.boundary_backward_s * 1e3:.3g}",
            "grad sync s (exposed)": f"{s.grad_sync_s:.3g} ({s.exposed_sync_s:.3g})",
            "memory GiB": s.memory_bytes / 2**30,
            **({"apply path (host ms / micro-batch)": f"{s.plan.apply_path} ({s.host_pass_s * 1e3:.3g})"}
               if s.host_pass_s is not None else {}),
        })
    return pd.DataFrame(rows)


def timeline_fig(plan):
    """Forward (light) and backward (dark) of every micro-batch on each stage's lane, then the exposed
    gradient sync and the optimizer (hatched)."""
    stages = plan.stages
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.3 * len(stages)))
    for i, s in enumerate(stages):
        spans = {"F": [], "B": []}
        for kind, _, a, b in s.timeline:
            spans[kind].append((a, b - a))
        ax.broken_barh(spans["F"], (i - 0.4, 0.8), facecolors="tab:blue", alpha=0.45)
        ax.broken_barh(spans["B"], (i - 0.4, 0.8), facecolors="tab:blue")
        ax.broken_barh([(s.end_s, s.exposed_sync_s + s.optimizer_s)], (i - 0.4, 0.8), facecolors="tab:orange",
                       hatch="//")
    ax.set_yticks(range(len(stages)), [f"stage {i}" for i in range(len(stages))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the step")
    return fig


def add(sec: Section, plan) -> None:
    pl, t = plan.pipeline, plan.costs
    sec.heading("Pipeline stages")
    sec.text(f"{len(plan.stages)} stages, schedule {pl.schedule}, {plan.micro_batches} micro-batches, blocks per "
             f"stage {list(pl.split)}; simulated step {t.step_s:.4g} s, of which bubble {t.bubble_s:.4g} s; "
             f"boundary transfers {t.boundary_s * 1e3:.3g} ms per micro-batch over all boundaries, both ways.")
    sec.table(stage_table(plan), "Per stage: its layers, submesh, the micro-batches whose activations it keeps "
                                 "(the schedule's warm-up), per-micro-batch forward and backward, the boundary to "
                                 "the next stage (resharding planner), gradient sync and peak memory; where the "
                                 "profile has host figures, the path apply places the stage by and the host's "
                                 "time to issue a micro-batch on it (a floor under forward + backward).")
    sec.figure(timeline_fig(plan), "The simulated schedule: forward (light), backward (dark), then each stage's "
                                   "exposed gradient sync and optimizer (hatched).")
