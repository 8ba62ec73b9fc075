"""Run by tests/kernels/test_interp_engine_arms.py under mpiexec: the tp-mlp step arms on MPI
ranks (CPU), the reference summed on the host; rank 1's "interp" allreduce corrupts its output
from its third call (the second step) on. Rank 0 prints, as one JSON line, the eager comparison
of a fresh planted arm and NCCL's stand-in ("eager"), and the row of ``compare_steps`` on the
variants (one planted counter shared by the graph and the eager arm)."""
import json
import types

import torch
from mpi4py import MPI

from calibrate.measure.engine import MpiGroup, compare
from kernels.interp.cli import tp_mlp


def main():
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    host = tp_mlp.host_allreduce(torch, world)

    def planted():
        calls = [0]

        def allreduce(t):
            calls[0] += 1
            out = host(t)
            if rank == 1 and calls[0] >= 3:
                out.view(-1)[0] += 1.0
            return out
        return allreduce

    g = torch.Generator().manual_seed(10 + rank)
    w1 = torch.randn(8, 4, generator=g, dtype=torch.float64).requires_grad_()
    w2 = torch.randn(4, 8, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    dy = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    reference = tp_mlp.make_layer(torch, host)
    args = types.SimpleNamespace(steps=2, reps=3)

    def arm(step):
        return tp_mlp.StepArm(torch, step, reference, x, w1, w2, dy, 1e-9)
    eager = compare(MpiGroup(world), [("interp_eager", lambda: arm(tp_mlp.make_layer(torch, planted()))),
                                      ("nccl_eager", lambda: arm(tp_mlp.make_layer(torch, host)))],
                    tp_mlp.eager_options(args))
    steps = {"interp": tp_mlp.make_layer(torch, planted()), "nccl": tp_mlp.make_layer(torch, host)}
    graph, shared, _ = tp_mlp.compare_steps(MpiGroup(world), steps, arm, args)
    row = tp_mlp.row_from(5, 5 * 8 * 8, "test", graph, shared, 0.0)
    if rank == 0:
        print(json.dumps({"eager": eager.to_dict(), "row": row}))


if __name__ == "__main__":
    main()
