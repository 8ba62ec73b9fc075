"""Backends behind one interface (``calibrate.backends.base.Backend``), by name.

    make_backend("mpi", comm)   # mpi4py on host buffers, anywhere
    make_backend("nccl", comm)  # cupy.cuda.nccl on GPUs, one process per GPU

Build a backend collectively on every rank of ``comm``.
"""
from __future__ import annotations

import importlib

from calibrate.errors import UserError

REGISTRY = {
    "mpi": "calibrate.backends.mpi:MpiBackend",
    "nccl": "calibrate.backends.nccl:NcclBackend",
}


def make_backend(name: str, comm, **options):
    if name not in REGISTRY:
        raise UserError(f"unknown backend {name!r}: choose from {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(comm, **options)
