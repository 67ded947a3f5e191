"""What a built website must never do: show a line of a reference solution, or link to nothing.

``problems(site)`` reads every page of a built site and returns what is wrong, one line each:

* a distinctive line of a graded reference function's body, in any text file the site serves (a page's text
  and markup, its scripts, the search index) — the student release's own scan (``exercises.grading.leaks``);
* a link or a source (``href``, ``src``) inside the site that names a file not there, or an anchor not on
  its page;
* a link out of the site that is not ``https://`` (or ``mailto:``): outside links are not fetched (the
  site is checked offline), only their form.
"""
from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

TEXT = (".html", ".js", ".txt", ".json", ".css", ".ipynb", ".py", ".md")


class _Links(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.links: list[tuple[str, str]] = []     # (attribute, value)
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)
            if value and ((name == "href" and tag in ("a", "link")) or (name == "src" and tag in ("img", "script"))):
                self.links.append((name, value))


def _parse(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(errors="replace"))
    return parser


def broken_links(site: Path) -> list[str]:
    """Every link and source of every page (not the theme's templates in ``_static/``) that resolves to nothing."""
    site = site.resolve()
    pages = {p: _parse(p) for p in site.rglob("*.html") if "_static" not in p.relative_to(site).parts}
    out = []
    for page, parsed in pages.items():
        rel = page.relative_to(site)
        for attr, value in parsed.links:
            parts = urlsplit(value)
            if parts.scheme in ("http", "https", "mailto", "data", "javascript") or value.startswith("//"):
                if parts.scheme == "http" or value.startswith("//"):
                    out.append(f"{rel}: {attr}={value!r} leaves the site without https")
                continue
            if parts.scheme:
                out.append(f"{rel}: {attr}={value!r}: unknown scheme")
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file() or site not in target.parents:
                out.append(f"{rel}: {attr}={value!r} names a file the site does not have")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    out.append(f"{rel}: {attr}={value!r}: no #{parts.fragment} on {target.relative_to(site)}")
    return out


def leaked_solutions(site: Path) -> list[str]:
    from exercises.grading import leaks
    lines = leaks.solution_lines()
    out = []
    for path in sorted(site.rglob("*")):
        if path.suffix not in TEXT or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        text = leaks.page_text(text) if path.suffix == ".html" else text
        out += [f"{path.relative_to(site)}: exercise {ex_id} ({name}) solution line {line!r}"
                for ex_id, name, line in leaks.find_leaks(text, lines)]
    return out


def problems(site: Path) -> list[str]:
    return leaked_solutions(site) + broken_links(site)


if __name__ == "__main__":
    site = Path(sys.argv[1] if len(sys.argv) > 1 else "site")
    found = problems(site)
    print("\n".join(found) or f"{site}: no solution line, every link resolves")
    sys.exit(1 if found else 0)
