"""``autotune.param_groups``: a stage's DTensor weights (an embedding by features, logits by vocabulary) beside
DDP's plain parameters, as one optimizer group per kind, which torch's fused AdamW takes (one group mixing them
it refuses: the failure execute met on four GPUs)."""
import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gloo_runner import free_port  # noqa: E402


def test_one_group_per_kind_for_fused_adamw():
    import autotune
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        m = torch.nn.Module()
        m.plain = torch.nn.Parameter(torch.randn(4, 3))
        m.rows = torch.nn.Parameter(distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)]))
        m.frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
        groups = autotune.param_groups(m)
        assert [[id(p) for p in g["params"]] for g in groups] == [[id(m.rows)], [id(m.plain)]]
        for p in (m.plain, m.rows):
            p.grad = torch.ones_like(p)
        before = m.plain.detach().clone()
        torch.optim.AdamW(groups, lr=0.1, fused=True).step()
        assert not torch.equal(m.plain.detach(), before)
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            torch.optim.AdamW(m.parameters(), lr=0.1, fused=True).step()
    finally:
        dist.destroy_process_group()
