"""Optional dependencies: torch is an extra (``pip install -e '.[torch]'``); the
commands that need it import it through here and get a one-line error without it."""
from __future__ import annotations

from calibrate.errors import UserError

TORCH_FIX = "pip install -e '.[torch]'"


def require_torch():
    """The ``torch`` module, or a UserError naming the extra that installs it."""
    try:
        import torch
    except ImportError:
        raise UserError(f"this command needs PyTorch, which is not installed: run {TORCH_FIX}") from None
    return torch
