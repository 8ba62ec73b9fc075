"""Run by tests/calibrate/test_measure.py under mpiexec -n 4: two groups of 2 ranks measured at once,
group 0's calls 30 ms slower; with ``world`` each timed batch of both groups starts at one barrier of
the world (``MpiGroup``'s start), with ``own`` at each group's own. Rank 0 prints, per rank, the
(start, end) of every timed call on the machine's monotonic clock as one JSON line."""
import json
import sys
import time

from mpi4py import MPI

from calibrate.measure.engine import MpiGroup, Options, compare
from standin import Device, SumArm

ROUNDS = 4


class Stamped(SumArm):
    def __init__(self, comm, delay_s):
        super().__init__(Device(), 64, comm)
        self.delay_s, self.stamps = delay_s, []

    def call(self) -> None:
        t0 = time.monotonic()
        time.sleep(self.delay_s)
        super().call()
        self.stamps.append((t0, time.monotonic()))


def main():
    world = MPI.COMM_WORLD
    colour = world.Get_rank() // 2
    sub = world.Split(colour, world.Get_rank())
    arm = Stamped(sub, 0.03 if colour == 0 else 0.0)
    start = world if sys.argv[1] == "world" else None
    compare(MpiGroup(sub, start), [("stamped", lambda: arm)], Options("host", rounds=ROUNDS, calls=1, min_batch_s=0,
                                                                    warmup=0, check=False))
    stamps = world.gather(arm.stamps[-ROUNDS:], root=0)
    if world.Get_rank() == 0:
        print(json.dumps(stamps))


if __name__ == "__main__":
    main()
