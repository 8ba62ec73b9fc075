"""Plans as a user holds them: the plan the search builds (``typed.py``, ``build.py``; plan.json: ``file.py``; no torch) and ``apply`` (``autotune.apply``,
torch: place a user's nn.Module as a plan says). ``import autotune.plan`` does not import torch."""
from autotune.plan.file import PlanFile, load_plan
from autotune.plan.typed import (ApplyPath, Costs, FineMesh, LayerPlan, ModelSpec, Plan, Stage, TypedPlan, WeightPlan,
                                 dtensor_placement)

__all__ = ["ApplyPath", "Costs", "FineMesh", "LayerPlan", "ModelSpec", "Plan", "PlanFile", "Stage", "TypedPlan",
           "WeightPlan", "dtensor_placement", "load_plan", "apply", "micro_batches", "data_piece", "param_groups"]


def __getattr__(name):
    if name in ("apply", "micro_batches", "data_piece", "param_groups"):
        import autotune
        return getattr(autotune, name)
    raise AttributeError(f"module 'autotune.plan' has no attribute {name!r}")
