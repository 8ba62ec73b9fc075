"""What execute reads of a plan before it runs: the model kinds it runs (through ``autotune.apply``) and the
apply path asked for."""
from __future__ import annotations

from calibrate.errors import OptionError, UserError

from autotune.plan.typed import ApplyPath, Plan

KINDS = ("gpt", "llama")  # models the reference modules build (or --module's factory)
# where apply places a plan: "auto", the path it takes; "dtensor", any plan by DTensor (the same plan on the
# other path: the host's cost of each, ``autotune.execute.hostfit``)
APPLY_PATHS = ("auto", ApplyPath.DTENSOR.value)


def check_apply_path(name: str) -> None:
    if name not in APPLY_PATHS:
        raise OptionError("apply-path", f"{name!r}: use one of {', '.join(APPLY_PATHS)}")


def check_kind(plan: Plan) -> None:
    """Plans of other models (mlp, vgg, u-transformer) are searched and priced but not executed."""
    kind = plan.model.kind
    if kind not in KINDS:
        raise UserError(f"execute runs plans of transformer models ({', '.join(KINDS)}) through autotune.apply, "
                        f"not {kind}: search a plan for a gpt or llama model")


__all__ = ["APPLY_PATHS", "KINDS", "check_apply_path", "check_kind"]
