"""The execution layer: ``apply`` (``place``: one module per path, ``PATHS``), ``apply_pipeline`` (``pipeline``:
torch.distributed.pipelining schedules over stages of any path), and the batch each rank takes (``batch``).
The package itself is callable: ``autotune.apply(plan, model, ...)`` is ``autotune.apply.place.apply``."""
import sys
import types


class _Apply(types.ModuleType):
    def __call__(self, plan, model, mesh=None, mapping=None, path: str = "auto"):
        from autotune.apply.place import apply
        return apply(plan, model, mesh, mapping, path)


sys.modules[__name__].__class__ = _Apply
