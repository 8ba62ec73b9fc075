"""Placements on the fine mesh, local pieces, and the boxing between them.

Every layer of a plan lives on one ``DeviceMesh`` whose dimensions are the
cluster's fine axes (``autotune.sbp.mesh``): a layer's role mesh is a grouping
of them, so ``NdSbp(...).fine(cluster)`` gives one placement per mesh
dimension and a redistribution between two layers is one DTensor
``redistribute`` on that mesh. Where several fine axes split one tensor
dimension, the pieces nest left to right (DTensor's order): ``local_range``
computes the same offsets without communication.

``box`` is the plan's boxing as an autograd function on local pieces: forward
``src -> dst``, backward the gradient's dual boxing ``dual(dst) -> dual(src)``
(``autotune.sbp.boxing``), both by DTensor's redistribute.
"""
from __future__ import annotations

from calibrate.optional import require_torch

from autotune.execute.commlog import Call
from autotune.apply.layers import contiguous_strides
from autotune.sbp.sbp import B, P, dual, is_split, split_dim

torch = require_torch()
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard  # noqa: E402


def placement(p: str):
    """The DTensor placement of an SBP placement string."""
    if is_split(p):
        return Shard(split_dim(p))
    return Replicate() if p == B else Partial()


def placements(fine: tuple[str, ...]) -> tuple:
    return tuple(placement(p) for p in fine)


def local_range(size: int, dim: int, fine, coords, axis_sizes) -> tuple[int, int]:
    """(offset, length) of this device's piece of dimension ``dim`` (nested left to right)."""
    chunk, off = size, 0
    for p, c, n in zip(fine, coords, axis_sizes):
        if is_split(p) and split_dim(p) == dim:
            chunk //= n
            off += c * chunk
    return off, chunk


def local_piece(full, fine, coords, axis_sizes):
    """This device's piece of a tensor every device holds whole (no communication).
    A partial placement keeps the value on coordinate 0 and zeros elsewhere."""
    out = full
    for d in range(full.dim()):
        off, n = local_range(full.shape[d], d, fine, coords, axis_sizes)
        out = out.narrow(d, off, n)
    if any(p == P and c != 0 for p, c in zip(fine, coords)):
        return torch.zeros_like(out, memory_format=torch.contiguous_format)
    return out.clone(memory_format=torch.contiguous_format)  # its own storage: the whole tensor can be freed


def redistribute(local, mesh, shape, src: tuple[str, ...], dst: tuple[str, ...], coords=None):
    """This device's piece under ``dst`` of the tensor (global ``shape``) held under ``src``.
    DTensor moves everything but the partial targets: S -> P goes through B (an
    all-gather, the plan's path), and B -> P keeps the value on coordinate 0 of
    those axes and zeros elsewhere (local, as the plan's "zero" step)."""
    if src == dst:
        return local
    zero = tuple(a for a, (s, d) in enumerate(zip(src, dst)) if d == P and s != P)
    mid = tuple(B if a in zero else d for a, d in enumerate(dst))
    out = local
    if mid != src:
        x = DTensor.from_local(local.contiguous(), mesh, placements(src), run_check=False,
                               shape=tuple(shape), stride=contiguous_strides(shape))
        out = x.redistribute(mesh, placements(mid)).to_local()
    if zero:
        coords = mesh.get_coordinate() if coords is None else coords
        if any(coords[a] != 0 for a in zero):
            out = torch.zeros_like(out)
    out = out.contiguous()
    if out.untyped_storage().nbytes() > out.numel() * out.element_size():
        # a piece of a larger buffer (a collective's whole output, chunked): its own storage, so
        # that a layer keeping it for the backward pass does not keep the whole buffer alive
        out = out.clone()
    return out


def _logged(log, x, shape, src, dst) -> None:
    if log is not None and src != dst:
        log.add(Call("redistribute", tuple(x.shape), x.dtype, tuple(shape), tuple(src), tuple(dst)))


class _Box(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, shape, src, dst, gsrc, gdst, log):
        ctx.args = (mesh, shape, gsrc, gdst, log)
        _logged(log, x, shape, src, dst)
        return redistribute(x, mesh, shape, src, dst)

    @staticmethod
    def backward(ctx, g):
        mesh, shape, gsrc, gdst, log = ctx.args
        _logged(log, g, shape, gdst, gsrc)
        return redistribute(g, mesh, shape, gdst, gsrc), None, None, None, None, None, None, None


def box(x, mesh, shape, src: tuple[str, ...], dst: tuple[str, ...], grad_dst: tuple[str, ...] | None = None,
        log=None):
    """Redistribute local piece ``x`` from ``src`` to ``dst``; the backward moves the
    gradient from ``grad_dst`` (default ``dual(dst)``) to ``dual(src)``. ``log``
    (an ``autotune.execute.commlog.CommLog``) records both calls for the replay."""
    if src == dst and grad_dst is None:
        return x
    gdst = tuple(dual(p) for p in dst) if grad_dst is None else tuple(grad_dst)
    gsrc = tuple(dual(p) for p in src)
    return _Box.apply(x, mesh, tuple(shape), tuple(src), tuple(dst), gsrc, gdst, log)
