"""Stage 3 of the flow: the GC3 DSL and compiler, the CUDA interpreter that runs
compiled programs, and the resharding executors."""
