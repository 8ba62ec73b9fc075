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


# --- inside a package: sub-packages in one declared order, no two-way tie, no file cycle -------------------------
# Each package's sub-packages (its folders), lowest first: one may import only those before it. A package's own
# modules (its top-level files, e.g. autotune/export.py) are units too: no two units import each other, and no
# modules form a cycle. The package's __init__ and __main__ (the command layer) are above all of it.
ORDER = {
    "calibrate": ("profiles", "device", "measure", "backends", "cli"),
    "kernels": ("nccl_tuner", "gc3", "interp", "reshard"),
    "autotune": ("sbp", "nccl", "schedule", "reshard", "plan", "pipeline", "apply", "cli", "execute"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(paths) -> dict[str, set[str]]:
    """{module: the project's modules it imports}: ``from a import b`` names module ``a.b`` where that is one."""
    names = {module_name(p): p for p in paths}

    def resolve(n):
        while n and n not in names:
            n = n.rpartition(".")[0]
        return n
    graph = {}
    for name, path in names.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [resolve(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = [resolve(f"{node.module}.{a.name}") for a in node.names]
            else:
                continue
            out |= {m for m in found if m and m != name}
        graph[name] = out
    return graph


def unit(module: str) -> str | None:
    """The unit of ``module`` inside its package: ``autotune.sbp`` (a folder), ``autotune.export`` (a top-level
    file); None for a package's __init__ and __main__."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
        return None
    return ".".join(parts[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected parts of more than one module (Tarjan's, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                part = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    part.append(w)
                    if w == v:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def tangles(graph: dict[str, set[str]]) -> list[str]:
    """Every file cycle, two-way tie of units and import of a sub-package declared later in ``ORDER``."""
    bad = [f"file cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    ties: dict[tuple[str, str], str] = {}
    for a, outs in graph.items():
        for b in outs:
            ua, ub = unit(a), unit(b)
            if ua and ub and ua != ub and ua.split(".")[0] == ub.split(".")[0]:
                ties.setdefault((ua, ub), f"{a} imports {b}")
    for (ua, ub), why in sorted(ties.items()):
        if ua < ub and (ub, ua) in ties:
            bad.append(f"two-way tie {ua} <-> {ub}: {why}; {ties[(ub, ua)]}")
        pkg, sa, sb = ua.split(".")[0], ua.split(".")[1], ub.split(".")[1]
        order = ORDER.get(pkg, ())
        if sa in order and sb in order and order.index(sb) > order.index(sa):
            bad.append(f"{why}: {pkg}.{sb} is above {pkg}.{sa} in ORDER")
    return bad


def test_sub_packages_are_declared_and_import_one_way_without_cycles():
    for pkg, order in ORDER.items():
        folders = {p.parent.name for p in (ROOT / pkg).glob("*/__init__.py")}
        assert folders == set(order), f"{pkg}: declare the order of its sub-packages {sorted(folders)} in ORDER"
    found = tangles(module_graph(modules()))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("planted, want", [
    ({"autotune/_probe_a.py": "from autotune import _probe_b\n", "autotune/_probe_b.py": "import autotune._probe_a\n"},
     "file cycle: autotune._probe_a <-> autotune._probe_b"),
    ({"autotune/sbp/_probe_up.py": "def f():\n    from autotune.pipeline import search\n"},
     "autotune.sbp._probe_up imports autotune.pipeline.search: autotune.pipeline is above autotune.sbp in ORDER"),
    ({"autotune/_probe_a.py": "from autotune.sbp import cost\n",
      "autotune/sbp/_probe_b.py": "from autotune._probe_a import x\n"}, "two-way tie autotune._probe_a <-> autotune.sbp"),
])
def test_the_graph_walk_would_catch_a_planted_cycle_tie_or_upward_sub_package(planted, want):
    assert not any(want in t for t in tangles(module_graph(modules())))
    try:
        for rel, text in planted.items():
            (ROOT / rel).write_text(text)
        assert any(want in t for t in tangles(module_graph(modules()))), want
    finally:
        for rel in planted:
            (ROOT / rel).unlink()
