"""The device layer: what every GPU measurement or execution in the project shares.

- ``dtypes``: the element types (bytes, NCCL's enum, storage of bf16 as uint16) and
  the one correctness tolerance;
- ``gpu``: the GPU of this rank, from its node-local rank, refusing two ranks on one GPU;
- ``nccl``: NCCL communicators set up over MPI and destroyed explicitly on every
  rank, and one launch of each collective;
- ``timing``: the CUDA-graph timer (capture once, replay timed with CUDA events).

The collectives themselves are ``calibrate.collectives.Collective`` and the size
sweep ``calibrate.sizes.sweep``. cupy and mpi4py are imported only when a GPU
function runs, so the pure-Python parts load anywhere.
"""
