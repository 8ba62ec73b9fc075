"""The CUDA-graph timer (nccl-tests -G): calls captured once in a graph, each replay
timed with CUDA events, the value being seconds per call."""
from __future__ import annotations


def capture(stream, call, ncalls: int):
    """``ncalls`` calls of ``call(stream)`` captured in one CUDA graph, replayed once
    (the first replay uploads the graph)."""
    stream.begin_capture()
    for _ in range(ncalls):
        call(stream)
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    return graph


def time_graph(cp, stream, graph, ncalls: int, barrier=None) -> float:
    """Seconds per call of one replay of ``graph`` (``ncalls`` calls), after ``barrier()`` if given."""
    stream.synchronize()
    if barrier is not None:
        barrier()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    graph.launch(stream)
    stop.record(stream)
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) * 1e-3 / ncalls

