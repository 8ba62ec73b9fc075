"""``python -m kernels <command>``: compile, check and benchmark GC3 programs.

    python -m kernels compile <algorithm> --ranks 8 ... -o x.xml
    python -m kernels check x.xml
    python -m kernels bench            # under mpirun -np 2, on GPUs
    python -m kernels peers            # against NCCL (default, best setting, symmetric) and torch SymmetricMemory
    python -m kernels tp-mlp           # a tensor-parallel MLP step, interpreter vs torch NCCL allreduce
    python -m kernels reshard plan.json   # under mpiexec: run a resharding plan, check every tile
    python -m kernels build-tuner      # the NCCL tuner plugin (cc), prints its path
"""
from __future__ import annotations

import sys

from calibrate.cli import dispatch

SUBCOMMANDS = {
    "compile": "kernels.gc3.cli:compile_main",
    "check": "kernels.gc3.cli:check_main",
    "bench": "kernels.interp.cli.bench:main",
    "peers": "kernels.interp.cli.peers:main",
    "tp-mlp": "kernels.interp.cli.tp_mlp:main",
    "reshard": "kernels.reshard.cli:main",
    "build-tuner": "kernels.nccl_tuner.cli:main",
}


def main(argv=None) -> int:
    return dispatch("kernels", __doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
