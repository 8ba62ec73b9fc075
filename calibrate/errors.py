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

