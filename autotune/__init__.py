"""Stage 2 of the flow: plans from fitted profiles (SBP search, collective schedules, cross-mesh resharding;
``autotune.search(model, cluster, profile, ...)``, the library call of ``python -m autotune``: ``autotune.planner``), and
the execution layer ``autotune.apply``: ``autotune.apply(plan, model)`` places a user's nn.Module as a plan says,
``autotune.apply_pipeline(plan, model)`` runs a pipelined plan's stage on it; torch is imported on first use, not
by ``import autotune``."""

_BATCH = ("micro_batches", "data_piece", "data_world", "param_groups")
_GRADS = ("accumulate", "no_sync")


def __getattr__(name):
    if name == "apply":  # the package, callable as the function
        import autotune.apply as module
        return module
    if name in _BATCH:
        from autotune.apply import batch
        return getattr(batch, name)
    if name in _GRADS:
        from autotune.apply import grads
        return getattr(grads, name)
    if name == "search":
        from autotune.planner import search
        return search
    if name == "apply_pipeline":
        from autotune.apply.pipeline import apply_pipeline
        return apply_pipeline
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
