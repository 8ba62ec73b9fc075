"""The measurement engine and its statistics: closed forms, the CPU stand-in device, MPI ranks."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from calibrate.errors import OptionError, UserError
from calibrate.measure import heldout, stats
from calibrate.measure.engine import Options, Solo, Status, compare
from standin import Device, SumArm
from calibrate.measure.verdict import MET, NOT_MET, UNKNOWN, judge, overall

MPIEXEC = Path(sys.executable).with_name("mpiexec")
ROOT = Path(__file__).resolve().parents[2]
FAST = dict(rounds=4, calls=3, min_batch_s=0.0, warmup=1)


# -- statistics against closed forms -----------------------------------------------------------
def test_median_and_its_interval():
    assert stats.median([3, 1, 2]) == 2 and stats.median([4, 1, 2, 3]) == 2.5 and math.isnan(stats.median([]))
    assert stats.median_ci([5, 1, 3]) == (1, 5)           # below 6 samples: min..max
    x = np.arange(1, 101, dtype=float)
    lo, hi = stats.median_ci(x)
    # Binomial(100, 1/2): 2.5% and 97.5% quantiles 40 and 60 -> x_(40), x_(61) (1-based)
    assert (lo, hi) == (40.0, 61.0)


def test_geomean_ratio_and_the_one_sign_of_relative_error():
    assert stats.geomean([2, 8]) == pytest.approx(4) and stats.geomean([1.1] * 5) == pytest.approx(1.1)
    with pytest.raises(ValueError):
        stats.geomean([1, 0])
    assert stats.rel_err(110, 100) == pytest.approx(0.10)    # model too high: positive
    assert stats.rel_err(90, 100) == pytest.approx(-0.10)
    assert stats.rel_err(1, 0) is None and stats.rel_err(None, 1) is None
    assert stats.rel_err_pct(90, 100) == pytest.approx(-10.0) and math.isnan(stats.rel_err_pct(1, 0))
    assert stats.ratio(12, 10) == pytest.approx(1.2) and stats.ratio(None, 1) is None


def test_summary_of_samples():
    s = stats.summarize([float(x) for x in range(1, 21)])
    # 20 samples: median 10.5; p95 by linear interpolation 19.05; Binomial(20, 1/2) interval x_(6)..x_(15)
    assert (s["n"], s["median_s"], s["min_s"], s["max_s"]) == (20, 10.5, 1.0, 20.0)
    assert s["p95_s"] == pytest.approx(19.05) and (s["ci_lo_s"], s["ci_hi_s"]) == (6.0, 15.0)


def test_rank_correlations():
    from scipy.stats import kendalltau

    assert stats.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert stats.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    # one adjacent swap of 4: 1 - 6 * 2 / (4 * 15) = 0.8; Kendall: (5 - 1) / 6
    assert stats.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert stats.kendall([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(2 / 3)
    a, b = [1, 2, 2, 3, 5, 4], [2, 1, 3, 3, 6, 7]             # ties: tau-b
    assert stats.kendall(a, b) == pytest.approx(kendalltau(a, b).statistic)
    assert stats.spearman([1, 2], [1, 2]) is None and stats.kendall([1, 1, 1], [1, 2, 3]) is None
    assert stats.spearman([1, 2, None, 4, 5], [1, 2, 3, None, 5]) == pytest.approx(1)


# -- the engine on the CPU stand-in device -------------------------------------------------------
@pytest.mark.parametrize("mode", ["host", "graph", "isolated"])
def test_arms_are_interleaved_each_first_in_turn(mode):
    dev = Device()
    arms = [(n, lambda n=n: SumArm(dev, 32, name=n)) for n in ("a", "b", "c")]
    res = compare(Solo(), arms, Options(mode, **FAST))
    assert res.order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert all(r.ok and r.wrong_before == 0 and r.wrong_after == 0 for r in res.arms.values())
    per_round = FAST["calls"] if mode == "isolated" else 1
    assert all(len(r.samples_s) == FAST["rounds"] * per_round for r in res.arms.values())
    # the device ran them so: per arm a check, a warm-up call and a probe of 4 calls, then the rounds'
    # batches (3 calls each, or 3 isolated calls), then a check after per arm
    timed = dev.ran[3 * (1 + 1 + 4):-3]
    assert len(timed) == FAST["rounds"] * 3 * 3 and dev.ran[-3:] == ["a", "b", "c"]
    assert timed == [n for turn in res.order for n in turn for _ in range(3)]


def test_a_fault_after_the_first_call_is_found_by_the_check_after():
    dev = Device()
    res = compare(Solo(), [("good", lambda: SumArm(dev, 64, name="good")),
                           ("planted", lambda: SumArm(dev, 64, fault_from=2, name="planted"))],
                  Options("graph", **FAST))
    good, bad = res["good"], res["planted"]
    assert good.ok and bad.wrong_before == 0 and bad.wrong_after == 1
    assert bad.status is Status.WRONG and "after the timed calls" in bad.reason
    assert bad.timed and bad.median_s is None                     # timed, but no figure to quote
    assert res.ratio("planted", "good") is None
    # without the check after, the same planted kernel would have passed
    quiet = compare(Solo(), [("planted", lambda: SumArm(Device(), 64, fault_from=2))], Options("host", **FAST,
                                                                                                  check=False))
    assert quiet["planted"].ok


def test_a_fault_on_the_first_call_is_not_timed():
    res = compare(Solo(), [("bad", lambda: SumArm(Device(), 8, fault_from=1))], Options(**FAST))
    assert res["bad"].status is Status.WRONG and res["bad"].wrong_before == 1 and not res["bad"].timed


def test_an_arm_that_fails_to_start_is_a_row_and_the_verdict_is_unknown():
    dev = Device()

    def broken():
        raise ImportError("libfoo.so not found")

    res = compare(Solo(), [("ours", lambda: SumArm(dev, 16, name="ours")), ("peer-a", lambda: SumArm(dev, 16)),
                           ("peer-b", broken)], Options(**FAST))
    assert list(res.arms) == ["ours", "peer-a", "peer-b"]
    b = res["peer-b"]
    assert b.status is Status.FAILED and "libfoo.so" in b.reason and b.to_dict()["median_s"] is None
    missing = res.missing(["peer-a", "peer-b"])
    assert missing == ["peer-b: failed (did not start: ImportError: libfoo.so not found)"]
    v = judge(">= 1.0x the best peer", res["peer-a"].median_s / res["ours"].median_s, lambda x: x >= 0.0, missing)
    assert v.state == UNKNOWN and "peer-b" in v.why
    assert judge("x", 1.2, lambda x: x >= 1.0).state == MET and judge("x", 0.9, lambda x: x >= 1.0).state == NOT_MET
    assert overall([judge("x", 1.2, lambda x: True), v]) == UNKNOWN
    again = type(res).from_dict(json.loads(json.dumps(res.to_dict())))
    assert again["peer-b"].status is Status.FAILED and again["ours"].median_s == res["ours"].median_s


def test_batches_reach_the_least_duration_and_options_are_checked():
    res = compare(Solo(), [("a", lambda: SumArm(Device(), 4))], Options("host", rounds=2, calls=1, min_batch_s=1e-3))
    a = res["a"]
    assert a.calls > 1 and a.calls & (a.calls - 1) == 0            # a power of two
    with pytest.raises(OptionError, match="rounds"):
        compare(Solo(), [], Options(rounds=0))
    with pytest.raises(UserError, match="timing mode"):
        compare(Solo(), [], Options("gpu"))


def test_heldout_declaration_is_hashed_and_disjoint():
    d = heldout.declare("nccl", {"allreduce": [1024, 2048, 4096]}, 1000, 1 << 20, 4, 7, 128, "2026-11-25T17:00Z")
    assert len(d.evaluation["allreduce"]) == 4 and not set(d.evaluation["allreduce"]) & {1024, 2048, 4096}
    data = d.to_dict()
    assert heldout.Declaration.from_dict(data, "r").evaluation == d.evaluation
    data["evaluation"]["allreduce"][0] += 128
    with pytest.raises(UserError, match="hash"):
        heldout.Declaration.from_dict(data, "r")
    with pytest.raises(UserError, match="both development and evaluation"):
        heldout.Declaration("x", {"allreduce": [1024]}, {"allreduce": [1024]})


# -- the engine over MPI ranks: the MPI backend and the stand-in ---------------------------------
@pytest.mark.skipif(not MPIEXEC.exists(), reason="the mpich wheel's mpiexec is not installed")
def test_engine_on_mpi_ranks():
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, str(ROOT / "tests/calibrate/measure_on_ranks.py"),
                        "host"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    arms = {a["name"]: a for a in got["arms"]}
    assert [a["name"] for a in got["arms"]] == ["mpi-allreduce", "mpi-allgather", "standin", "planted", "refused"]
    for n in ("mpi-allreduce", "mpi-allgather", "standin"):
        assert arms[n]["status"] == "ok" and arms[n]["wrong_before"] == 0 and arms[n]["wrong_after"] == 0
        assert arms[n]["median_s"] > 0
    # the planted fault: correct on one call, wrong on both ranks after the timed calls
    assert arms["planted"]["status"] == "wrong" and arms["planted"]["wrong_before"] == 0
    assert arms["planted"]["wrong_after"] == 2 and arms["planted"]["median_s"] is None
    # one rank's failure to start is every rank's row
    assert arms["refused"]["status"] == "failed" and "rank 1" in arms["refused"]["reason"]
    assert got["order"][1][0] == "mpi-allgather"


@pytest.mark.skipif(not MPIEXEC.exists(), reason="the mpich wheel's mpiexec is not installed")
@pytest.mark.parametrize("start", ["world", "own"])
def test_groups_measured_at_once_start_each_batch_together(start):
    # two groups of 2 ranks, one 30 ms slower a call: started at one world barrier, no call of batch k begins
    # before every call of batch k-1 has ended; at their own barriers the fast group runs ahead of the slow one
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([str(MPIEXEC), "-n", "4", sys.executable, str(ROOT / "tests/calibrate/start_together_on_ranks.py"),
                        start], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    stamps = json.loads(r.stdout.strip().splitlines()[-1])
    rounds = len(stamps[0])
    together = all(min(s[k][0] for s in stamps) >= max(s[k - 1][1] for s in stamps) for k in range(1, rounds))
    assert together == (start == "world"), stamps


# -- the engine over torch.distributed ranks (gloo): TorchGroup ------
def _torch_ranks(rank, port, out):
    import torch
    import torch.distributed as dist

    from calibrate.measure.engine import Arm, TorchGroup

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)

    class AllReduce(Arm):
        """The sum over ranks by gloo; ``fault_from``: from that call on rank 1 corrupts one element."""

        def __init__(self, fault_from=0):
            self.buf, self.calls, self.fault_from = torch.zeros(64, dtype=torch.float64), 0, fault_from

        def _input(self, seed, r):
            return torch.rand(64, generator=torch.Generator().manual_seed(seed * 7 + r), dtype=torch.float64)

        def call(self):
            self.calls += 1
            dist.all_reduce(self.buf)
            if self.fault_from and rank == 1 and self.calls >= self.fault_from:
                self.buf[0] += 1

        def check(self, seed):
            self.buf.copy_(self._input(seed, rank))
            self.call()
            want = self._input(seed, 0) + self._input(seed, 1)
            return int((~torch.isclose(self.buf, want)).sum())

    def refused():
        if rank == 1:
            raise ImportError("no such library on rank 1")
        return AllReduce()

    group = TorchGroup(torch.device("cpu"))
    res = compare(group, [("gloo", AllReduce), ("planted", lambda: AllReduce(fault_from=2)), ("refused", refused)],
                  Options("host", **FAST, seed=3))
    if rank == 0:
        Path(out).write_text(json.dumps({"comparison": res.to_dict(), "max": group.max(
            np.asarray([float(rank), 5.0])).tolist(), "sum": group.sum(rank + 1)}))
    else:
        group.max(np.asarray([float(rank), 5.0]))
        group.sum(rank + 1)
    dist.destroy_process_group()


def test_engine_on_torch_distributed_ranks(tmp_path):
    from tests.autotune.gloo_runner import free_port

    torch = pytest.importorskip("torch")
    port = free_port()
    out = tmp_path / "out.json"
    torch.multiprocessing.spawn(_torch_ranks, args=(port, str(out)), nprocs=2)
    got = json.loads(out.read_text())
    arms = {a["name"]: a for a in got["comparison"]["arms"]}
    assert arms["gloo"]["status"] == "ok" and arms["gloo"]["wrong_before"] == 0 == arms["gloo"]["wrong_after"]
    # rank 1 corrupts one element from its second call: found only after the timed calls
    assert arms["planted"]["wrong_before"] == 0 and arms["planted"]["wrong_after"] == 1
    assert arms["planted"]["status"] == "wrong" and arms["planted"]["median_s"] is None
    assert arms["refused"]["status"] == "failed" and "rank 1" in arms["refused"]["reason"]
    assert got["max"] == [1.0, 5.0] and got["sum"] == 3
