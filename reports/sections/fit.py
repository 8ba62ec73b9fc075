"""Report section for fitted profiles: segments over the measured points,
residuals, held-out errors, alpha and beta beside the link's peak, where the
curves step, and the errors at random sizes when the profile records them."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from calibrate.collectives import Collective
from calibrate.fit import fit_quality_problem, implied_busbw, predict
from calibrate.profile import Profile
from reports.html import Section


def _profile_section(prof: Profile) -> Section:
    sec = Section(f"Fitted profile {prof.name!r}")
    prov = prof.provenance
    sec.text(f"Provenance: {prov.get('kind')}; timing mode {prof.timing_mode}; hardware {prof.hardware}; "
             f"software {prof.software}. {prov.get('method', '')}")
    rows, peak = [], prof.hardware.get("link_peak_GBps")
    for tier, colls in prof.tiers.items():
        for coll_name, by_p in colls.items():
            coll = Collective.parse(coll_name)
            for p, model in by_p.items():
                p = int(p)
                # an interpolated model has a segment between each two measured sizes: its ends stand for it
                shown = model.segments if model.method != "interpolate" or len(model.segments) < 3 else \
                    [model.segments[0], model.segments[-1]]
                for s in shown:
                    i = model.segments.index(s)
                    rows.append({"tier": tier, "collective": coll_name, "p": p, "segment": i,
                                 "from_bytes": s.min_bytes, "to_bytes": s.max_bytes,
                                 "alpha_us": s.alpha * 1e6,
                                 "beta_ns_per_MB": s.beta * 1e9 * 1e6,
                                 "1/beta_GBps": (1 / s.beta / 1e9) if s.beta > 0 else float("inf"),
                                 "implied_busbw_GBps": implied_busbw(coll, p, model.segments) / 1e9,
                                 "link_peak_GBps": peak if peak else "unknown",
                                 **{f"heldout_{k}": v for k, v in model.validation.items()
                                    if k in ("median_abs_rel_err", "max_abs_rel_err", "held_out_points")}})
    measured = [(t, c, p, m) for t, cs in prof.tiers.items() for c, bp in cs.items() for p, m in bp.items()
                if m.points]
    if measured:
        ncol = 3
        nrow = (len(measured) + ncol - 1) // ncol
        fig, axes = plt.subplots(2 * nrow, ncol, figsize=(5 * ncol, 6.4 * nrow), squeeze=False,
                                 gridspec_kw={"height_ratios": [3, 1] * nrow})
        for k, (tier, coll_name, p, model) in enumerate(measured):
            ax, rax = axes[2 * (k // ncol), k % ncol], axes[2 * (k // ncol) + 1, k % ncol]
            coll, p = Collective.parse(coll_name), int(p)
            pts = np.asarray(model.points)
            n, t = pts[:, 0], pts[:, 1]
            grid = np.geomspace(n.min(), n.max(), 200)
            ax.loglog(n, t * 1e6, "o", ms=3, label="measured (median)")
            ax.loglog(grid, predict(coll, p, model.segments, grid) * 1e6, "-", label="fitted segments")
            marks = [s["at_bytes"] for s in model.switches] if model.method == "interpolate" else \
                [s.min_bytes for s in model.segments[1:]]
            for x in marks:
                ax.axvline(x, color="grey", lw=0.6, ls=":")
            ax.set_title(f"{tier} {coll_name} p={p}")
            ax.set_ylabel("time (us)")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
            rel = (predict(coll, p, model.segments, n) - t) / t * 100
            rax.semilogx(n, rel, ".-")
            rax.axhline(0, color="black", lw=0.6)
            rax.set_ylabel("residual %")
            rax.set_xlabel("size (bytes)")
            rax.grid(alpha=0.3)
        for k in range(len(measured), nrow * ncol):
            axes[2 * (k // ncol), k % ncol].axis("off")
            axes[2 * (k // ncol) + 1, k % ncol].axis("off")
        fig.tight_layout()
        sec.figure(fig, "Fitted segments over the measured medians (log-log), and residuals in percent.")
    poor = []
    for tier, colls in prof.tiers.items():
        for coll_name, by_p in colls.items():
            for p, model in by_p.items():
                problem = fit_quality_problem(model.validation.get("r2_log_time"),
                                              model.validation.get("max_abs_rel_err"))
                if problem:
                    poor.append(f"{tier}/{coll_name} at p={p}: {problem}")
    if poor:
        sec.heading("Poor fits")
        sec.text("These fits predict their own held-out sizes badly, so their predictions are not to be "
                 "trusted: " + "; ".join(poor) + ". The timings were noisy: measure again with more iterations, "
                 "at most one rank per core, or in graph mode.")
    sec.heading("Segments, fitted alpha and beta, held-out errors")
    sec.table(pd.DataFrame(rows), "Held-out errors: fitted on every other size, judged on the others. An "
              "interpolated model (a segment between each two measured sizes) shows its first and last segment.",
              "{:.4g}")
    steps = [{"tier": tier, "collective": c, "p": int(p), **s}
             for tier, cs in prof.tiers.items() for c, bp in cs.items() for p, m in bp.items() for s in m.switches]
    if steps:
        sec.heading("Where the curves step")
        sec.table(pd.DataFrame(steps), "Per boundary between segments: the last size measured below it and the "
                  "first above (located: within 1/32 octave, by calibrate run --refine), and the jump in time.",
                  "{:.4g}")
    random = prov.get("random_validation")
    if random:
        sec.heading("Error at sizes drawn at random")
        sec.table(pd.DataFrame(random["summary"]), f"{random['method']}; not used by the fit.", "{:.3g}")
    return sec


def build(paths: list[Path]) -> list[Section]:
    return [_profile_section(Profile.load(p)) for p in paths]
