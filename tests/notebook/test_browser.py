"""Every notebook as a learner first meets it: JupyterLab in headless Chromium, all cells run, widgets moved.

The notebooks are the student release's (built once per session, see conftest.py), with the stubs as
shipped: what a learner opens before writing anything.  For each one, open it in a fresh JupyterLab
workspace (on a copy of the release in a temporary folder, so nothing is written back), run all cells, and
check that

* no cell ends in an error, the kernel imported the release's packages, no explaining cell waits
  for a solution and grading cells say "not implemented" (tests/release_notebooks.py; when this
  test runs, test_classroom_release.py leaves its own nbclient run of the notebooks to it),
* every widget output rendered as a widget (no "Error displaying widget", none left loading),
* moving each step slider one notch changes the picture under it, and pressing Play does too;

and, the first thing every exercise asks, that ``exercises/collectives.py`` opens from the lab's file
browser (the lab serves the release's root, as ``make lab`` does) and a line typed there is saved.

Screenshots (the whole notebook after the run, each widget before and after it moved) are kept in
``build/screenshots/browser/`` for a person to look at.

Needs Debian's ``chromium`` (``apt install chromium``; playwright drives that system browser, no
browser download) and the ``playwright`` Python package (in the ``test`` extra).  Without them the
test is skipped with that message; ``COURSE_BROWSER_TEST=required`` (set by ``.ci/run``) turns the
skip into a failure.  ``COURSE_CHROMIUM=/path/to/chrome`` picks another Chromium.  Notebooks run
two at a time (two kernels on a 2-core machine).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import BROWSER_HOW, SITE_NOTEBOOKS, browser_missing, headless_chromium
from tests.release_notebooks import WHERE, keep_run, problems

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
SHOTS = ROOT / "build" / "screenshots" / "browser"
TOKEN = "course-browser-test"


def _require_browser():
    missing = browser_missing()
    if missing:
        msg = f"missing {', '.join(missing)}: {BROWSER_HOW}"
        if os.environ.get("COURSE_BROWSER_TEST") == "required":
            pytest.fail(msg)
        pytest.skip(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory, request):
    """JupyterLab (the course's own lab settings) on a copy of the release, served from its root as
    ``make lab`` serves it, its kernels importing that copy; the app is exposed to the page for the
    test.  -> (url, the copy of the release)"""
    _require_browser()
    release = request.getfixturevalue("student_release")
    tmp = tmp_path_factory.mktemp("browser")
    course = tmp / "course"
    shutil.copytree(release, course, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "*.zip"))
    port = _free_port()
    env = dict(os.environ, JUPYTER_CONFIG_PATH=str(ROOT / "scripts" / "jupyter"), JUPYTER_CONFIG_DIR=str(tmp / "cfg"),
               JUPYTER_RUNTIME_DIR=str(tmp / "rt"), BROWSER="true", PYTHONUNBUFFERED="1", PYTHONPATH=str(course))
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           f"--ServerApp.token={TOKEN}", f"--ServerApp.root_dir={course}",
           f"--LabApp.workspaces_dir={tmp / 'ws'}", "--LabApp.expose_app_in_browser=True", "--allow-root"]
    log = open(tmp / "lab.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={TOKEN}", timeout=3):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (tmp / "lab.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", course
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def browser(lab):
    with headless_chromium() as b:
        yield b


# -- in the page ------------------------------------------------------------------------------------

_OPENED = """async () => {          // wait (up to 90 s) for the notebook, its kernel and the commands
  const sleep = ms => new Promise(r => setTimeout(r, ms));
  for (let t = 0; t < 180; t++, await sleep(500)) {
    const app = window.jupyterapp;
    if (!app) continue;
    await app.restored;
    if (!app.commands.hasCommand('notebook:run-all-cells')) continue;
    const w = [...app.shell.widgets('main')].find(x => x.content && x.content.model && x.sessionContext);
    if (!w) continue;
    await w.context.ready; await w.sessionContext.ready;
    if (!(w.sessionContext.session && w.sessionContext.session.kernel)) continue;
    app.shell.activateById(w.id);
    return true;
  }
  return false;
}"""
_START_RUN = """([setupCode, whereCode]) => {  // start "Run All Cells"; window.__courseRun holds the summary when done
  const app = window.jupyterapp;
  const w = [...app.shell.widgets('main')].find(x => x.content && x.content.model && x.sessionContext);
  app.shell.activateById(w.id);
  window.__courseRun = null;
  const kernel = w.sessionContext.session.kernel;
  (setupCode ? kernel.requestExecute({code: setupCode, silent: true, store_history: false}).done : Promise.resolve())
  .then(() => app.commands.execute('notebook:run-all-cells')).then(() => where(w).then(imported => {
                                                        window.__courseRun = Object.assign(summary(w), {imported}); }),
                                                      e => { window.__courseRun = {errors: [String(e)], views: 0,
                                                                                   unrun: -1}; });
  async function where(w) {         // which packages the kernel imported
    let text = '';
    const f = w.sessionContext.session.kernel.requestExecute({code: whereCode});
    f.onIOPub = m => { if (m.header.msg_type === 'stream') text += m.content.text; };
    await f.done;
    return (text.split('\\n').find(l => l.startsWith('IMPORTED')) || '').split(' ').slice(1);
  }
  function summary(w) {
  const model = w.content.model.toJSON();
  const errors = [], views = [];
  model.cells.forEach((c, i) => (c.outputs || []).forEach(o => {
    if (o.output_type === 'error') errors.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
    if (o.data && o.data['application/vnd.jupyter.widget-view+json']) views.push(i);
  }));
  const unrun = model.cells.filter(c => c.cell_type === 'code' && c.source.trim() && c.execution_count === null).length;
  return {errors, views: views.length, unrun, cells: model.cells};
  }
}"""
_WIDGETS = """() => {             // each top-level widget output, marked for the locators below
  const found = [...document.querySelectorAll('.jp-Cell .jp-OutputArea-output')].filter(e =>
    !e.parentElement.closest('.jupyter-widgets') &&
    (e.querySelector('.jupyter-widgets') || /Error displaying widget|Loading widget/.test(e.textContent)));
  return found.map((e, i) => { e.setAttribute('data-course-widget', String(i)); return {
    ok: !!e.querySelector('.jupyter-widgets') && !/Error displaying widget|Loading widget/.test(e.textContent),
    text: e.textContent.slice(0, 200)}; });
}"""


def _wait_changed(locator, before: bytes, seconds: float = 15.0) -> bytes | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.3)
        after = locator.screenshot()
        if after != before:
            time.sleep(0.4)                      # let the frame finish drawing, then keep that picture
            return locator.screenshot()
    return None


# The notebooks the website's test builds pages from (tests/website/test_site.py) run here with their replays' HTML
# animations too (the lab draws the widget; a static page, the animation): set in their kernel before Run All.
ANIMATED = "import os; os.environ['COURSE_ANIMATIONS'] = 'html'"
PARALLEL = 2                      # notebooks running at once (two kernels on a 2-core machine)
RUN_LIMIT = 300                   # seconds one notebook may take to run all its cells


@pytest.fixture(scope="module")
def executed(lab, browser, release_runs):
    """Open every notebook in its own fresh workspace and run all its cells, PARALLEL at a time.
    -> {name: (page, summary of the run, seconds)}; the pages stay open for the widget checks.  Each notebook,
    as it ran, is also kept in ``release_runs`` (conftest.py) for the website's test."""
    url, _ = lab
    queue, running, done = list(NOTEBOOKS), {}, {}
    t_all = time.perf_counter()
    try:
        while queue or running:
            while queue and len(running) < PARALLEL:
                name = queue.pop(0)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                done[name] = (page, None, 0.0)
                t0 = time.perf_counter()
                page.goto(f"{url}/lab/workspaces/test-{Path(name).stem}/tree/notebooks/{name}?reset&token={TOKEN}")
                if not page.evaluate(_OPENED):
                    done[name] = (page, {"errors": ["the notebook or its kernel did not open within 90 s"],
                                         "views": 0, "unrun": -1}, time.perf_counter() - t0)
                    continue
                page.evaluate(_START_RUN, [ANIMATED if Path(name).stem in SITE_NOTEBOOKS else "", WHERE])
                running[name] = (page, t0)
            time.sleep(0.5)
            for name, (page, t0) in list(running.items()):
                summary = page.evaluate("() => window.__courseRun")
                if summary is None and time.perf_counter() - t0 > RUN_LIMIT:
                    summary = {"errors": [f"still running after {RUN_LIMIT} s"], "views": 0, "unrun": -1}
                if summary is not None:
                    done[name] = (page, summary, time.perf_counter() - t0)
                    del running[name]
        print(f"\nall {len(NOTEBOOKS)} notebooks ran in the browser in {time.perf_counter() - t_all:.1f} s "
              f"({PARALLEL} at a time)")
        for name, (_, summary, _) in done.items():
            if summary and not summary["errors"] and summary.get("cells"):
                keep_run(summary["cells"], lab[1] / "notebooks" / name, release_runs / name)
        yield done
    finally:
        for page, _, _ in done.values():
            page.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_its_widgets_move_in_a_real_browser(lab, executed, name):
    executed_release = lab[1]
    page, result, run_seconds = executed[name]
    out = SHOTS / Path(name).stem
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    page.screenshot(path=str(out / "00-after-run-all.png"))
    assert not result["errors"], f"{name}: cells ended in errors: {result['errors']}"
    assert result["unrun"] == 0, f"{name}: {result['unrun']} code cells did not run"
    bad = problems(result["cells"], result["imported"], str(executed_release))
    assert not bad, f"{name} in the release:\n" + "\n".join(bad)

    shown = page.evaluate(_WIDGETS)
    assert len(shown) == result["views"], f"{name}: {result['views']} widget outputs, {len(shown)} on the page"
    bad = [s["text"] for s in shown if not s["ok"]]
    assert not bad, f"{name}: widgets did not render: {bad}"

    outputs = page.locator("[data-course-widget]")
    sliders = plays = 0
    for i in range(outputs.count()):
        box = outputs.nth(i)
        for j in range(box.locator(".widget-slider").count()):
            slider = box.locator(".widget-slider").nth(j)
            handle = slider.locator(".noUi-handle").first
            if slider.locator(".noUi-target[disabled]").count() or not handle.count():
                continue
            box.scroll_into_view_if_needed()
            before = box.screenshot(path=str(out / f"w{i:02d}-slider{j}-before.png"))
            readout = slider.locator(".widget-readout").first.text_content()
            handle.focus()
            handle.press("ArrowRight")
            if slider.locator(".widget-readout").first.text_content() == readout:
                handle.press("ArrowLeft")     # it was at its last step
            after = _wait_changed(box, before)
            assert after is not None, f"{name}: moving slider {j} of widget {i} did not change the picture"
            (out / f"w{i:02d}-slider{j}-after.png").write_bytes(after)
            sliders += 1
        for j in range(box.locator(".widget-play").count()):
            play = box.locator(".widget-play button").first
            before = box.screenshot()
            play.click()
            after = _wait_changed(box, before)
            box.locator(".widget-play button").nth(1).click()   # pause
            assert after is not None, f"{name}: pressing Play on widget {i} did not change the picture"
            (out / f"w{i:02d}-play{j}-after.png").write_bytes(after)
            plays += 1
    source = "\n".join("".join(c["source"]) for c in result["cells"])
    if "player(" in source:
        assert sliders and plays, f"{name}: shows a player but no slider or Play button could be moved"
    seconds = time.perf_counter() - t0
    print(f"\n{name}: all cells ran in {run_seconds:.1f} s; {result['views']} widgets, {sliders} sliders and "
          f"{plays} Play buttons moved in {seconds:.1f} s; screenshots in {out.relative_to(ROOT)}")


@pytest.mark.slow
def test_an_exercise_opens_from_the_lab_file_browser_and_an_edit_is_saved(lab, browser):
    url, course = lab                    # (the edit is a comment: the notebooks, which import this file, run alike)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        edit_an_exercise_in_the_lab(page, url, TOKEN, course, SHOTS / "edit-exercise")
    finally:
        page.close()


EDIT = "# a line typed in the lab's editor by the browser test"


def edit_an_exercise_in_the_lab(page, url: str, token: str, course: Path, shots: Path) -> None:
    """What every exercise asks first: open ``exercises/collectives.py`` from the lab's file browser (the lab
    serves the course's root, as ``make lab`` does), type a line, save; the file on disk then has it."""
    shots.mkdir(parents=True, exist_ok=True)
    page.goto(f"{url}/lab/workspaces/edit-exercise?reset&token={token}")
    listing = page.locator(".jp-DirListing-content")
    listing.get_by_text("exercises", exact=True).dblclick(timeout=90_000)
    listing.get_by_text("collectives.py", exact=True).dblclick(timeout=30_000)
    editor = page.locator(".jp-FileEditor .cm-content").first
    editor.wait_for(timeout=30_000)
    deadline = time.monotonic() + 60                     # the file's text arrives after the editor (a busy machine)
    while "def ring_all_reduce" not in (editor.text_content() or "") and time.monotonic() < deadline:
        time.sleep(0.3)
    assert "def ring_all_reduce" in editor.text_content(), "the editor did not show exercises/collectives.py"
    editor.click()
    page.keyboard.press("Control+End")
    page.keyboard.type(EDIT)
    page.keyboard.press("Control+s")
    source = course / "exercises" / "collectives.py"
    deadline = time.monotonic() + 30
    while EDIT not in source.read_text() and time.monotonic() < deadline:
        time.sleep(0.3)
    page.screenshot(path=str(shots / "exercise-edited.png"))
    assert EDIT in source.read_text(), "the edit typed in the lab did not reach exercises/collectives.py"

