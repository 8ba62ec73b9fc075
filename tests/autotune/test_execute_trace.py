"""The GPU trace of a step as intervals (autotune.execute.trace), on synthetic traces:
GPU user annotations (the profiler's record_function ranges on the GPU timeline,
such as ``nccl:all_reduce`` around each NCCL kernel) are labels, not work; counted
as busy they covered every NCCL kernel and measured no exposed communication."""
import pytest

from autotune.execute.trace import DeviceEvent, breakdown, exposed_time, family, idle_time, split, top_kernels

NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"


def step_trace():
    """Step 0-100 us: a matmul 0-40, an all-reduce 30-70 (its annotation 29-71), a softmax
    60-65, another all-reduce 80-90 alone (annotation 79-91), a memset 95-96."""
    return [DeviceEvent(GEMM, 0, 40), DeviceEvent(NCCL, 30, 70), DeviceEvent("nccl:all_reduce", 29, 71, True),
            DeviceEvent("void at::native::softmax_warp_forward<>", 60, 65), DeviceEvent(NCCL, 80, 90),
            DeviceEvent("nccl:all_reduce", 79, 91, True), DeviceEvent("Memset (Device)", 95, 96),
            DeviceEvent("ProfilerStep#3", 0, 100, True)]


def test_annotations_are_not_busy_time():
    comm, busy = split(step_trace())
    assert comm == [(30, 70), (80, 90)]
    assert busy == [(0, 40), (60, 65), (95, 96)]
    # all-reduce 30-70 overlaps the matmul until 40 and the softmax 60-65: exposed 40-60 and 65-70;
    # the second, 80-90, runs alone
    assert exposed_time(comm, busy) == pytest.approx(20 + 5 + 10)


def test_counting_annotations_as_busy_hides_everything():
    """The old measurement (every GPU event not NCCL was busy): zero, whatever the trace."""
    events = step_trace()
    comm = [(e.start, e.end) for e in events if e.name.startswith("nccl") and not e.annotation]
    busy_with_labels = [(e.start, e.end) for e in events if not e.name.startswith("ncclDev")]
    assert exposed_time(comm, busy_with_labels) == 0


def test_breakdown_per_step():
    events = step_trace()
    b = breakdown(events, steps=2)
    assert b["nccl"] == pytest.approx(50e-6 / 2)
    assert b["matmul"] == pytest.approx(40e-6 / 2)
    assert b["softmax"] == pytest.approx(5e-6 / 2)
    assert b["copy"] == pytest.approx(1e-6 / 2)
    assert "other" not in b  # the annotations are not device time
    top = top_kernels(events, steps=2, n=1)
    assert top == [{"name": NCCL, "s": pytest.approx(50e-6 / 2), "calls": 1.0}]
    assert family("ampere_bf16_s16816gemm_bf16_128x128") == "matmul"


def test_idle_time_is_the_gaps_between_activities():
    # busy 0-40, 30-70, 60-65, 80-90, 95-96 (the annotations, such as the whole step 0-100, are no work):
    # gaps 70-80 and 90-95
    assert idle_time(step_trace()) == 15.0
    assert idle_time([]) == 0.0
