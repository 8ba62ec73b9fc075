"""The resharding executor priced as it runs (issue 45): each plan's operations on the ranks' streams
(``kernels.reshard.model``) against closed forms with given costs per operation."""
from __future__ import annotations

import pytest

from autotune.reshard.cases import parse_scenario
from autotune.reshard.plan import make_plan
from autotune.reshard.solvers import SolverConfig
from kernels.reshard.model import Op, measured_cost, operations, predict, simulate
from kernels.reshard.spec import contiguous

SHAPE = (63, 1024, 256)
N = 63 * 1024 * 256 * 4
P2P, BCAST, GATHER, COPY, FILL = 300e-6, 500e-6, 200e-6, 40e-6, 10e-6


def plan(scenario: str, strategy: str):
    return make_plan(parse_scenario(scenario, SHAPE, "float32", 4), _profile(), strategy,
                     "ensemble", SolverConfig(time_budget=0.05))


def _profile():
    from calibrate.profile import Profile
    return Profile.load("h200-nvlink+ib400")


def cost(op: Op) -> float:
    return {"p2p": P2P, "broadcast": BCAST, "allgather": GATHER, "copy": COPY, "fill": FILL}[op.kind]


def test_one_to_three_send_recv_sends_in_turn_and_each_receiver_takes_its_rows_straight_into_its_tile():
    p = plan("RRR@1,1[0]:S0RR@1,3[1,2,3]", "send_recv")
    ops = operations(p)
    assert [o.kind for o in ops] == ["p2p"] * 3       # rows of a row-major tile: one contiguous run, no place
    assert [o.ranks for o in ops if o.kind == "p2p"] == [(0, 1), (0, 2), (0, 3)] and ops[0].nbytes == N
    assert simulate(ops, cost) == pytest.approx(3 * P2P)
    columns = operations(plan("RRR@1,1[0]:RS1R@1,3[1,2,3]", "send_recv"))
    assert [o.kind for o in columns] == ["copy", "p2p"] * 3   # packed from the sender's tile, received whole


def test_broadcast_is_one_collective_over_the_chain():
    ops = operations(plan("RRR@1,1[0]:S0RR@1,3[1,2,3]", "broadcast"))
    assert [(o.kind, o.ranks) for o in ops][0] == ("broadcast", (0, 1, 2, 3))
    assert simulate(ops, cost) == pytest.approx(BCAST)


