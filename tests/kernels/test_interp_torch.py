"""The interpreter from PyTorch (issue 19), host side: tensor checks and the
tensor-parallel MLP layer's forward and backward against the unsplit layer, with
an allreduce over emulated ranks standing in for the GPU one. torch's CPU build."""
from __future__ import annotations

import os
import types

import pytest

from calibrate.errors import UserError
from kernels.interp import torch_comm
from kernels.interp.cli import tp_mlp

if os.environ.get("CI"):
    import torch   # CI installs the test extra: torch must be there
else:
    torch = pytest.importorskip("torch")


def test_dtype_names_and_refusals():
    assert torch_comm.dtype_name(torch.zeros(1, dtype=torch.bfloat16)) == "bfloat16"
    assert torch_comm.dtype_name(torch.zeros(1)) == "float32"
    with pytest.raises(UserError, match="int64 is not supported"):
        torch_comm.dtype_name(torch.zeros(1, dtype=torch.int64))


def test_tensor_checks():
    with pytest.raises(UserError, match="move it to cuda:0"):
        torch_comm.check_tensor(torch.zeros(4), "input", 0)


def test_expected_numel():
    assert torch_comm.expected_numel("allreduce", 10, 2) == (10, 10)
    assert torch_comm.expected_numel("allgather", 10, 4) == (10, 40)
    assert torch_comm.expected_numel("reducescatter", 12, 4) == (3, 3)
    with pytest.raises(UserError, match="pad it to a multiple of 4"):
        torch_comm.expected_numel("reducescatter", 10, 4)
    with pytest.raises(UserError, match="unknown collective"):
        torch_comm.expected_numel("alltoall", 10, 4)


def test_shapes_and_tokens_checked():
    assert tp_mlp.check_shape(8, 0, 2) == 16
    with pytest.raises(UserError, match="divide over 3 ranks"):
        tp_mlp.check_shape(8, 32, 3)
    assert tp_mlp.parse_tokens("8, 64") == [8, 64]
    with pytest.raises(UserError, match="positive"):
        tp_mlp.parse_tokens("0")
    with pytest.raises(UserError, match="comma-separated integers"):
        tp_mlp.parse_tokens("8;64")


@pytest.mark.parametrize("nranks", [2, 4])
def test_tp_layer_forward_backward_equals_unsplit_mlp(nranks):
    """Rank r holds column block r of W1 and row block r of W2. Emulated ranks run the layer
    one after another; the allreduce sums what every rank passed at the same call, so the
    last rank to call sees the full sum, which is what the layer must equal."""
    torch.manual_seed(0)
    hidden, ffn, tokens = 6, 8 * nranks, 5
    w1 = torch.randn(hidden, ffn, dtype=torch.float64)
    w2 = torch.randn(ffn, hidden, dtype=torch.float64)
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    dy = torch.randn(tokens, hidden, dtype=torch.float64)

    # reference: the unsplit layer
    xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
    yr = torch.nn.functional.gelu(xr @ w1r) @ w2r
    yr.backward(dy)

    # pass 1 collects every rank's contribution per call; pass 2 replays with the sums
    calls: list[list] = []

    def collecting(t, i=[0]):  # noqa: B006  (call counter shared across ranks of one pass)
        k = i[0] % 2
        i[0] += 1
        if len(calls) <= k:
            calls.append([])
        calls[k].append(t.detach().clone())
        return t.clone()

    def summing(t, i=[0]):  # noqa: B006
        k = i[0] % 2
        i[0] += 1
        return sum(calls[k]).clone()

    shard = ffn // nranks
    for allreduce in (collecting, summing):
        results = []
        for r in range(nranks):
            xs = x.clone().requires_grad_()
            a = w1[:, r * shard:(r + 1) * shard].clone().requires_grad_()
            b = w2[r * shard:(r + 1) * shard].clone().requires_grad_()
            y = tp_mlp.make_layer(torch, allreduce)(xs, a, b, dy)
            results.append((y.detach(), xs.grad, a.grad, b.grad))
    for r, (y, gx, ga, gb) in enumerate(results):
        assert torch.allclose(y, yr.detach())
        assert torch.allclose(gx, xr.grad)
        assert torch.allclose(ga, w1r.grad[:, r * shard:(r + 1) * shard])
        assert torch.allclose(gb, w2r.grad[r * shard:(r + 1) * shard])


def test_nccl_variant_reduces_in_place_and_marks_it():
    """The NCCL variant hands back its input, reduced in place: autograd must accept that."""
    class FakeDist:
        @staticmethod
        def all_reduce(t):
            t.mul_(2)

    ars = tp_mlp.make_allreduces(torch, FakeDist, interp=types.SimpleNamespace(all_reduce=None))
    x = torch.ones(3, 4, dtype=torch.float64, requires_grad=True)
    w1 = torch.ones(4, 2, dtype=torch.float64, requires_grad=True)
    w2 = torch.ones(2, 4, dtype=torch.float64, requires_grad=True)
    y = tp_mlp.make_layer(torch, ars["nccl"])(x, w1, w2, torch.ones(3, 4, dtype=torch.float64))
    h = torch.nn.functional.gelu(torch.tensor(4.0, dtype=torch.float64))
    assert torch.allclose(y, 2 * 2 * h * torch.ones(3, 4, dtype=torch.float64))
    assert x.grad is not None and torch.all(x.grad != 0)
