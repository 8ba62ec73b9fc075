"""Gradient accumulation as the plans price it: ``autotune.accumulate(model, micro_batches)`` runs the backward of
all but a step's last micro-batch under ``autotune.no_sync(model)``, so each gradient is reduced over the data
ranks once a step, with the last micro-batch, on the DTensor path (its own hooks) as on DDP. On 2 x H200 the
DTensor path reduced every replicated weight's gradient in each of a step's 8 micro-batches (1193 all-reduces a
step against DDP's 67; its step 11% over the plan's). Counted on 4 gloo processes, a data-parallel plan of 4
micro-batches: the all-reduces of an accumulated step are those of one micro-batch's, a plain loop's 4 times as
many (planted bug: the DTensor path's hook reducing whatever ``no_sync`` says, fails). The losses and weights of
accumulated steps against one process: ``test_apply_distributed`` (its ``train`` accumulates)."""
import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402

from gloo_runner import run_on_gloo  # noqa: E402
from hand_plans import data_parallel, typed_plan  # noqa: E402
from test_apply_distributed import LLAMA, make_model  # noqa: E402

CFG = dict(LLAMA, batch=16, micro_batch=4)  # 4 micro-batches of one sequence per rank


def _all_reduces(path: str, steps: list) -> list[int]:
    """The all-reduces of each of ``steps`` (True: micro-batches through ``accumulate``; False: a plain loop; None:
    the first micro-batch alone) of the data-parallel plan placed on ``path``."""
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.profiler import ProfilerActivity, profile

    import autotune
    plan = typed_plan(CFG, 1, 4, data_parallel, "data parallel")
    model = autotune.apply(plan, make_model("llama"), path=path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocabulary"], (CFG["batch"], CFG["sequence"]), generator=g)
    out = []
    for acc in steps:
        mbs = autotune.micro_batches(plan, autotune.data_piece(model, ids))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for mb in autotune.accumulate(model, mbs) if acc else mbs[:1] if acc is None else mbs:
                with loss_parallel():
                    model(input_ids=mb, labels=mb).loss.backward()
        out.append(sum(e.count for e in prof.key_averages() if e.key == "c10d::allreduce_"))
        for p in model.parameters():
            p.grad = None
    return out


def test_accumulated_step_reduces_each_gradient_once():
    got = run_on_gloo(_all_reduces, [("dtensor", [None, True, False]), ("auto", [None, True, False])])[0]
    for path, (one, accumulated, plain) in zip(("dtensor", "ddp"), got):
        assert one > 0 and accumulated == one and plain == 4 * one, (path, one, accumulated, plain)
