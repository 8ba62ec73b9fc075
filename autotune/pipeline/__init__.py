"""Pipeline stages in the SBP search (issue 30): the model's blocks split among stages, each stage an SBP
plan on its own submesh under the memory its schedule keeps in flight, the boundaries priced as they execute
(``boundary``; the resharding planner's figure beside), the step simulated by ``autotune.reshard.pipeline``;
the Megatron-style 3-D baseline in ``threed``."""
