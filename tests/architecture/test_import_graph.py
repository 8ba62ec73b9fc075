"""Imports flow one way: calibrate (with the device layer) <- models, kernels <- autotune <- reports.

Every import statement of every module (top level or inside a function) is read from
its source; a package may import only the packages below it, and nothing but the
command layer (a package's ``__main__``) imports ``reports``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "calibrate": {"calibrate"},
    "models": {"calibrate", "models"},
    "kernels": {"calibrate", "kernels"},
    "autotune": {"calibrate", "models", "kernels", "autotune"},
    "reports": {"calibrate", "models", "kernels", "autotune", "reports"},
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level project package, line) of every absolute import in ``path``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out |= {(n.split(".")[0], node.lineno) for n in names if n.split(".")[0] in ALLOWED}
    return out


def modules():
    return [p for pkg in ALLOWED for p in sorted((ROOT / pkg).rglob("*.py"))]


def violations(path: Path) -> list[str]:
    own = path.relative_to(ROOT).parts[0]
    command_layer = path.name == "__main__.py"
    bad = []
    for pkg, line in sorted(imported_packages(path)):
        if pkg not in ALLOWED[own] and not (command_layer and pkg == "reports"):
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {pkg} (upward)")
        elif pkg == "reports" and own != "reports" and not command_layer:
            bad.append(f"{path.relative_to(ROOT)}:{line} imports reports outside the command layer")
    return bad


def test_every_module_imports_downward_only():
    found = [v for p in modules() for v in violations(p)]
    assert not found, "\n".join(found)


def test_the_walk_sees_every_package_and_would_catch_an_upward_import(tmp_path):
    assert {p.relative_to(ROOT).parts[0] for p in modules()} == set(ALLOWED)
    fake = ROOT / "kernels" / "_probe_upward.py"
    try:
        fake.write_text("def f():\n    from autotune.reshard.plan import make_plan\n")
        assert violations(fake) == ["kernels/_probe_upward.py:2 imports autotune (upward)"]
    finally:
        fake.unlink()


@pytest.mark.parametrize("text, ok", [("import reports\n", False), ("from reports.html import Section\n", False)])
def test_library_modules_may_not_import_reports(text, ok, tmp_path):
    fake = ROOT / "autotune" / "_probe_reports.py"
    try:
        fake.write_text(text)
        assert (violations(fake) == []) is ok
    finally:
        fake.unlink()
