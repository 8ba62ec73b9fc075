"""Backends behind one interface (``calibrate.backends.base.Backend``), by name.

    make_backend("mpi", comm)   # mpi4py on host buffers, anywhere
    make_backend("nccl", comm)  # cupy.cuda.nccl on GPUs, one process per GPU

Build a backend collectively on every rank of ``comm``.
"""
from __future__ import annotations

from calibrate.registry import Registry

REGISTRY = Registry("backend", {
    "mpi": "calibrate.backends.mpi:MpiBackend",
    "nccl": "calibrate.backends.nccl:NcclBackend",
})


def make_backend(name: str, comm, **options):
    return REGISTRY.get(name)(comm, **options)
