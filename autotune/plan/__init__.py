"""Plans as a user holds them: the plan the search builds (``typed.py``, ``build.py``; plan.json: ``file.py``; no
torch). ``autotune.apply`` places a user's nn.Module as a plan says."""
from autotune.plan.file import PlanFile, load_plan
from autotune.plan.typed import (ApplyPath, Costs, FineMesh, LayerPlan, ModelSpec, Plan, Stage, TypedPlan, WeightPlan,
                                 dtensor_placement)

__all__ = ["ApplyPath", "Costs", "FineMesh", "LayerPlan", "ModelSpec", "Plan", "PlanFile", "Stage", "TypedPlan",
           "WeightPlan", "dtensor_placement", "load_plan"]

