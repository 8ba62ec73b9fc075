"""Bad input to ``autotune.apply`` in a user's own script ends it with one line, ``error: ...`` naming the problem
and the fix, on rank 0's stderr only (no traceback), exit status 1 (``calibrate.errors.one_line_in_scripts``);
an error that is not the user's keeps its traceback."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
import torch
import autotune
from hand_plans import megatron, typed_plan
cfg = dict(kind="llama", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, sequence=8, vocabulary=64,
           batch=8, micro_batch=4)
plan = typed_plan(cfg, 2, 2, megatron, "llama megatron (2, 2)")  # 4 devices; this script runs alone
try:
    autotune.apply(plan, torch.nn.Linear(2, 2))  # the world is checked first
except Exception:
    if sys.argv[1] != "bug":
        raise
    raise ValueError("not the user's")
"""


def _run(tmp_path, arg, **env):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "autotune")])
    return subprocess.run([sys.executable, str(script), arg], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=path, **env), cwd=tmp_path)


def test_user_error_is_one_line_on_rank_0(tmp_path):
    r = _run(tmp_path, "plan")
    assert r.returncode == 1
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the plan is for 2 nodes x 2 GPUs = 4 devices but 1 "
                                                   "processes run: launch 4"), r.stderr
    other = _run(tmp_path, "plan", RANK="1")
    assert other.returncode == 1 and "error" not in other.stderr and "Traceback" not in other.stderr, other.stderr


def test_other_errors_keep_their_traceback(tmp_path):
    r = _run(tmp_path, "bug")
    assert r.returncode == 1 and "Traceback" in r.stderr and "ValueError: not the user's" in r.stderr


def test_a_piece_that_does_not_split_names_the_whole_batch():
    """data_piece's piece of a batch that the ranks split but the micro-batches do not: the fix names the whole
    batch (the plan's micro-batches times its data-parallel ranks), not the piece."""
    import torch

    import autotune
    from calibrate.errors import UserError
    from hand_plans import megatron, typed_plan
    cfg = dict(kind="llama", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, sequence=8,
               vocabulary=64, batch=8, micro_batch=4)
    plan = typed_plan(cfg, 2, 2, megatron, "llama megatron (2, 2)")
    with pytest.raises(UserError, match=r"a batch of 3 does not split into the plan's 2 micro-batches: .*a whole "
                                        r"batch that 2 x the data-parallel ranks divide, as the plan's 8"):
        autotune.micro_batches(plan, torch.zeros(3, 8))
    assert len(autotune.micro_batches(plan, torch.zeros(4, 8))) == 2


def test_a_plan_searched_for_expandable_segments_runs_only_under_them():
    """apply's check before any weight moves: a plan whose memory limit left expandable segments' allowance is
    refused on the GPU in one line naming the setting, unless the job runs under it; on the CPU, and for a plan of
    the default allocator, nothing is asked; the plan file keeps the allocator and refuses an unknown one."""
    from dataclasses import replace

    sys.path.insert(0, str(ROOT / "tests" / "autotune"))
    from hand_plans import megatron, typed_plan

    from autotune.apply.layers import check_allocator
    from autotune.plan.typed import Plan
    from calibrate.errors import UserError
    cfg = dict(kind="llama", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, sequence=8, vocabulary=64,
               batch=8, micro_batch=4)
    plan = typed_plan(cfg, 2, 2, megatron, "llama megatron (2, 2)")
    exp = replace(plan, allocator="expandable_segments")
    with pytest.raises(UserError, match="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True") as e:
        check_allocator(exp, {}, "cuda")
    assert "\n" not in str(e.value)
    check_allocator(exp, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "cuda")
    check_allocator(exp, {}, "cpu")
    check_allocator(plan, {}, "cuda")
    assert Plan.from_dict(exp.to_dict()).allocator == "expandable_segments"
    with pytest.raises(UserError, match="allocator"):
        Plan.from_dict(dict(exp.to_dict(), allocator="caching"))
