"""Cost simulation against closed forms, and the compile/check commands."""
from __future__ import annotations

import pytest

from calibrate.errors import UserError
from calibrate.profile import Group, Profile
from kernels.__main__ import main as kernels_main
from kernels.gc3.algorithms import build
from kernels.gc3.compiler import compile_program
from kernels.gc3.simulate import PROTOCOL_EFFICIENCY, simulate
from kernels.gc3.ir import Protocol


@pytest.fixture(scope="module")
def prof():
    return Profile.load("gcp-a100")


def _sendrecv(prof, nodes):
    seg = prof.model("sendrecv", Group(2, nodes))[0].segments[0]
    return seg.alpha, seg.beta


def test_two_rank_ring_closed_form(prof):
    """2-rank ring, one tile: both send (hop 1), both rrcs: reduce, send (hop 2), both r: 2 hops + 1 reduce."""
    ir = compile_program(build("ring_allreduce", 2))
    alpha, beta = _sendrecv(prof, 1)
    n = 2 * 64 * 1024
    b = n / 2
    want = 2 * (alpha + b * beta) + 0.25 * b * beta
    assert simulate(ir, n, prof, gpus_per_node=8) == pytest.approx(want, rel=1e-9)


def test_inter_node_is_slower_and_ll_costs_bandwidth(prof):
    ir = compile_program(build("ring_allreduce", 4))
    n = 1 << 20
    assert simulate(ir, n, prof, gpus_per_node=2) > simulate(ir, n, prof, gpus_per_node=4)
    ll = compile_program(build("ring_allreduce", 4, protocol="LL"))
    assert PROTOCOL_EFFICIENCY[Protocol.LL] < 1
    assert simulate(ll, 1 << 26, prof, 4) > simulate(ir, 1 << 26, prof, 4)


def test_more_channels_pipeline_large_messages(prof):
    one = compile_program(build("ring_allreduce", 8, channels=1))
    four = compile_program(build("ring_allreduce", 8, channels=4))
    n = 1 << 26
    assert simulate(four, n, prof, 8) < 0.6 * simulate(one, n, prof, 8)
    assert simulate(one, n, prof, 8) > simulate(one, n // 4, prof, 8) > 0


def test_simulate_rejects_bad_size(prof):
    with pytest.raises(UserError, match="message size must be > 0"):
        simulate(compile_program(build("ring_allreduce", 2)), 0, prof, 8)


def test_compile_then_check(tmp_path, capsys):
    out = tmp_path / "x.xml"
    assert kernels_main(["compile", "ring_allreduce", "--ranks", "8", "--channels", "2", "--instances", "4",
                         "--protocol", "LL", "-o", str(out)]) == 0
    assert kernels_main(["check", str(out), "--seeds", "2"]) == 0
    text = capsys.readouterr().out
    assert "thread blocks  8 per GPU" in text and "correct allreduce on 2 seeds" in text


def test_check_reports_bad_file_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.xml"
    bad.write_text("<algo name='x'")
    assert kernels_main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "malformed or truncated XML at line 1" in err and "Traceback" not in err
