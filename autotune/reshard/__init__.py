"""Cross-mesh resharding (Zhuang et al., "On optimizing the communication of model
parallelism"): meshes and sharding specs, unit communication tasks, per-task
strategies, load balance and scheduling solvers, pipeline schedules and plans.

Executed by ``kernels.reshard`` (MPI on host buffers, NCCL on device buffers).
"""
