"""The course's website in a real browser: the index and one full lecture, built as ``make site`` builds them
(docs/website/build.py: pages from the student release's executed notebooks, Sphinx, the checks), served on
loopback and opened in headless Chromium.

The notebooks are the ones tests/notebook/test_browser.py ran in JupyterLab in the same test run, with their replays'
HTML animations (nothing runs twice); alone, this test executes them itself, as ``make site`` does.  The
lecture is 4b: its Gantt chart is a replay, and it has maths and figures.

Checked on every page: no console error, no failed request, every figure loaded; on the lecture, that pressing
Play changes the animation's frame; in every file and every page's text, no line of a reference solution (the
release's own scan); every link inside the site resolving (statically, fragments included, and each page
fetched); the search finding a lecture's word.  Screenshots go to ``build/screenshots/website/``.  Needs
Chromium and playwright, as test_browser.py does.
"""
from __future__ import annotations

import functools
import http.server
import threading
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from docs.website import build
from exercises.grading import leaks
from tests.notebook.test_browser import _require_browser
from tests.conftest import SITE_NOTEBOOKS, headless_chromium

ROOT = Path(__file__).resolve().parents[2]
LECTURE = SITE_NOTEBOOKS[1]                 # "04b_pipeline_parallelism"
SHOTS = ROOT / "build" / "screenshots" / "website"
# in the browser: the home page, the lecture and the generated papers page (the static check reads every page)
PAGES = ["index.html", f"{LECTURE}.html", "references.html"]


@pytest.fixture(scope="module")
def site(release_runs, student_release, tmp_path_factory):
    """The site of the index and LECTURE, from the release's notebooks as test_browser.py ran them in JupyterLab
    (when it ran in this test run; else executed here as ``make site`` does)
    -> (folder, its problems by check.py, (figures, replays) the lecture's run drew)."""
    _require_browser()
    tmp = tmp_path_factory.mktemp("website")
    names = list(SITE_NOTEBOOKS)
    executed = release_runs
    t0 = time.perf_counter()
    if not all((release_runs / f"{n}.ipynb").exists() for n in names):
        executed = tmp / "executed"
        build.execute(student_release, names, executed, jobs=2, progress=lambda s: None)
    t1 = time.perf_counter()
    problems = build.build(tmp / "site", executed, names, work=tmp / "work")
    how = "ran in the browser test" if executed == release_runs else f"executed in {t1 - t0:.1f} s"
    print(f"\nwebsite: the index and {LECTURE} {how}, built and checked in {time.perf_counter() - t1:.1f} s")
    outputs = [o.get("data", {}) for c in nbformat.read(executed / f"{LECTURE}.ipynb", as_version=4).cells
               for o in c.get("outputs", [])]
    figures = sum("image/png" in d and "text/html" not in d for d in outputs)
    replays = sum("course-animation" in d.get("text/html", "") for d in outputs)
    return tmp / "site", problems, (figures, replays)


@pytest.fixture(scope="module")
def served(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site[0])))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def chromium(served):
    with headless_chromium() as b:
        yield b


def _open(chromium, url: str):
    """A page at ``url`` with what went wrong on it: console errors, uncaught exceptions, failed requests."""
    page = chromium.new_page(viewport={"width": 1300, "height": 1000})
    wrong: list[str] = []
    page.on("console", lambda m: wrong.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: wrong.append(f"uncaught: {e}"))
    page.on("requestfailed", lambda r: wrong.append(f"failed request: {r.url[:120]} ({r.failure})"))
    page.on("response", lambda r: wrong.append(f"HTTP {r.status}: {r.url[:120]}") if r.status >= 400 else None)
    page.goto(url, wait_until="load")
    return page, wrong


def test_the_built_site_has_no_solution_line_and_no_broken_link(site):
    folder, problems, _ = site
    assert not problems, "\n".join(problems)
    assert (folder / "search.html").exists() and (folder / "searchindex.js").exists()


@pytest.mark.parametrize("name", PAGES)
def test_a_page_loads_with_no_error_its_figures_shown_no_solution_in_its_text(site, chromium, served, name):
    page, wrong = _open(chromium, served + name)
    try:
        page.wait_for_timeout(300)              # scripts that run after load (MathJax, the theme)
        images = page.eval_on_selector_all("main img", "els => els.map(e => [e.complete && e.naturalWidth > 0, "
                                                       "e.getAttribute('src').slice(0, 60)])")
        assert all(ok for ok, _ in images), f"{name}: figures not shown: {[s for ok, s in images if not ok]}"
        if name == f"{LECTURE}.html":
            figures, replays = site[2]
            assert figures >= 1 and replays >= 1
            assert page.locator(".course-animation").count() == replays
            assert len(images) >= figures + replays, f"{name}: {len(images)} pictures, {figures} figures drawn"
            assert page.locator("mjx-container").count() >= 1, "the bubble's formula was not typeset"
        text = page.inner_text("body")
        assert not leaks.find_leaks(text), leaks.find_leaks(text)
        assert "Splitting the Work" in page.title()
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"{Path(name).stem}.png"))
        # every link inside the site answers
        for href in set(page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")):
            if href.startswith(served):
                with urllib.request.urlopen(href.split("#")[0], timeout=10) as r:
                    assert r.status == 200, href
        assert not wrong, f"{name}:\n" + "\n".join(wrong)
    finally:
        page.close()


def test_pressing_play_advances_the_lectures_animation(chromium, served):
    page, wrong = _open(chromium, served + f"{LECTURE}.html")
    try:
        anim = page.locator(".course-animation").first
        assert page.locator(".course-animation").count() >= 1, "no replay animation on the lecture"
        anim.scroll_into_view_if_needed()
        anim.locator(".first").click()
        before = (anim.get_attribute("data-frame"), anim.locator("img").get_attribute("src"))
        assert before[0] == "0"
        shot = anim.screenshot()
        anim.locator(".play").click()
        page.wait_for_function("el => el.getAttribute('data-frame') !== '0'", arg=anim.element_handle(),
                               timeout=10_000)
        after = (anim.get_attribute("data-frame"), anim.locator("img").get_attribute("src"))
        assert after[0] != before[0] and after[1] != before[1], "the frame's picture did not change"
        assert anim.screenshot() != shot
        assert anim.locator(".caption").inner_text().strip()
        anim.locator(".play").click()                       # pause
        anim.locator(".last").click()
        assert anim.get_attribute("data-frame") == str(int(anim.get_attribute("data-frames")) - 1)
        SHOTS.mkdir(parents=True, exist_ok=True)
        anim.screenshot(path=str(SHOTS / "animation-last-frame.png"))
        assert not wrong, "\n".join(wrong)
    finally:
        page.close()


def test_the_search_finds_a_lecture_by_its_words(chromium, served):
    page, wrong = _open(chromium, served + "search.html?q=bubble")
    try:
        page.wait_for_selector("#search-results ul li a", timeout=15_000)
        found = page.eval_on_selector_all("#search-results ul li a", "els => els.map(e => e.getAttribute('href'))")
        assert any(LECTURE in h for h in found), found
        assert not wrong, "\n".join(wrong)
    finally:
        page.close()

