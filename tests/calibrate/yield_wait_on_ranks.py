"""Run by tests/calibrate/test_mpi_yield.py under mpiexec -n 3: every collective of the MPI backend on the
world, rank 0 (every collective's root and rank 1's source) joining 30 ms late, with ``yield_while_waiting``
as argv[1] says (on / off). Rank 0 prints one JSON line: per collective the wrong elements of a checked call
(summed over ranks) and how often rank 1 gave up its core (``os.sched_yield``) while it waited for rank 0."""
import json
import sys
import time

from mpi4py import MPI

from calibrate.backends import mpi as mpi_backend
from calibrate.backends.mpi import MpiBackend
from calibrate.collectives import Collective

LATE_S = 0.03


def main():
    world = MPI.COMM_WORLD
    yields = 0
    real_yield = mpi_backend.os.sched_yield

    def counted():
        nonlocal yields
        yields += 1
        real_yield()

    mpi_backend.os.sched_yield = counted
    backend = MpiBackend(world)
    backend.yield_while_waiting = sys.argv[1] == "on"
    out = {}
    for coll in Collective:
        nbytes, _ = backend.aligned(coll, 3 * 4096, "float32")
        wrong = backend.check(coll, nbytes, "float32", seed=7)
        send, recv = backend.buffers(coll, nbytes, "float32")
        world.Barrier()
        yields = 0
        if world.Get_rank() == 0:
            time.sleep(LATE_S)
        backend.launch(coll, send, recv, "float32")
        out[coll.value] = {"wrong": wrong, "yields": world.bcast(yields, root=1)}
    if world.Get_rank() == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
