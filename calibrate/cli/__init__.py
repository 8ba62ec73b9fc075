"""The command layer's shared plumbing: one dispatcher for every ``python -m
<package>``, one argument-parser shape, and user errors as one line on stderr.

    SUBCOMMANDS = {"fit": "calibrate.cli.fit:main", ...}
    sys.exit(dispatch("calibrate", __doc__, SUBCOMMANDS))

A new subcommand is one entry in its package's ``SUBCOMMANDS`` table.
"""
from __future__ import annotations

import argparse
import math
import sys
import traceback
from pathlib import Path
from typing import Callable, Sequence

from calibrate.collectives import ALL_COLLECTIVES
from calibrate.errors import UserError, launcher_rank
from calibrate.registry import load

HELP = ("-h", "--help")


def flag(name: str) -> str:
    """A library parameter's command-line option: ``min_bytes`` -> ``--min-bytes``."""
    return "--" + name.replace("_", "-")


def spelled_by(parser: argparse.ArgumentParser) -> Callable[[str], str]:
    """Parameters spelled as ``parser`` names its options, short alias included:
    ``iters`` -> ``--iters (-n)``; a parameter it lacks as ``flag`` spells it."""
    options = {a.dest: a.option_strings for a in parser._actions if a.option_strings}

    def spell(name: str) -> str:
        opts = options.get(name) or [flag(name)]
        long = [o for o in opts if o.startswith("--")] or opts
        short = [o for o in opts if o not in long]
        return long[0] + (f" ({short[0]})" if short else "")
    return spell


def finite_float(text: str) -> float:
    """An option's number (argparse ``type``): NaN and infinities refused, as no real setting is one."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number: give a number such as 1.5")
    return value


SEED_LIMIT = 2**32  # numpy's and torch's seeds alike take 0 .. 2^32 - 1


def seed_int(text: str) -> int:
    """A ``--seed`` (argparse ``type``): an integer from 0 to 2^32 - 1, checked on every rank before any
    rank waits on another."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} is not a seed: give an integer from 0 to {SEED_LIMIT - 1}")
    return value


def message(e: UserError, spell: Callable[[str], str] = flag) -> str:
    """A user error as the command line shows it: parameters spelled as options."""
    return e.render(spell)


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None,
            prog: str = "") -> int:
    """Call ``main(argv)``; print a ``UserError`` as one line (once: by rank 0 under a launcher, every
    rank finding the same error in the same arguments) and return 2; Ctrl-C returns 130; a closed
    output (``--help | head``) ends quietly."""
    stop = terminate_as_exit()
    try:
        return int(main(argv) or 0)
    except UserError as e:
        if launcher_rank() == 0:
            print(f"{prog + ': ' if prog else ''}error: {message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog + ': ' if prog else ''}interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return quiet_broken_pipe()
    except ImportError:
        hidden = shadowing_package()
        if hidden is None:
            raise
        if launcher_rank() == 0:
            name, folder = hidden
            print(f"{prog + ': ' if prog else ''}error: the package {name!r} in {str(folder)!r} hides this project's "
                  f"own {name!r} (python -m puts the current folder first on the import path): run the console "
                  f"script (commtune-autotune, commtune-calibrate) instead of python -m, or run from another folder",
                  file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help (0) or a bad option (2), its message already printed; SIGTERM
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        raise
    finally:
        stop()


def terminate_as_exit() -> Callable[[], None]:
    """SIGTERM (a scheduler's cancel, a launcher stopping its ranks) raised as ``SystemExit(143)`` in the
    main thread, so that ``finally`` clauses run (temporary files removed, locks released) as for Ctrl-C;
    returns the function that puts the previous handler back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


# the project's top-level packages: one of the same name earlier on the import path hides it
PACKAGES = ("calibrate", "models", "autotune", "kernels", "reports")


def shadowing_package() -> tuple[str, Path] | None:
    """(name, folder) of a loaded package named as one of the project's but from elsewhere (a
    training repository's own ``models/`` where ``python -m autotune`` runs), else None."""
    home = Path(__file__).resolve().parents[2]
    for name in PACKAGES:
        where = getattr(sys.modules.get(name), "__file__", None)
        if where and not Path(where).resolve().is_relative_to(home):
            return name, Path(where).parent
    return None


def quiet_broken_pipe() -> int:
    """The reader of stdout went away (``| head``): no more output, no traceback at exit."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141


def dispatch(prog: str, doc: str, subcommands: dict[str, str], argv: Sequence[str] | None = None,
             default: str | None = None) -> int:
    """Run the subcommand named by ``argv[0]`` (``subcommands``: name -> ``"module:function"``).

    Without a subcommand, ``default`` (a ``"module:function"``) runs on all of
    ``argv`` when given; otherwise no arguments print ``doc`` (the usage) and
    return 2. ``-h`` prints ``doc`` (which lists the subcommands), then the
    default command's own help. An unknown command is one line and 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in subcommands:
        return run_cli(lambda a: load(subcommands[argv[0]])(a), argv[1:], prog=f"{prog} {argv[0]}")
    if argv and argv[0] in HELP:
        try:
            print(plain(doc).strip(), flush=True)
        except BrokenPipeError:
            return quiet_broken_pipe()
        if default is None:
            return 0
        print()
    elif not argv and default is None:
        print(plain(doc).strip(), file=sys.stderr)
        return 2
    elif argv and not argv[0].startswith("-") or default is None:
        print(f"{prog}: error: unknown command {argv[0]!r}: use one of {', '.join(subcommands)}", file=sys.stderr)
        return 2
    return run_cli(lambda a: load(default)(a), argv, prog=prog)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's help ends with its default unless it names one already."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default not in (None, False, argparse.SUPPRESS) and "default" not in text.lower()
                and action.option_strings and action.nargs != 0):
            text += " (default %(default)s)"
        return text


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: the problem, then where the options are listed."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n" if launcher_rank() == 0 else None)

    def print_help(self, file=None):
        try:
            super().print_help(file)
            (file or sys.stdout).flush()
        except BrokenPipeError:
            quiet_broken_pipe()


