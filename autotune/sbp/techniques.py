"""The training techniques of a plan, as Megatron-LM and torchtitan users set them: one small record the plan
carries beside its placements (``Techniques.to_dict``, the plan's "techniques" field), priced by the step model
(``autotune.pipeline``, ``autotune.sbp.memory.Mode``) and to be run by the execution layer.

- ``recompute``: "none", "selective" (Megatron's: the attention core, its probabilities not kept) or "full";
- ``schedule`` and ``virtual_stages``: the pipeline schedule, chunks a rank under interleaved 1F1B;
- ``sequence_parallel``: norms, residual adds and dropout on sequence shards of the tensor-parallel group;
- ``zero_stage``: 1 optimizer states, 2 also gradients, sharded over the data-parallel group (3 is FSDP,
  the plan's "sharding" field);
- ``context_parallel``: ranks a sequence is split over (ring attention's K/V passed around): not priced yet.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

NOT_PRICED = ("context_parallel",)  # fields the step model does not price yet (``missing``)


@dataclass(frozen=True)
class Techniques:
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    context_parallel: int = 1

    @classmethod
    def of(cls, d: dict) -> "Techniques":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_dict(self) -> dict:
        return asdict(self)

    def missing(self) -> list[str]:
        """The techniques set here that the step model does not price yet, by name."""
        return [f"context parallelism ({self.context_parallel})"] if self.context_parallel > 1 else []
