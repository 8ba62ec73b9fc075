"""The command layer's shared plumbing: one dispatcher for every ``python -m
<package>``, one argument-parser shape, and user errors as one line on stderr.

    SUBCOMMANDS = {"fit": "calibrate.fit_cli:main", ...}
    sys.exit(dispatch("calibrate", __doc__, SUBCOMMANDS))

A new subcommand is one entry in its package's ``SUBCOMMANDS`` table.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from calibrate.errors import UserError
from calibrate.registry import load

HELP = ("-h", "--help")


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None,
            prog: str = "") -> int:
    """Call ``main(argv)``; print a ``UserError`` as one line and return 2; Ctrl-C returns 130."""
    try:
        return int(main(argv) or 0)
    except UserError as e:
        print(f"{prog + ': ' if prog else ''}error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog + ': ' if prog else ''}interrupted", file=sys.stderr)
        return 130


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
        return run_cli(load(subcommands[argv[0]]), argv[1:], prog=f"{prog} {argv[0]}")
    if argv and argv[0] in HELP:
        print(doc.strip())
        if default is None:
            return 0
        print()
    elif not argv and default is None:
        print(doc.strip(), file=sys.stderr)
        return 2
    elif argv and not argv[0].startswith("-") or default is None:
        print(f"{prog}: error: unknown command {argv[0]!r}: use one of {', '.join(subcommands)}", file=sys.stderr)
        return 2
    return run_cli(load(default), argv, prog=prog)


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
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def command_parser(prog: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """The argument parser of a command: its description kept as written, defaults shown."""
    return CommandParser(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)


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
            error = str(e)
    if collective:
        error = next((e for e in comm.allgather(error) if e), None)
    else:
        result, error = comm.bcast((result, error), root=0)
    if error is None:
        return result
    if comm.Get_rank() == 0:
        print(f"{prog}: error: {error}", file=sys.stderr)
    return None
