"""Run by tests/calibrate/test_measure.py under mpiexec: the engine on the MPI backend and on the
CPU stand-in device over MPI ranks; rank 0 prints the comparisons as one JSON line."""
import json
import sys

from mpi4py import MPI

from calibrate.backends.mpi import MpiBackend
from calibrate.measure.engine import MpiGroup, Options, compare
from standin import Device, SumArm


def refuse_on_rank_1():
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise RuntimeError("no such library here")
    return SumArm(Device(), 64, MPI.COMM_WORLD)


def main():
    world = MPI.COMM_WORLD
    group = MpiGroup(world)
    be = MpiBackend(world)
    dev = Device()
    arms = [("mpi-allreduce", lambda: be.arm("allreduce", 4096, "float32")),
            ("mpi-allgather", lambda: be.arm("allgather", 4096, "float64")),
            ("standin", lambda: SumArm(dev, 256, world, name="standin")),
            ("planted", lambda: SumArm(dev, 256, world, fault_from=2, name="planted")),
            ("refused", refuse_on_rank_1)]
    mode = sys.argv[1] if len(sys.argv) > 1 else "host"
    res = compare(group, arms, Options(mode, rounds=4, calls=3, min_batch_s=2e-4, warmup=1, seed=5))
    if world.Get_rank() == 0:
        print(json.dumps(res.to_dict()))


if __name__ == "__main__":
    main()