def plain(text: str | None) -> str | None:
    """Help text from a docstring: RST's double backticks dropped (``python -m x`` -> python -m x)."""
    return text.replace("``", "") if text else text


def command_parser(prog: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """The argument parser of a command: its description kept as written (RST's backticks dropped),
    defaults shown; an epilog that repeats the description (a module docstring) is shown once."""
    description = plain(description)
    epilog = plain(kwargs.pop("epilog", None))
    if epilog and description and epilog.strip().startswith(description.strip()):
        epilog = epilog.strip()[len(description.strip()):].lstrip("\n").rstrip() or None
    return CommandParser(prog=prog, description=description, epilog=epilog, formatter_class=HelpFormatter,
                         **kwargs)


def run_on_ranks(comm, work: Callable[[], object], prog: str, collective: bool = False):
    """``work()`` on rank 0 (its result broadcast), or on every rank with ``collective``
    (each rank's own result); a ``UserError`` on any rank is printed once, by rank 0,
    and every rank gets None. ``work`` returns something other than None. A collective
    ``work`` must raise its user errors before any rank waits on another."""
    result, error = None, None
    if collective or comm.Get_rank() == 0:
        try:
            result = work()
        except UserError as e:
            error = message(e)
        except Exception:  # a bug on this rank: the other ranks would wait on it forever; end them all
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            comm.Abort(1)
    if collective:
        error = next((e for e in comm.allgather(error) if e), None)
    else:
        result, error = comm.bcast((result, error), root=0)
    if error is None:
        return result
    if comm.Get_rank() == 0:
        print(f"{prog}: error: {error}", file=sys.stderr)
    return None


def add_timing_args(p: argparse.ArgumentParser, mode_default: str | None, min_default: str | None) -> None:
    """The options of how to time, shared by ``calibrate run`` and ``calibrate validate --random``."""
    p.add_argument("--backend", default="auto", help="nccl (GPUs, cupy), mpi (host buffers) or auto "
                   "(nccl when a GPU is visible, else mpi). Default: auto")
    p.add_argument("--collectives", "-c", default=",".join(c.value for c in ALL_COLLECTIVES),
                   help="comma-separated: allreduce,allgather,reducescatter,alltoall,broadcast,sendrecv")
    p.add_argument("--min-bytes", "-b", default=min_default,
                   help=f"smallest size (K/M/G suffixes). Default {min_default or '1K'}")
    p.add_argument("--max-bytes", "-e", default=None, help="largest size. Default 1G with nccl, 64M with mpi")
    p.add_argument("--dtype", "-d", default="float32", help="float32, float16, bfloat16 (nccl), float64, int32")
    p.add_argument("--iters", "-n", type=int, default=20, help="calls per timed batch (host, graph) or timed calls (isolated)")
    p.add_argument("--warmup", "-w", type=int, default=5, help="untimed calls before timing each size")
    p.add_argument("--reps", type=int, default=5, help="timed batches per size in host and graph modes")
    p.add_argument("--min-batch-ms", type=finite_float, default=1.0,
                   help="in host and graph modes a timed batch lasts at least this long: at small sizes more than "
                        "--iters calls (a power of two, from a probe after the warmup), so that the ranks' start "
                        "skew and the launch are a fraction of a percent of each sample; 0: always --iters. "
                        "Default 1")
    p.add_argument("--mode", "-m", default=mode_default, help="host (CPU clock, one sync), graph (CUDA graph, "
                   "events) or isolated (barrier, one call, sync). Default " + (mode_default or "the profile's"))
    p.add_argument("--groups", default="world,intra,inter",
                   help="groups to measure: world, intra (ranks of one host), inter (one rank per host), pairs "
                        "(groups of 2 inside a host, all at once: a fit for p = 2 beside the world's)")
    p.add_argument("--nodes-share-cores", action="store_true",
                   help="the nodes are emulated on one machine (e.g. network namespaces) and share its cores: time "
                        "the intra groups one node at a time, the other ranks asleep, as on separate machines (all "
                        "at once, each rank's busy wait takes turns with the others' on the shared cores); in groups "
                        "across nodes a waiting rank yields its core (mpi)")
    p.add_argument("--out", "-o", default=None, help="results directory. Default results/calib-<date>-<time>")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out, skipping what is done")


def run_mpi_command(work: Callable[[], int], world, prog: str, interrupted: str,
                    spell: Callable[[str], str] = flag) -> int:
    """``work()`` on every rank of an MPI job: a ``UserError`` printed once (by rank 0) and 2;
    Ctrl-C says ``interrupted`` and aborts the job with 130; any other exception is printed
    and aborts the job with 1, so that no rank is left waiting for a failed one."""
    try:
        return int(work() or 0)
    except UserError as e:
        if world.Get_rank() == 0:
            print(f"{prog}: error: {message(e, spell)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {interrupted}", file=sys.stderr)
        world.Abort(130)
    except Exception:  # noqa: BLE001  (one rank failing must not leave the others hanging)
        traceback.print_exc()
        world.Abort(1)
    return 1
