"""The interpreter on PyTorch tensors: torch's current stream, the tensors' own
memory (no copies: their addresses go into the interpreter's launch), capturable
inside ``torch.cuda.graph``.

    ti = TorchInterp(Communicator(MPI.COMM_WORLD))   # under mpirun (mpi4py)
    ti.prepare("allreduce", x)                    # launch state, before any graph capture
    y = ti.all_reduce(x)                          # out of place; or ti.all_reduce(x, out=y)
    ti.all_gather_into_tensor(out, x); ti.reduce_scatter_tensor(out, x)

The interpreter reads the caller's buffers locally and pushes into FIFOs it owns
(IPC-mapped at start-up), so torch tensors need no registration. Only what needs
torch is imported lazily: the module loads on machines without torch.
"""
from __future__ import annotations

from calibrate.errors import UserError

TORCH_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def dtype_name(tensor) -> str:
    """The interpreter's name of a tensor's dtype, or a UserError naming the supported ones."""
    name = TORCH_DTYPES.get(str(tensor.dtype))
    if name is None:
        raise UserError(f"tensor dtype {tensor.dtype} is not supported by the interpreter; use float32, bfloat16 "
                        f"or float16")
    return name


def check_tensor(tensor, label: str, device_index: int) -> None:
    """A CUDA tensor on the communicator's GPU, contiguous (the interpreter addresses it flat)."""
    if not tensor.is_cuda:
        raise UserError(f"{label} tensor is on {tensor.device}; move it to cuda:{device_index}")
    if tensor.device.index != device_index:
        raise UserError(f"{label} tensor is on {tensor.device} but the communicator runs on cuda:{device_index}; "
                        f"use one GPU per process")
    if not tensor.is_contiguous():
        raise UserError(f"{label} tensor is not contiguous; call .contiguous() first")


def expected_numel(collective: str, numel_in: int, nranks: int) -> tuple[int, int]:
    """(NCCL count, output elements) of a call whose input has ``numel_in`` elements."""
    if collective == "allreduce":
        return numel_in, numel_in
    if collective == "allgather":
        return numel_in, numel_in * nranks
    if collective == "reducescatter":
        if numel_in % nranks:
            raise UserError(f"reducescatter input of {numel_in} elements does not split over {nranks} ranks; "
                            f"pad it to a multiple of {nranks}")
        return numel_in // nranks, numel_in // nranks
    raise UserError(f"unknown collective {collective!r}; use allreduce, allgather or reducescatter")


class TorchInterp:
    """Collectives of the interpreter (its tuned table, else NCCL) on torch tensors."""

    def __init__(self, comm):
        import cupy as cp
        import torch

        self.comm, self.cp, self.torch = comm, cp, torch
        self.device_index = cp.cuda.Device().id

    def _stream(self):
        return self.cp.cuda.ExternalStream(self.torch.cuda.current_stream(self.device_index).cuda_stream,
                                           self.device_index)

    def prepare(self, collective: str, tensor) -> None:
        """Launch state and scratch for calls like this one; call it before capturing a graph."""
        count, _ = expected_numel(collective, tensor.numel(), self.comm.nranks)
        self.comm.prepare(collective, count, dtype_name(tensor))

    def run(self, collective: str, inp, out):
        check_tensor(inp, "input", self.device_index)
        check_tensor(out, "output", self.device_index)
        dtype = dtype_name(inp)
        if out.dtype != inp.dtype:
            raise UserError(f"output dtype {out.dtype} differs from input dtype {inp.dtype}; use one dtype")
        count, out_n = expected_numel(collective, inp.numel(), self.comm.nranks)
        if out.numel() != out_n:
            raise UserError(f"{collective}: output has {out.numel()} elements, the call writes {out_n}; "
                            f"allocate it with {out_n}")
        esize = inp.element_size()
        self.comm.collective_ptr(collective, inp.data_ptr(), inp.numel() * esize, out.data_ptr(),
                                 out.numel() * esize, count, dtype, stream=self._stream())
        return out

    def all_reduce(self, inp, out=None):
        return self.run("allreduce", inp, self.torch.empty_like(inp) if out is None else out)

    def all_gather_into_tensor(self, out, inp):
        return self.run("allgather", inp, out)

    def reduce_scatter_tensor(self, out, inp):
        return self.run("reducescatter", inp, out)

    def close(self) -> None:
        self.comm.close()


def init_torch_from_mpi(world, device_index: int):
    """torch.distributed (NCCL) over the ranks of an mpi4py communicator: rank 0 picks a free
    port on localhost (one node), broadcast over MPI. Returns the default group."""
    import os
    import socket

    import torch
    import torch.distributed as dist

    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        port = None
    port = world.bcast(port, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(device_index)
    dist.init_process_group("nccl", rank=world.Get_rank(), world_size=world.Get_size(),
                            device_id=torch.device("cuda", device_index))
    return dist.group.WORLD
