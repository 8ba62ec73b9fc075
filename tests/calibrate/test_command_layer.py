"""The one dispatcher, the plug-in registry and the parser shape shared by every command."""
from __future__ import annotations

import pytest

from calibrate.cli import command_parser, dispatch
from calibrate.errors import UserError
from calibrate.registry import Registry, load

DOC = "python -m demo <command>:\n\n    one   the first\n    two   the second\n"


def _one(argv):
    print("one", *argv)
    return 3


def _fails(argv):
    raise UserError("bad thing: fix it")


SUB = {"one": f"{__name__}:_one", "fails": f"{__name__}:_fails"}


def test_subcommand_gets_the_rest_of_argv(capsys):
    assert dispatch("demo", DOC, SUB, ["one", "a", "b"]) == 3
    assert capsys.readouterr().out == "one a b\n"


def test_no_arguments_print_usage_and_exit_2(capsys):
    assert dispatch("demo", DOC, SUB, []) == 2
    assert "one   the first" in capsys.readouterr().err


def test_help_lists_the_subcommands(capsys):
    assert dispatch("demo", DOC, SUB, ["-h"]) == 0
    assert "two   the second" in capsys.readouterr().out


def test_unknown_command_is_one_line(capsys):
    assert dispatch("demo", DOC, SUB, ["frobnicate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["demo: error: unknown command 'frobnicate': use one of one, fails"]


def test_default_command_runs_on_options_and_no_arguments(capsys):
    assert dispatch("demo", DOC, SUB, ["--x"], default=f"{__name__}:_one") == 3
    assert dispatch("demo", DOC, SUB, [], default=f"{__name__}:_one") == 3
    assert capsys.readouterr().out == "one --x\none\n"
    assert dispatch("demo", DOC, SUB, ["nope"], default=f"{__name__}:_one") == 2


def test_user_error_is_one_line_exit_2(capsys):
    assert dispatch("demo", DOC, SUB, ["fails"]) == 2
    assert capsys.readouterr().err == "demo fails: error: bad thing: fix it\n"


@pytest.mark.parametrize("package", ["calibrate", "kernels", "autotune"])
def test_every_package_unknown_command(package, capsys):
    main = load(f"{package}.__main__:main")
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{package}: error: unknown command 'frobnicate': use one of ") and err.count("\n") == 1


def test_help_shows_every_default_once():
    p = command_parser("demo", "x")
    p.add_argument("--iters", type=int, default=20, help="calls per batch")
    p.add_argument("--out", default="o.json", help="where. Default o.json")
    p.add_argument("--flag", action="store_true", help="a switch")
    text = " ".join(p.format_help().split())
    assert "calls per batch (default 20)" in text
    assert "Default o.json" in text and "(default o.json)" not in text
    assert "a switch (default" not in text


def test_registry_unknown_name_and_lazy_load():
    reg = Registry("backend", {"mpi": "calibrate.backends.mpi:MpiBackend", "x": "no.such.module:X"})
    assert "x" in reg and reg.names() == ["mpi", "x"]
    with pytest.raises(UserError, match="unknown backend 'gloo': choose from mpi, x"):
        reg.get("gloo")
    with pytest.raises(ImportError):
        reg.get("x")


class _Comm:
    """A one-rank stand-in for MPI's world that records an Abort (a real abort would end pytest)."""

    def __init__(self):
        self.aborted = None

    def Get_rank(self):
        return 0

    def bcast(self, value, root=0):
        return value

    def Abort(self, code):
        self.aborted = code
        raise SystemExit(code)


def test_a_bug_on_one_rank_aborts_every_rank(capsys):
    """A non-user error on rank 0 would leave the other ranks in the broadcast forever: the world is aborted."""
    from calibrate.cli import run_on_ranks

    comm = _Comm()
    assert run_on_ranks(comm, lambda: 7, "demo") == 7 and comm.aborted is None
    assert run_on_ranks(comm, lambda: _fails([]), "demo") is None and comm.aborted is None
    assert "demo: error: bad thing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_on_ranks(comm, lambda: 1 / 0, "demo")
    assert comm.aborted == 1 and "ZeroDivisionError" in capsys.readouterr().err


@pytest.mark.parametrize("text,ok", [("0", True), ("4294967295", True), ("-1", False), ("4294967296", False),
                                     ("x", False)])
def test_seed_range_checked_by_the_parser(text, ok):
    import argparse

    from calibrate.cli import seed_int
    if ok:
        assert seed_int(text) == int(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            seed_int(text)
