"""Reading and writing the project's versioned JSON files (profiles, plans,
results) with one-line errors instead of tracebacks."""
from __future__ import annotations

import json
import math
from pathlib import Path

from calibrate.errors import UserError
from calibrate.outputs import write_atomic


def read_json(path: str | Path, what: str, fix: str):
    """The parsed content of ``path``; ``what`` names the file in errors
    ("plan file"), ``fix`` says how to get a good one ("write one with --plan-out")."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{what} {str(p)!r} is a directory, not a file: {fix}")
    if not p.is_file():
        raise UserError(f"{what} {str(p)!r} does not exist: {fix}")
    try:
        return json.loads(p.read_bytes())
    except json.JSONDecodeError as e:
        raise UserError(f"{what} {str(p)!r} is not valid JSON ({e.msg} at line {e.lineno}): {fix}") from None
    except ValueError:  # bytes in no JSON encoding (UTF-8, -16 or -32)
        raise UserError(f"{what} {str(p)!r} is not valid JSON (not text): {fix}") from None
    except OSError as e:
        raise UserError(f"cannot read {what} {str(p)!r} ({e.strerror}): {fix}") from None


def dumps(data, what: str = "output") -> str:
    """``data`` as indented JSON text; a NaN or an infinity (which JSON has no word for) is a
    ``UserError`` naming where it is, never written."""
    try:
        return json.dumps(data, indent=1, allow_nan=False) + "\n"
    except ValueError:
        where = non_finite(data) or "a value"
        raise UserError(f"the {what} would hold {where}, which is not a finite number: nothing was written; "
                        f"check the inputs that produced it") from None


def non_finite(data, where: str = "") -> str | None:
    """The path (``tiers/intra/...``) and value of the first NaN or infinity in ``data``, else None."""
    if isinstance(data, float) and not math.isfinite(data):
        return f"{where or 'the value'}={data}"
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, (list, tuple)) else ()
    for k, v in items:
        found = non_finite(v, f"{where}/{k}" if where else str(k))
        if found:
            return found
    return None


def write_json(path: str | Path, data, what: str = "output") -> Path:
    """Write ``data`` as indented JSON, whole or not at all (``write_atomic``), creating missing
    folders; never a NaN or an infinity."""
    return write_atomic(path, dumps(data, what), what)


def read_named_json(name_or_path: str | Path, folder: Path, what: str) -> tuple[object, str]:
    """(content, name) of a preset: a JSON file path, or a name of ``folder/<name>.json``."""
    path = Path(name_or_path)
    if not path.is_file():
        path = Path(folder) / f"{name_or_path}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in Path(folder).glob("*.json")))
        raise UserError(f"no {what} {str(name_or_path)!r}; use one of {known} or a JSON file path")
    return read_json(path, what, "fix the file"), path.stem
