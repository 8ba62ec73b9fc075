"""``python -m kernels build-tuner``: compile the NCCL tuner plugin and print its path."""
from __future__ import annotations

from calibrate.cli import command_parser
from kernels.nccl_tuner.build import build, default_path


def main(argv=None) -> int:
    p = command_parser("python -m kernels build-tuner",
                       "Compile commtune's NCCL tuner plugin (kernels/nccl_tuner/tuner.c) "
                       "with the system C compiler and print the library's path, the value for NCCL_TUNER_PLUGIN.")
    p.add_argument("--out", default=None, help=f"library path (default {default_path()})")
    p.add_argument("--cc", default=None, help="C compiler (default $CC, else cc)")
    args = p.parse_args(argv)
    print(build(args.out, args.cc))
    return 0
