"""Reference executor and verifier on the msccl-tools files, and on planted defects."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from kernels.gc3.executor import ExecutionError, check_program, execute, random_inputs
from msccl_reference import msccl_dir, reference_xml_files
from kernels.gc3.ir import Step, StepType
from kernels.gc3.semantics import reference_result
from kernels.gc3.verify import VerifyError, verify
from kernels.gc3.xml_io import read_xml

MSCCL_DIR = msccl_dir()
MSCCL_FILES = reference_xml_files()
needs_files = pytest.mark.skipif(not MSCCL_FILES, reason=f"no MSCCL XML files in {MSCCL_DIR}")

# msccl-tools' alltonext_forward output has a real race (see test below)
CLEAN = [p for p in MSCCL_FILES if p.stem != "alltonext_forward_3n"]


@needs_files
@pytest.mark.parametrize("path", CLEAN, ids=lambda p: p.stem)
def test_reference_file_verifies_and_executes(path):
    prog = read_xml(path)
    verify(prog)
    check_program(prog, seeds=2 if len(prog.gpus) * prog.max_threadblocks > 100 else 12)


@needs_files
def test_reference_alltonext_race_is_found():
    """msccl-tools stages two different forwarded chunks in s[0] of gpu 10 (and others): a real race."""
    prog = read_xml(MSCCL_DIR / "alltonext_forward_3n.xml")
    verify(prog)
    with pytest.raises(ExecutionError, match=r"race: .*gpu \d+ tb \d+ step 0 \((r|rcs)\) writes s\[0\]"):
        check_program(prog, seeds=4)
    wrong = 0
    for seed in range(12):
        x = random_inputs(prog, seed)
        got = execute(prog, x, seed=seed, check_races=False)
        want = reference_result("custom", x, "alltonext")
        wrong += any(w is not None and not np.array_equal(g, w) for g, w in zip(got, want))
    assert wrong > 0  # the race really corrupts results under some interleavings


def _ring2():
    return read_xml(MSCCL_DIR / "ring_allreduce_2r.xml")


@needs_files
def test_planted_deadlock_is_found_statically_and_dynamically():
    prog = _ring2()
    # both GPUs first wait to receive before they send anything
    for gpu in prog.gpus:
        tb = gpu.threadblocks[0]
        tb.steps = [tb.steps[2], tb.steps[0], tb.steps[1]]
        for i, st in enumerate(tb.steps):
            st.s = i
    with pytest.raises(VerifyError, match=r"deadlock: cycle .*gpu 0 tb 0 step 0 \(r\)"):
        verify(prog)
    with pytest.raises(ExecutionError, match=r"deadlock: .*gpu 0 tb 0 step 0 \(r\) waits for a message"):
        execute(prog, random_inputs(prog, 0), seed=0)


@needs_files
def test_repeated_dependency_verifies():
    # a dependency listed twice is a repeated edge of the wait-for graph, on which scipy 1.17's strong
    # components never return unless the graph is made canonical first
    prog = read_xml(MSCCL_DIR / "allpairs_reducescatter_4r.xml")
    st = next(st for tb in prog.gpus[0].threadblocks for st in tb.steps if st.deps)
    st.deps = list(st.deps) + [st.deps[0]]
    assert verify(prog).steps == sum(len(tb.steps) for g in prog.gpus for tb in g.threadblocks)


@needs_files
def test_planted_race_is_found():
    prog = read_xml(MSCCL_DIR / "allpairs_reducescatter_4r.xml")
    # drop the nop that orders gpu 0's reduction after the receive from tb 2
    tb0 = prog.gpus[0].threadblocks[0]
    tb0.steps[0].deps = []
    with pytest.raises(ExecutionError, match=r"race: gpu 0 tb 0 step \d \(re\)|uninitialised read: gpu 0 tb 0"):
        for seed in range(20):
            execute(prog, random_inputs(prog, seed), seed=seed)


@needs_files
def test_wrong_result_is_found():
    prog = _ring2()
    st = prog.gpus[1].threadblocks[0].steps[1]
    prog.gpus[1].threadblocks[0].steps[1] = Step(1, StepType.RECV_COPY_SEND, st.srcbuf, st.srcoff, st.dstbuf,
                                                  st.dstoff, st.cnt)
    with pytest.raises(ExecutionError, match="wrong result: gpu [01] output differs"):
        check_program(prog, seeds=2)


@needs_files
def test_verifier_rejects_mismatch_and_conflicts():
    prog = _ring2()
    bad = copy.deepcopy(prog)
    bad.gpus[0].threadblocks[0].steps[0].cnt = 2
    with pytest.raises(VerifyError, match=r"message mismatch: gpu 0 tb 0 step 0 \(s\) sends 2 chunks"):
        verify(bad)
    bad = copy.deepcopy(prog)
    bad.gpus[0].threadblocks.append(copy.deepcopy(bad.gpus[0].threadblocks[0]))
    bad.gpus[0].threadblocks[1].id = 1
    with pytest.raises(VerifyError, match="thread blocks 0 and 1 both send to gpu 1 on channel 0"):
        verify(bad)
    with pytest.raises(VerifyError, match="uses 1 thread blocks but the target GPU has 0 SMs"):
        verify(prog, sm_count=0)


def test_reference_results_closed_form():
    x = [np.arange(4, dtype=np.float32) + 10 * r for r in range(2)]
    assert np.array_equal(reference_result("allreduce", x)[1], np.array([10, 12, 14, 16], np.float32))
    assert np.array_equal(reference_result("reducescatter", x)[1], np.array([14, 16], np.float32))
    assert np.array_equal(reference_result("allgather", x)[0], np.concatenate(x))
    assert np.array_equal(reference_result("alltoall", x)[1], np.array([2, 3, 12, 13], np.float32))
