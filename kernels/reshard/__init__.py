"""Executors of cross-mesh resharding plans (``autotune.reshard.plan.Plan``):
the same plan run by an MPI backend on host buffers or an NCCL backend on
device buffers."""
