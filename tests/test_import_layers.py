"""The course's import graph: no circles, and nothing imports upward.

Every ``import`` and ``from … import`` in ``reference/`` and ``exercises/`` (at module level or inside a
function: both are real dependencies) is an arrow between two modules.  The layers, bottom first:

    runtime        reference.{trace, rank_program, launch, comm, saved}
    foundations    reference.{collectives, mesh}
    axes           reference.{data, tensor, pipeline, sequence, moe}
    composition    reference.{gpt, compose, planner}
    notebooks      reference.notebook, reference.widgets, every axis's ``lecture`` module (and ``lecture_<part>``)
    learner        exercises (the stubs and ``check``/``hint``) and its grader, exercises.grading

A module may import its own layer or the ones below it, never above; and no chain of imports may
come back to where it started.  Imports by name at run time (``importlib.import_module``) are not
arrows: the grader and the launcher dispatch that way on purpose.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("reference", "exercises")

LAYERS = [
    ("runtime", ("reference", "reference.trace", "reference.rank_program", "reference.launch", "reference.zygote",
                 "reference.sources", "reference.comm", "reference.saved", "reference.cpu_time")),
    ("foundations", ("reference.collectives", "reference.mesh")),
    ("axes", ("reference.data", "reference.tensor", "reference.pipeline", "reference.sequence", "reference.moe")),
    ("composition", ("reference.gpt", "reference.compose", "reference.planner", "reference.debug")),
    ("notebooks", ("reference.notebook", "reference.widgets")),
    ("learner", ("exercises",)),
]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def layer_of(module: str) -> int:
    """A module's layer: by its role (an axis's ``lecture``, and a ``lecture_<part>`` beside it, is the notebooks'),
    else by its package."""
    last = module.rpartition(".")[2]
    if last == "lecture" or last.startswith("lecture_"):
        return [name for name, _ in LAYERS].index("notebooks")
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[0]


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The course modules ``module`` imports (resolved to the longest known module name)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()

    def add(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:                       # ``from pkg import module`` imports the module
                sub = f"{target}.{a.name}"
                add(sub if sub in known else target)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_nothing_imports_a_layer_above_its_own():
    names = [name for name, _ in LAYERS]
    upward = [f"{a} ({names[layer_of(a)]}) imports {b} ({names[layer_of(b)]})"
              for a, targets in graph().items() for b in sorted(targets) if layer_of(b) > layer_of(a)]
    assert not upward, "imports that run back up:\n  " + "\n  ".join(upward)


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a circle of imports."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_there_are_no_import_circles():
    g = graph()
    # a package's __init__ that re-exports its own modules is not a circle with them
    g = {m: {t for t in ts if not (m.startswith(t + ".") and (ROOT / t.replace(".", "/") / "__init__.py").exists())}
         for m, ts in g.items()}
    circles = _cycles(g)
    assert not circles, "import circles:\n  " + "\n  ".join(" ↔ ".join(c) for c in circles)


def test_the_layer_map_covers_every_module_and_the_checker_sees_a_real_upward_import():
    for m in modules():
        layer_of(m)
    # the checker is not vacuous: an import of the grader from the runtime would be caught
    assert layer_of("exercises.grading.core") > layer_of("reference.comm")
    assert "reference.comm" in graph()["reference.launch"] or "reference.trace" in graph()["reference.launch"]
