"""Report sections, one module per stage of the flow, registered by result kind.

Every results directory or file that the project writes carries a ``kind``
(``meta.json``'s ``kind`` for directories, the top-level ``kind`` or ``schema``
of JSON files). ``REGISTRY`` maps that kind to the function that turns a list
of such results into report sections: ``builder(paths: list[Path]) -> list[Section]``.
Modules are imported lazily, so a section's heavy imports cost nothing until used.
"""
from __future__ import annotations

from calibrate.registry import load

# kind -> "module:function"
REGISTRY: dict[str, str] = {
    "calibration": "reports.sections.calibration:build",
    "commtune.profile": "reports.sections.fit:build",
    "commtune.health": "reports.sections.health:build",
    "kernels-bench": "reports.sections.interp:build",
    "commtune.sbp-plan": "reports.sections.sbp:build",
    "commtune.autoddl-reproduction": "reports.sections.sbp:build_reproduction",
    "commtune.execute-summary": "reports.sections.execute:build",
    "reshard": "reports.sections.reshard:build",
    "schedule-tune": "reports.sections.schedule:build",
    "commtune.nccl-tune": "reports.sections.nccl_tuner:build",
}


def builder(kind: str):
    target = REGISTRY.get(kind)
    if target is None:
        return None
    return load(target)
