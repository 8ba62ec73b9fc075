"""``python -m calibrate module``: time the user's own transformer module on one GPU into a profile.

    python -m calibrate module --model config.json --out h200.json       # transformers' class of the config
    python -m calibrate module --module pkg.mod:factory --model model.json --out h200.json
    python -m calibrate module --model config.json --tensor 1,2,4 --micro-batches 1,2,4 --sequence 4096 --out p.json

Writes the profile's ``module`` section (``calibrate.module``: one block, the embedding and head, forward,
backward, recomputation and the optimizer step, at each tensor width x micro-batch at the sequence, and
the host's cost of each apply path), keeping every other section of --out (or of --profile). The step
model (``python -m autotune``) then prices the blocks of that model from these measurements and the rest
analytically, and the plan says which (``compute_source``). One block is timed, not the model: minutes
for a 1-8 B model at the default shapes.
"""
from __future__ import annotations

import datetime as _dt
import sys
import time
from pathlib import Path

from calibrate.cli import command_parser
from calibrate.errors import UserError
from calibrate.jsonfile import read_json
from calibrate.module import default_sequence
from calibrate.moduletime import measure
from calibrate.optional import require_torch
from calibrate.profile import DEFAULT_PROFILE, Profile
from calibrate.usermodule import MORE, factory_module, hf_module


def parser():
    ap = command_parser("python -m calibrate module", __doc__)
    ap.add_argument("--model", required=True, help="a Hugging Face config.json, or (with --module) a model JSON")
    ap.add_argument("--module", default=None, help="package.module:factory building the model from its fields")
    ap.add_argument("--out", required=True, help="profile JSON to write (merged into if it already is a profile)")
    ap.add_argument("--profile", default=None,
                    help=f"base profile (default: --out if it exists, else {DEFAULT_PROFILE})")
    ap.add_argument("--tensor", default=None, help="tensor-parallel widths (default: 1,2,4,8 that divide the model)")
    ap.add_argument("--micro-batches", default="1,2,4", help="local micro-batch sizes (default 1,2,4)")
    ap.add_argument("--sequence", type=int, default=None,
                    help="tokens per sequence (default: the search's for the model: its sequence, else 4096 "
                         "at most the config's max_position_embeddings)")
    ap.add_argument("--iters", type=int, default=6, help="timed calls per arm (default 6)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda:0", help="cuda:N (cpu only for tests)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs timing the tensor widths at once, the widths shared out by their cost, GPUs 0 to N - 1 "
                         "(default: every visible GPU; 1: one after the other on --device)")
    ap.add_argument("--no-host", action="store_true", help="do not measure the host's cost of the apply paths")
    return ap


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or any(v < 1 for v in out):
        raise UserError(f"--{what} {text!r}: give positive integers separated by commas, e.g. 1,2,4")
    return out


def progress_since(started: float):
    """Progress lines on stderr, each with the seconds since ``started``: where a long run's time goes."""
    return lambda msg: print(f"[module] {time.perf_counter() - started:5.1f} s: {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.iters < 3 or args.warmup < 0:
        raise UserError("--iters must be at least 3 and --warmup non-negative")
    if args.gpus is not None and args.gpus < 1:
        raise UserError(f"--gpus {args.gpus}: give 1 or more (1: the widths one after the other on --device)")
    cfg = read_json(args.model, "model file", "give a Hugging Face config.json or a model JSON")
    if not isinstance(cfg, dict):
        raise UserError(f"model file {args.model!r} is not a JSON object: give a config.json")
    um = factory_module(args.module, cfg) if args.module else hf_module(cfg, f"model file {args.model!r}")
    widths = _ints(args.tensor, "tensor") if args.tensor else um.widths
    mbs = _ints(args.micro_batches, "micro-batches")
    sequence = args.sequence or default_sequence(cfg)
    out = Path(args.out)
    profile = Profile.load(args.profile or (str(out) if out.exists() else DEFAULT_PROFILE))
    torch = require_torch()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("python -m calibrate module times a GPU but torch sees no CUDA device: run it on a GPU machine")
    gpus = args.gpus or (torch.cuda.device_count() if device.type == "cuda" else 1)
    if device.type == "cuda" and gpus > torch.cuda.device_count():
        raise UserError(f"--gpus {gpus}: torch sees {torch.cuda.device_count()} GPU(s): give at most that")
    started = time.perf_counter()
    progress = progress_since(started)
    progress(f"{um.name}: tensor widths {widths}, micro-batches {mbs}, sequence {sequence}, on {device}")
    stamp = _dt.datetime.now().isoformat(timespec="seconds")
    source = (f"python -m calibrate module on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
              f"torch {torch.__version__}, {stamp}; a model of {1 + MORE} blocks less one of one block, medians of "
              f"{args.iters} calls (calibrate.measure)")
    def save(section):  # the shapes timed so far, kept should the host's part be interrupted
        profile.module = section
        progress(f"the timed shapes written to {profile.save(out)}")
    profile.module = measure(torch, um, widths, mbs, sequence, device, args.iters, args.warmup, progress, source,
                             host=not args.no_host, save=save, lanes=gpus)
    path = profile.save(out)
    progress(f"whole run {time.perf_counter() - started:.0f} s")
    print(f"wrote the module section of {um.name} ({len(profile.module.points)} shapes) to {path}")
    return 0
