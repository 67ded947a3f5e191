"""The website's pages, from executed notebooks: which notebooks and in what order, what each shows, and the
pages around them (run it yourself, the papers, the changelog).

Order: the course index first, then every notebook the index links to, in its order, then any other notebook
in the folder (a lecture not yet in the index still gets its page): nothing here lists lectures by hand.

What changes from the notebook a learner runs (in the site's copy only):

* outputs keep what a browser can show without a kernel — a replay's widget goes, its HTML animation and
  its PNG stay (``conf.py`` prefers the animation);
* each grading cell (``check("N.M")``) is followed by what the exercise asks: the learner's function as
  the stub states it (signature and docstring, no body) and its hints, one tier per fold;
* a paper cited as ``arXiv:NNNN.NNNNN`` links to its abstract;
* the index ends with the table of contents the navigation is built from.
"""
from __future__ import annotations

import copy
import html
import inspect
import re
from pathlib import Path

import nbformat

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
GRADING = re.compile(r"^\s*(?:\w+\s*=\s*)?check\(([^)]*)\)", re.M)
LINKED = re.compile(r"\]\(([\w.-]+)\.ipynb\)")
ARXIV = re.compile(r"(?<![\[/\w])arXiv:(\d{4}\.\d{4,5})(?![\]\w])")
PAGES = {"run_it_yourself": "Run it yourself", "references": "Papers", "changelog": "Changelog"}


def lecture_order(notebooks: Path) -> list[str]:
    """Notebook stems in site order: ``index``, the notebooks it links to, then the rest by name."""
    index = nbformat.read(notebooks / "index.ipynb", as_version=4)
    text = "\n".join(c.source for c in index.cells if c.cell_type == "markdown")
    linked = [m for m in dict.fromkeys(LINKED.findall(text)) if (notebooks / f"{m}.ipynb").exists()]
    rest = sorted(p.stem for p in notebooks.glob("*.ipynb") if p.stem != "index" and p.stem not in linked)
    return ["index"] + linked + rest


def _shown(outputs: list) -> list:
    """``outputs`` without what needs a kernel: widget views (a replay keeps its HTML animation and PNG)."""
    out = []
    for o in outputs:
        o = copy.deepcopy(o)
        data = o.get("data")
        if data is not None and WIDGET_VIEW in data:
            del data[WIDGET_VIEW]
            if not set(data) - {"text/plain"} and re.match(r"\w+\(", data.get("text/plain", "")):
                data["text/plain"] = "(an interactive widget: run the notebook to use it)"    # not its repr
        out.append(o)
    return out


def _code(text: str) -> str:
    """A hint as HTML: escaped, with its `code` spans."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _stub_head(fn) -> str:
    """A stub's ``def`` line(s) and docstring as written in ``exercises/`` (its body, a nudge, left out)."""
    import ast
    import textwrap
    source = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(source).body[0]
    last = node.body[0].end_lineno if ast.get_docstring(node) else node.body[0].lineno - 1
    return "\n".join(source.splitlines()[:last])


def exercise_note(ex_id: str) -> str | None:
    """Markdown for what exercise ``ex_id`` asks: each function as the stub states it, and the hints in tiers."""
    import importlib

    import exercises
    from exercises.grading import core
    ex = core.load_checks().get(ex_id)
    if ex is None:
        return None
    module = importlib.import_module(f"exercises.{ex.module}")
    parts = [f"**Exercise {ex.id} — {ex.title}.** Write "
             + " and ".join(f"`{name}`" for name in ex.functions) + f" in `exercises/{ex.module}.py`:\n"]
    for name in ex.functions:
        parts.append(f"```python\n{_stub_head(getattr(module, name))}\n    ...\n```\n")
    tiers = exercises.hints().get(ex.id, [])
    for i, tier in enumerate(tiers, 1):
        parts.append(f"<details><summary>Hint {i} of {len(tiers)}</summary><p>{_code(tier)}</p></details>\n")
    return "\n".join(parts)


def _link_papers(text: str) -> str:
    return ARXIV.sub(r"[arXiv:\1](https://arxiv.org/abs/\1)", text)


def _unlink_absent(text: str, pages: set[str]) -> str:
    """Links to notebooks that are not pages of this site (a partial build) become their text."""
    return re.sub(r"\[([^\]]*)\]\(([\w.-]+)\.ipynb\)", lambda m: m[0] if m[2] in pages else m[1], text)


def prepare(nb, *, toc: list[str] | None = None, pages: set[str] | None = None):
    """The site's copy of an executed notebook (see the module docstring); ``toc``: the index's contents;
    ``pages``: the notebooks the site has (links to others lose their target), None for all."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = _link_papers(cell.source if pages is None else _unlink_absent(cell.source, pages))
        if cell.cell_type == "code":
            cell.outputs = _shown(cell.get("outputs", []))
        cells.append(cell)
        if cell.cell_type == "code":
            for call in GRADING.findall(cell.source):
                for ex_id in re.findall(r"[\"']([\w.]+)[\"']", call):
                    note = exercise_note(ex_id)
                    if note:
                        cells.append(nbformat.v4.new_markdown_cell(note))
    if toc is not None:
        lectures = "\n".join(toc)
        pages = "\n".join(PAGES)
        cells.append(nbformat.v4.new_markdown_cell(
            f"```{{toctree}}\n:hidden:\n:caption: Lectures\n\n{lectures}\n```\n\n"
            f"```{{toctree}}\n:hidden:\n:caption: The course\n\n{pages}\n```\n"))
    nb.cells = cells
    return nb


def cited(text: str) -> list[str]:
    """The arXiv identifiers ``text`` cites (``arXiv:2310.01889`` or an arxiv.org link), each once, in order."""
    return list(dict.fromkeys(re.findall(r"arxiv(?::|\.org/abs/)(\d{4}\.\d{4,5})", text, re.I)))


def references_page(bibliography: str, titles: dict[str, str], texts: dict[str, str]) -> str:
    """``docs/references.md`` with, after each paper, the lectures that cite it (``titles`` and ``texts``:
    each lecture's title and markdown, by notebook stem)."""
    citing: dict[str, list[str]] = {}
    for stem, text in texts.items():
        for arxiv in cited(text):
            if stem in titles:
                citing.setdefault(arxiv, []).append(stem)
    out = []
    for line in bibliography.splitlines():
        m = re.search(r"arxiv\.org/abs/(\d{4}\.\d{4,5})", line)
        if m and line.startswith("- ") and citing.get(m.group(1)):
            line += " Cited in " + ", ".join(f"[{titles[s]}]({s}.ipynb)" for s in citing[m.group(1)]) + "."
        out.append(line)
    return "\n".join(out) + "\n"


def notebook_title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            m = re.search(r"^#\s+(.+)$", cell.source, re.M)
            if m:
                return m.group(1).strip()
    return "untitled"
