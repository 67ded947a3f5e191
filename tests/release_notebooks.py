"""What a student-release notebook must show with the stubs untouched (shared by the nbclient run in
test_classroom_release.py and the JupyterLab run in test_browser.py, whichever executes it)."""
from __future__ import annotations

import re

NEEDS_SOLUTION = "needs your solution"      # what reference.notebook.course.needs prints when a cell hits a stub
WHERE = "import reference, exercises\nprint('IMPORTED', reference.__file__, exercises.__file__)"


def explains(cell) -> bool:
    """A cell the lecture uses to explain (not to grade): not a ``check(...)`` call and not tagged
    ``exercise`` (a cell that runs the learner's own code on purpose, e.g. "replay your run")."""
    if cell["cell_type"] != "code" or "exercise" in cell.get("metadata", {}).get("tags", []):
        return False
    return not re.search(r"^\s*(\w+\s*=\s*)?check\(", "".join(cell["source"]), re.M)


def cell_text(cell) -> str:
    return "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                   for o in cell.get("outputs", []))


def problems(cells, imported: list[str], release: str) -> list[str]:
    """Everything wrong with an executed release notebook: it imported this repository instead of the
    release, an explaining cell waits for a solution, or a notebook that grades does not say "not
    implemented".  ``cells``: the executed notebook's cells (nbformat dicts)."""
    out = []
    if not imported or not all(p.startswith(release) for p in imported):
        out.append(f"the kernel imported {imported}, not the release's packages in {release}")
    for i, c in enumerate(cells):
        if explains(c) and NEEDS_SOLUTION in cell_text(c):
            out.append(f"explaining cell {i}: {''.join(c['source']).splitlines()[0][:80]!r} "
                       f"printed {cell_text(c).strip()[:200]!r}")
    code = [c for c in cells if c["cell_type"] == "code"]
    if re.search(r"^check\(", "\n".join("".join(c["source"]) for c in code), re.M):    # a notebook that grades
        if "not implemented" not in "\n".join(cell_text(c) for c in code):
            out.append("its check(...) cells do not say 'not implemented'")
    return out


def keep_run(cells, source, dest) -> None:
    """Write a release notebook as it ran (``cells``: its executed cells, nbformat dicts) to ``dest``, with the
    metadata of the notebook file ``source``."""
    import nbformat
    nb = nbformat.read(source, as_version=4)
    # JupyterLab writes "attachments": null on a markdown cell without any; nbformat wants none or a dict
    nb.cells = [nbformat.from_dict({k: v for k, v in c.items() if not (k == "attachments" and v is None)})
                for c in cells]
    nbformat.validate(nb)
    nbformat.write(nb, dest)
