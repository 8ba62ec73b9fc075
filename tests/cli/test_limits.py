"""The limits the commands check before any work, against closed forms and real programs."""
from __future__ import annotations

import pytest

from calibrate.collectives import Collective
from calibrate.cli import message
from calibrate.errors import UserError
from calibrate.fit import fit_quality_problem
from calibrate.outputs import check_output_path
from calibrate.run_limits import buffer_bytes, check_memory, host_cores, oversubscription_warning
from kernels.gc3.algorithms import ALGORITHMS, OP_COUNTS, build, check_size, predicted_bytes


@pytest.mark.parametrize("name, ranks, channels, nodes", [
    ("ring_allreduce", 5, 2, 1), ("allpairs_allreduce", 6, 1, 1), ("hierarchical_allreduce", 12, 1, 3),
    ("rdh_allreduce", 8, 1, 1), ("ring_allgather", 4, 2, 1), ("ring_reducescatter", 5, 1, 1),
    ("twostep_alltoall", 6, 1, 3), ("alltonext", 8, 1, 2)])
def test_op_counts_are_the_traced_counts(name, ranks, channels, nodes):
    prog = build(name, ranks, channels, 1, "Simple", nodes)
    want = OP_COUNTS[name](ranks, channels, nodes)
    if name == "alltonext":  # forwarding ops depend on node boundaries: the formula is an upper bound
        assert len(prog.ops) <= want
    else:
        assert len(prog.ops) == want


def test_every_algorithm_has_an_op_count():
    assert set(OP_COUNTS) == set(ALGORITHMS)


def test_size_limit_refuses_before_work():
    assert check_size("ring_allreduce", 1024, available=2 << 30) == 1024 * 2 * 1023
    assert predicted_bytes("ring_allreduce", 1024) < 2 << 30 < predicted_bytes("ring_allreduce", 2048)
    with pytest.raises(UserError, match=r"2048 ranks .* over the compiler's limit of 2.0 GiB \(the memory this "
                                        r"machine has available; about 1\d\d\d ranks fit"):
        check_size("ring_allreduce", 2048, available=2 << 30)
    with pytest.raises(UserError, match=r"over the compiler's limit of 1.0 GiB \(max_memory") as bad:
        check_size("ring_allreduce", 2048, max_memory_gib=1, available=4 << 30)
    assert "(--max-memory;" in message(bad.value)        # the command layer spells the option
    with pytest.raises(UserError, match=r"100000 ranks .* over the compiler's limit"):
        check_size("ring_allreduce", 100000)
    with pytest.raises(UserError, match="instances"):
        check_size("ring_allreduce", 8, instances=0)


def test_output_path(tmp_path):
    with pytest.raises(UserError, match="'/dev/null' is not a directory"):
        check_output_path("/dev/null/x.json")
    with pytest.raises(UserError, match="is a directory"):
        check_output_path(tmp_path)
    deep = tmp_path / "a" / "b" / "c.json"
    assert check_output_path(deep) == deep and not (tmp_path / "a").exists()
    assert check_output_path(tmp_path, directory=True) == tmp_path
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError, match="not a directory"):
        check_output_path(tmp_path / "f", directory=True)


def test_buffers_and_memory():
    # allgather of 1 MiB float32 on 4 ranks: send 1/4, receive all; doubled for --check
    assert buffer_bytes([Collective.ALLGATHER], 1 << 20, "float32", 4, False) == (1 << 18) + (1 << 20)
    assert buffer_bytes([Collective.ALLREDUCE, Collective.ALLGATHER], 1 << 20, "float32", 4, True) == 4 << 20
    check_memory(1 << 30, 2, 3 << 30, "host h", "fix")
    with pytest.raises(UserError, match=r"needs 1 GiB of buffers per rank \(4 rank\(s\) on host h: 4 GiB\) "
                                        r"but host h has 3 GiB available: lower"):
        check_memory(1 << 30, 4, 3 << 30, "host h", "lower --max-bytes")
    assert oversubscription_warning(2, 2, "h") is None
    # mpirun binding each of 2 ranks to its own core: 2 cores for 2 ranks, no warning (seen wrongly on
    # the 32-core H200 machine, 2026-11-23); unbound ranks each seeing both cores count them once
    assert host_cores([{0}, {1}]) == 2
    assert host_cores([{0, 1}, {0, 1}, {0, 1}, {0, 1}]) == 2
    assert oversubscription_warning(2, host_cores([{0}, {1}]), "h") is None
    assert "4 ranks share the 2 core(s)" in oversubscription_warning(4, host_cores([{0, 1}] * 4), "h")
    assert "4 ranks share the 2 core(s) of h" in oversubscription_warning(4, 2, "h")


def test_fit_quality_flags():
    assert fit_quality_problem(0.99, 0.1) is None
    assert fit_quality_problem(float("nan"), None) is None
    problem = fit_quality_problem(-0.45, 0.9)
    assert "r2 -0.45 (want >= 0.9)" in problem and "held-out max error 90% (want <= 50%)" in problem


def test_a_pipelined_plan_fits_the_memory_limit_at_its_peak(tmp_path):
    """The memory limit is hard: a pipelined plan is marked as fitting only where its peak, workspace
    included, is within it (a 2-stage plan needing 0.0555 GiB was marked as fitting 0.055 GiB, as GPT-3
    175B on 256 x 8 at 80.10 GiB fitted 80 GiB), and the stage search looks for one that does."""
    import json

    from autotune.cli.search import main

    out = tmp_path / "plan"
    main(["--nodes", "1", "--gpus-per-node", "4", "--layers", "4", "--hidden", "256", "--heads", "4", "--sequence",
          "256", "--vocabulary", "1024", "--batch", "64", "--micro-batch", "4", "--pipeline", "2", "--compare", "none",
          "--budget", "0.3", "--memory-limit", "0.055", "--out", str(out)], report=lambda *a: "")
    pf = json.loads((out / "plan.json").read_text())
    plans = [pf["best"], *pf["baselines"]]
    piped = [p for p in plans if p["stages"]]
    assert piped
    for p in plans:
        limit, t = p["memory_limit_bytes"], p["costs"]
        assert t["fits_memory"] == (t["memory_bytes"] <= limit), (p["strategy"], t["memory_bytes"] / 2**30)
        for i, s in enumerate(p["stages"]):
            assert s["fits_memory"] == (s["memory_bytes"] <= limit), (p["strategy"], i)
    assert piped[0]["costs"]["fits_memory"]
