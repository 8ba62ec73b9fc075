"""The exception types for bad user input in this project.

Library code raises ``UserError`` with a one-line message that names the problem
and the fix; the command-line entry points print it and exit non-zero, never a
traceback. A bad value of one parameter is an ``OptionError``: the library names
the parameter as it spells it (``min_bytes``) and the command layer shows it as
its command-line option (``--min-bytes``), so no library module spells a flag.
"""
from __future__ import annotations

import re
from typing import Callable

NAME = re.compile(r"\{([a-z][a-z0-9_]*)\}")


class UserError(Exception):
    """Bad input from the user: a one-line message naming the problem and the fix."""

    def render(self, spell: Callable[[str], str]) -> str:
        """The message with parameter names spelled by ``spell`` (the command layer's flags)."""
        return str(self)


class OptionError(UserError):
    """A bad value of the parameter ``option``. ``problem`` follows its name; ``{name}`` in it names
    another parameter, spelled the same way (``"must be below {max_bytes}"``)."""

    def __init__(self, option: str, problem: str):
        super().__init__(option, problem)
        self.option, self.problem = option, problem

    def render(self, spell: Callable[[str], str]) -> str:
        return f"{spell(self.option)} {NAME.sub(lambda m: spell(m.group(1)), self.problem)}"

    def __str__(self) -> str:
        return self.render(lambda name: name)



def one_line_in_scripts() -> None:
    """A ``UserError`` that ends a user's own script (one calling ``autotune.apply``, under torchrun or alone)
    shown as the commands show it: one line, ``error: ...``, on stderr of rank 0 only (every rank finds the same
    error in the same input), the exit status 1; other exceptions keep Python's traceback. Installed once, as
    ``sys.excepthook`` (the previous hook called for everything else)."""
    import sys

    previous = sys.excepthook
    if getattr(previous, "_commtune", False):
        return

    def hook(kind, value, tb):
        if not issubclass(kind, UserError):
            return previous(kind, value, tb)
        if _rank() == 0:
            print(f"error: {value}", file=sys.stderr)
    hook._commtune = True
    sys.excepthook = hook


# the rank a launcher gives each process (torchrun, mpiexec of MPICH or Open MPI, srun), first found
RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def launcher_rank() -> int:
    """This process's rank under torchrun, mpiexec or srun (0 when started alone)."""
    import os

    for name in RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _rank() -> int:
    """This process's rank: torch.distributed's where it is initialized, else the launcher's."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return launcher_rank()
