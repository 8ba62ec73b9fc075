"""Resharding results for the report: the planned cases (strategies x solvers against
the lower bound), the pipeline schedules, and executed plans (checked and timed)."""
from __future__ import annotations

from dataclasses import dataclass, field

from calibrate.records import Record
from calibrate.schema import AMOUNT, COUNT, REAL, check

_MESH = {"shape": [COUNT]}
# the body as the report reads it
SCHEMA = {
    "profile?": str,
    "cases?": [{"case": str, "unit_tasks": COUNT, "lower_bound": AMOUNT, "times": {str: {str: AMOUNT}},
                "task": {"src_spec": str, "dst_spec": str, "src_mesh": _MESH, "dst_mesh": _MESH},
                "chosen": {"makespan": AMOUNT}}],
    "pipelines?": [{"name": str, "schedules": {str: {
        "makespan": AMOUNT, "throughput": AMOUNT, "hidden": REAL, "exposed": REAL, "peak_activations": list,
        "hidden_by_phase?": dict,
        "intervals": [{"lane": str, "kind": str, "start": REAL, "end": REAL}]}}}],
    "executed?": [{"measured_s": AMOUNT, "predicted_s": AMOUNT}],
}


@dataclass
class ReshardResults(Record):
    KIND = "reshard"
    VERSION = 1
    WHAT = "resharding results file"
    FIX = "write one with python -m autotune reshard --results FILE"

    profile: str
    cases: list[dict] = field(default_factory=list)
    pipelines: list[dict] = field(default_factory=list)
    executed: list[dict] = field(default_factory=list)   # rows of kernels.reshard.harness.run_plans

    @classmethod
    def from_body(cls, d: dict, origin: str) -> "ReshardResults":
        # files written before "executed" hold the GPU check's rows under "gpu"
        check(dict(d, executed=d.get("executed", d.get("gpu", []))), SCHEMA, origin, cls.FIX)
        return cls(d.get("profile", ""), d.get("cases", []), d.get("pipelines", []),
                   d.get("executed", d.get("gpu", [])))