def test_global_allgather_fills_copies_scatters_in_turn_then_gathers():
    ops = operations(plan("RRR@1,1[0]:S0RR@1,3[1,2,3]", "global_allgather"))
    part = -(-(N // 4) // 3) * 4
    assert [o for o in ops if o.kind == "p2p"] == [Op("p2p", (0, d), part) for d in (1, 2, 3)]
    assert Op("allgather", (1, 2, 3), 3 * part) in ops
    # sender: fill + copy, three transfers in turn; then the group's all-gather and the places
    assert simulate(ops, cost) == pytest.approx(FILL + COPY + 3 * P2P + GATHER + COPY)


def test_disjoint_pairs_run_at_once_and_a_sender_that_receives_places_its_own():
    two = operations(plan("S0RR@1,2[0,1]:S1RR@1,2[2,3]", "send_recv"))
    assert sorted(o.ranks for o in two if o.kind == "p2p") == [(0, 2), (1, 3)]
    assert simulate(two, cost) == pytest.approx(P2P)        # each received whole into its tile
    shared = operations(plan("S0RR@1,2[0,1]:S0RR@1,3[1,2,3]", "send_recv"))
    assert [o.ranks for o in shared if o.kind == "p2p"] == [(1, 2), (1, 3)] and Op("copy", (1,), N) in shared
    # rank 1 sends twice, then places its own slice; the last receiver places after the second transfer
    assert simulate(shared, cost) == pytest.approx(2 * P2P + COPY)


def test_a_slice_that_is_not_contiguous_in_its_tile_is_packed_first():
    assert contiguous(((0, 2), (0, 4)), ((0, 4), (0, 4))) and contiguous(((1, 2), (0, 2)), ((0, 4), (0, 4)))
    assert not contiguous(((0, 4), (0, 2)), ((0, 4), (0, 4))) and contiguous(((3, 5),), ((0, 8),))
    ops = operations(plan("RRR@1,1[0]:RS1R@1,2[1,2]", "send_recv"))   # columns of a row-major tensor
    assert [o.kind for o in ops][:2] == ["copy", "p2p"]


def test_measured_costs_are_paid_once_for_the_synchronisation():
    """A sequence of operations pays the call's synchronisation once: each measured time less the
    empty call's, the empty call added back (closed form; a planted double count would add 5 x EMPTY)."""
    p = plan("RRR@1,1[0]:S0RR@1,3[1,2,3]", "send_recv")
    empty = 20e-6
    times = {op.key: cost(op) + empty for op in operations(p)}
    assert predict(p, measured_cost(times, empty), empty) == pytest.approx(3 * P2P + empty)


def test_the_host_walks_then_the_streams_run_what_it_queued_last():
    """The dry run (transfers that move nothing) costs the host's walk, the copies and fills, and the
    synchronisation. MPI's blocking operations: the walk is what is left of it less its copies and fills, and the
    streams' whole time follows it. NCCL's queued ones: the dry run waited for the busiest rank's places, so they
    come off it (one rank's: a planted sum over the three receivers would take 3 x COPY off); the first wave's
    copies and fills ran under the walk, and its groups and the places follow it (closed forms)."""
    from kernels.reshard.model import host_time

    p = plan("RRR@1,1[0]:S0RR@1,3[1,2,3]", "global_allgather")
    empty, host = 20e-6, 90e-6
    local = FILL + COPY + COPY          # rank 0's fill and copy, then a receiver's place (transfers free)
    assert host_time(p, cost, empty, local + empty + host) == pytest.approx(host)
    assert host_time(p, cost, empty, local) == 0.0
    assert predict(p, cost, empty, host) == pytest.approx(host + FILL + 2 * COPY + 3 * P2P + GATHER + empty)
    assert host_time(p, cost, empty, host + COPY + empty, asynchronous=True) == pytest.approx(host)
    assert predict(p, cost, empty, host, asynchronous=True) == pytest.approx(host + 3 * P2P + GATHER + COPY + empty)
    assert operations(plan("RRR@1,1[0]:S0RR@1,3[1,2,3]", "send_recv"))[-1].kind == "p2p"   # received in place
    assert host_time(plan("RRR@1,1[0]:S0RR@1,3[1,2,3]", "send_recv"), cost, empty, host + empty, True) == \
        pytest.approx(host)


def test_a_busy_receiver_does_not_hold_its_sender_back():
    """2 -> 1: rank 0 copies its own half while rank 1 sends it the other; the transfer starts when its sender is
    free, so the call takes the transfer, not the copy and then the transfer (closed form; a planted wait for every
    rank of the group gives COPY + P2P). A transfer cannot end before its receiver is free."""
    ops = operations(plan("S1RR@1,2[0,1]:RRR@1,1[0]", "send_recv"))
    assert sorted((o.kind, o.ranks) for o in ops) == [("copy", (0,)), ("p2p", (1, 0))]
    assert simulate(ops, cost) == pytest.approx(P2P)
    assert simulate(ops, lambda o: 2 * P2P if o.kind == "copy" else P2P) == pytest.approx(2 * P2P)


def test_a_wave_runs_both_directions_of_a_link_at_once_and_one_direction_in_turn():
    """A wave's transfers start together when their ranks are free and end together after the busiest rank's
    longer direction: the 2 -> 2 transposed task (each rank sends the other a quarter and receives one) takes one
    transfer where the walk job by job took two; a rank that sends twice to one peer takes both in turn (closed
    forms; a planted sum of both directions would give 2 x P2P for the first)."""
    ops = operations(plan("S1RR@1,2[0,1]:RS1R@1,2[0,1]", "send_recv"))
    p2p = [o for o in ops if o.kind == "p2p"]
    assert sorted(o.ranks for o in p2p) == [(0, 1), (1, 0)] and {o.wave for o in p2p} == {0}
    # each rank: its own quarter one copy (source to destination), the other packed and sent; the quarter it
    # receives is one contiguous run of its destination (all the rows of its columns): no place
    assert sorted((o.kind, o.ranks) for o in ops if o.kind == "copy") == [("copy", (0,))] * 2 + [("copy", (1,))] * 2
    assert all(o.wave == 0 for o in ops)
    assert simulate([o for o in ops if o.kind == "p2p"], lambda o: P2P) == pytest.approx(P2P)
    twice = [Op("p2p", (0, 1), N), Op("p2p", (0, 1), N // 2), Op("copy", (1,), N, wave=2)]
    assert simulate(twice, lambda o: COPY if o.kind == "copy" else P2P * o.nbytes / N) == pytest.approx(1.5 * P2P + COPY)
