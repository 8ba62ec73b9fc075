"""Stage 2 of the flow: plans from fitted profiles (SBP search, collective
schedules, cross-mesh resharding; ``autotune.search(model, cluster, profile, ...)``, the
library call of ``python -m autotune``: ``autotune.planner``), and ``autotune.apply(plan, model)``, which
places a user's nn.Module as a plan says (``autotune.plan.place``), and
``autotune.apply_pipeline(plan, model)``, which runs a pipelined plan's stage on it
(``autotune.plan.stages``); torch is imported on first use, not by ``import autotune``."""


def __getattr__(name):
    if name in ("apply", "micro_batches", "data_piece", "param_groups"):
        from autotune.plan import place
        return getattr(place, name)
    if name == "search":
        from autotune.planner import search
        return search
    if name == "apply_pipeline":
        from autotune.plan import stages
        return stages.apply_pipeline
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
