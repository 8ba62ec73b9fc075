"""Cross-mesh resharding plans and their executors: the plan format (``plan.Plan``,
written by ``autotune.reshard``), the sharding geometry it is written in (``spec``,
``tasks``), each strategy's execution (``strategies``) over the primitives of an MPI
backend on host buffers or an NCCL backend on device buffers (``program.BACKENDS``).

    mpiexec -n 6 python -m kernels reshard plan.json [--backend mpi|nccl] [--iters 5]
"""
