"""Shared command-line plumbing: user errors become one line on stderr, not a traceback."""
from __future__ import annotations

import sys
from typing import Callable, Sequence

from calibrate.errors import UserError


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
