"""The interpreter on any rank count (issue 45): its programs are the GC3 library's, compiled by the
project's compiler for the communicator's size; a table for another rank count or GPU is refused in
one line naming the command that makes the right one."""
from __future__ import annotations

import pytest

from calibrate.errors import UserError
from kernels.gc3.executor import check_program
from kernels.gc3.verify import verify
from kernels.interp import pack
from kernels.interp.preset import Entry, load_preset, programs_for
from kernels.interp.select import choose

COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall")


@pytest.mark.parametrize("nranks", [2, 4, 8])
@pytest.mark.parametrize("coll", COLLECTIVES)
def test_library_entry_compiles_for_the_communicator(coll, nranks):
    """A preset entry naming a library algorithm is compiled for the communicator's size: verified
    (connections, dependencies, no deadlock), correct on the reference executor under random
    interleavings, packed for every rank, one hop (every rank talks to every other directly)."""
    program = Entry(f"direct_{coll}").load(nranks)
    assert program.ngpus == nranks and program.collective == coll and not program.inplace
    summary = verify(program)
    assert summary.ngpus == nranks
    check_program(program, seeds=3)
    for r in range(nranks):
        pk = pack.pack(program, r, nranks)
        assert sorted(p for p in pk.send_peer if p >= 0) == [q for q in range(nranks) if q != r]


@pytest.mark.parametrize("nranks", [4, 8])
def test_selection_serves_a_table_of_library_programs(nranks):
    preset = load_preset("h200x2")
    entries = (Entry("direct_allreduce", max_bytes=1 << 20), Entry("ring_allreduce", min_bytes=1 << 20))
    loaded = programs_for(preset, nranks, entries=entries)
    small = choose(loaded, "allreduce", 256, "float32", nranks, preset.max_split)
    big = choose(loaded, "allreduce", 1 << 20, "float32", nranks, preset.max_split)
    assert small.program.name == "allreduce_direct" and big.program.name.startswith("allreduce_ring")
    assert small.chunk == 256 and big.chunk == (1 << 20) // nranks


def test_table_for_another_rank_count_is_one_line():
    with pytest.raises(UserError, match=r"program 'direct_allreduce_2r' is for 2 ranks, the communicator has 4; "
                                        r"make a table for 4 ranks with mpiexec -n 4 python -m autotune schedule "
                                        r"--gpus 4 .*--preset tuned-4r/manifest.json$") as e:
        programs_for(load_preset("h200x2"), 4)
    assert "\n" not in str(e.value)


def test_table_for_another_gpu_is_one_line():
    preset = load_preset("h200x2")
    assert preset.device == "NVIDIA H200"
    assert len(programs_for(preset, 2, "NVIDIA H200")) == len(preset.entries)
    with pytest.raises(UserError, match=r"tuned on NVIDIA H200, this GPU is NVIDIA H100 .*autotune schedule "
                                        r"--gpus 2"):
        programs_for(preset, 2, "NVIDIA H100 80GB HBM3")


def test_schedule_space_enumerates_the_one_shot_programs_at_four_ranks():
    from autotune.schedule.space import enumerate_candidates, load_space

    built, notes = enumerate_candidates(load_space(), "allgather", 4)
    algs = {b.candidate.algorithm for b in built}
    assert "direct_allgather" in algs and all(b.program.ngpus == 4 for b in built)
    assert any("direct_allgather_2r.xml skipped: it is for 2 ranks" in n for n in notes)


def _receive_waits(program, rank: int = 0) -> int:
    """Receiving steps of ``rank`` that wait on a step of another thread block."""
    return sum(bool(st.deps) for tb in program.gpus[rank].threadblocks for st in tb.steps if st.type.receives)


@pytest.mark.parametrize("nranks", [2, 4, 8])
@pytest.mark.parametrize("coll", ["allreduce", "reducescatter"])
def test_one_shot_through_scratch_compiles_and_no_receive_waits_on_another(coll, nranks):
    """Issue 45 (allreduce at 1 KiB 0.52x NCCL's symmetric kernels on 4 GPUs): ``direct_*`` reduces each
    receive into the output in turn, so its n - 1 receives wait on one another; ``oneshot_*`` receives
    into scratch (no receive waits) and adds locally. Both verified, correct on the reference executor,
    packed for every rank, one hop."""
    program = Entry(f"oneshot_{coll}").load(nranks)
    assert program.ngpus == nranks and program.collective == coll and not program.inplace
    verify(program)
    check_program(program, seeds=3)
    for r in range(nranks):
        pk = pack.pack(program, r, nranks)
        assert sorted(p for p in pk.send_peer if p >= 0) == [q for q in range(nranks) if q != r]
        assert _receive_waits(program, r) == 0
    assert program.gpus[0].s_chunks == nranks - 1
    assert _receive_waits(Entry(f"direct_{coll}").load(nranks), 0) == nranks - 2
