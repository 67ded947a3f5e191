"""The checks a built website must pass (docs/website/check.py) catch what they are for: a solution line even
inside highlighted code, a link to a missing page or anchor, a link out of the site without https."""
from __future__ import annotations

import html

from docs.website import check
from exercises.grading import leaks


def _site(tmp_path, pages: dict[str, str]):
    for name, body in pages.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"<html><body>{body}</body></html>")
    return tmp_path


def test_links_to_missing_pages_anchors_or_plain_http_are_found_from_a_relative_path(tmp_path, monkeypatch):
    _site(tmp_path / "site", {
        "index.html": '<a href="lecture.html#s1">ok</a> <a href="#top">ok</a> <div id="top"></div>'
                      '<a href="gone.html">gone</a> <a href="lecture.html#s2">no anchor</a>'
                      '<a href="http://example.org/">plain http</a> <a href="https://arxiv.org/abs/2310.01889">ok</a>'
                      '<img src="data:image/png;base64,AAAA"> <img src="_images/missing.png">',
        "lecture.html": '<h2 id="s1">one</h2><a href="index.html">back</a>',
        "_static/template.html": '<a href="{{ pathto(x) }}">a template, not a page</a>'})
    monkeypatch.chdir(tmp_path)
    found = check.broken_links(tmp_path.relative_to(tmp_path) / "site")
    assert len(found) == 4, found
    assert any("gone.html" in f for f in found) and any("no #s2" in f for f in found)
    assert any("without https" in f for f in found) and any("missing.png" in f for f in found)


def test_a_solution_line_is_found_in_a_page_even_split_by_highlighting(tmp_path):
    lines = leaks.solution_lines()
    (ex_id, name), body = next((k, v) for k, v in lines.items() if v)
    line = body[0]
    words = line.split(" ")
    highlighted = "".join(f'<span class="n">{html.escape(w)}</span> ' for w in words[:-1]) + html.escape(words[-1])
    site = _site(tmp_path, {"lecture.html": f'<div class="highlight"><pre>{highlighted}</pre></div>',
                            "clean.html": "<p>Nothing to see.</p>"})
    found = check.leaked_solutions(site)
    assert any(ex_id in f and name in f for f in found) and all(f.startswith("lecture.html") for f in found), found
