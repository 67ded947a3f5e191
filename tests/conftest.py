"""Shared test helpers: child-process accounting (no orphans) and kept-alive worlds."""
from __future__ import annotations

import sys

import contextlib
import functools
import os
import time

import pytest

from tests import parallel_run


def descendants(pid: int | None = None) -> set[int]:
    """PIDs of all living descendants of ``pid`` (default: this process), read from /proc."""
    pid = os.getpid() if pid is None else pid
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":  # a zombie is dead; only its parent's wait() is missing
            continue
        parents[int(entry)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        nxt = {c for c, p in parents.items() if p in frontier}
        out |= nxt
        frontier = nxt
    return out


@pytest.fixture
def no_orphans():
    """Fails the test if it leaves child processes behind (after a short grace period).  The zygotes
    that fork ranks and the grader's runners (reference.zygote) live as long as the session: they are
    not left behind, though any rank or runner they forked would be."""
    from reference.zygote import zygote_pids
    before = descendants()
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = descendants() - before - zygote_pids()
        if not left:
            return
        time.sleep(0.1)
    pytest.fail(f"processes left behind: {sorted(left)}")


_worlds: dict[int, object] = {}
_last_used: dict[int, float] = {}
IDLE_WORLD_SECONDS = 30.0


@pytest.fixture(scope="session")
def world():
    """``world(n)`` -> a kept-alive ``reference.launch.World`` of n ranks, shared by the session."""
    from reference.launch import World

    def get(n: int):
        w = _worlds.get(n)
        if w is None or not w.alive:
            w = _worlds[n] = World(n, timeout=60, echo=False).start()
        _last_used[n] = time.monotonic()
        return w
    yield get
    for w in _worlds.values():
        w.close()
    _worlds.clear()


@pytest.fixture(scope="module", autouse=True)
def _close_idle_worlds():
    """Before each test file, close the kept-alive worlds no test asked for in the last IDLE_WORLD_SECONDS
    (a test file's own worlds, and its module fixtures', are never closed under it).  Each gloo group a
    world's ranks made keeps a thread that wakes periodically: the idle worlds of a whole session took
    about half a core of 2 (measured: 32 idle ranks, up to ~40 groups each, ~1.5 % of a core per rank)."""
    now = time.monotonic()
    for n in [n for n, t in _last_used.items() if now - t > IDLE_WORLD_SECONDS and n in _worlds]:
        _worlds.pop(n).close()
        _last_used.pop(n)
    yield


COURSE_REQUESTS: dict[str, dict] = {}      # solutions -> {(exercise, check): digests of what it sent learner code}
COURSE_ORACLE: dict[tuple[str, str], dict] = {}   # (exercise, visible check) -> the oracle answers it recorded


def grade_recording(solutions: str, secret: bytes | None = None, ids=None, oracle: dict | None = None):
    """Grade the whole course (hidden checks included) on the published inputs (``secret`` None) or on
    fresh inputs from ``secret``; also {(exercise, check): digests of the requests it sent the runner}.
    With ``oracle`` (a dict), every ``ctx.oracle`` answer a visible check recorded goes into
    ``oracle[(exercise, check)]`` (what ``release.record_oracle`` records for a student release)."""
    import hashlib

    from exercises.grading import core, sandbox, session
    seen: dict[tuple[str, str], set[str]] = {}
    current = [("", "")]
    call = sandbox.Runner.call
    registry = core.load_checks()

    def recording(self, request, timeout, **kw):
        if request[0] in ("local", "ranks"):
            key = core.Oracle.key("request", request[1:], {})
            seen.setdefault(current[0], set()).add(hashlib.sha256(key.encode()).hexdigest())
        return call(self, request, timeout, **kw)

    def progress(line: str) -> None:
        ex_id, _, rest = line.partition(" ")
        current[0] = (ex_id, rest.rsplit(" ...", 1)[0])

    class ByCheck(dict):              # core.ORACLE.record: each answer filed under the check that asked
        def __setitem__(self, key, value):
            ex = registry.get(current[0][0])
            if ex is not None and any(c.name == current[0][1] and not c.hidden for c in ex.checks):
                oracle.setdefault(current[0], {})[key] = value

    before = core._SALT, core.ORACLE.record
    sandbox.Runner.call, core._SALT = recording, secret
    if oracle is not None:
        core.ORACLE.record = ByCheck()
    try:
        results = session.grade(solutions, ids, include_hidden=True, progress=progress)
    finally:
        sandbox.Runner.call, (core._SALT, core.ORACLE.record) = call, before
    return results, seen


@pytest.fixture(scope="session")
def course_grades():
    """``course_grades(solutions)`` -> (results of every exercise, hidden checks included, seconds it
    took): the whole course graded once per test run and shared by the tests that need it (what each
    check sent learner code is kept in ``COURSE_REQUESTS[solutions]``; for the reference, the oracle
    answers of its visible checks in ``COURSE_ORACLE``: the student release is built from them)."""
    def get(solutions: str):
        def grade():
            t0 = time.perf_counter()
            oracle = {} if solutions == "reference" else None
            results, requests = grade_recording(solutions, oracle=oracle)
            return results, time.perf_counter() - t0, requests, oracle
        results, seconds, COURSE_REQUESTS[solutions], oracle = parallel_run.once(f"course-grades-{solutions}", grade)
        COURSE_ORACLE.update(oracle or {})
        return results, seconds
    return get


@pytest.fixture(scope="session")
def fresh_course_grades():
    """(results, {(exercise, check): request digests}): the reference graded on the whole course, hidden
    checks included, on fresh inputs from one secret drawn for the test run — as ``run_autograder`` grades."""
    return parallel_run.once("course-grades-fresh", lambda: grade_recording("reference", os.urandom(32)))


# -- the student release, built once per session -----------------------------------------------------

@functools.cache
def release_ids() -> list[str]:
    """One exercise per learner module, in course order: 0.1, 5a.1, 5b.1, ... (whatever is registered);
    recording reference answers for these bounds the build time, the scans cover every function."""
    from exercises.grading import core
    registry = core.load_checks()
    return list({ex.module: ex.id for ex in reversed(list(registry.values()))}.values())[::-1]


def release_answers(course_grades) -> dict | None:
    """The oracle answers ``release.record_oracle(release_ids())`` would record — the visible checks of those
    exercises, taken from the session's one grading of the reference on the published inputs — or None if
    the reference lost a point there (the build then grades on its own and says what was lost)."""
    results, _ = course_grades("reference")
    ids = set(release_ids())
    if any(not c.passed for r in results if r.exercise.id in ids for c in r.checks):
        return None
    return {k: v for (ex_id, _), answers in COURSE_ORACLE.items() if ex_id in ids for k, v in answers.items()}


@pytest.fixture(scope="session")
def student_release(tmp_path_factory, course_grades):
    """The student release (``make release``) in a temporary folder, its oracle answers recorded while the
    test run graded the reference (``course_grades``): test_release.py checks it, test_browser.py opens its
    notebooks in JupyterLab.  Built once per run; its timed demos are recorded with no other test running
    (``parallel_run.QUIET``: their timing stories must hold)."""
    from exercises.grading import release
    from reference.notebook import recorded

    def build():
        record_one = recorded._record_one

        def record_quietly(rec, *args, **kw):       # a timed story alone; the other worker goes on meanwhile
            with parallel_run.QUIET.alone() if rec.timed else contextlib.nullcontext():
                return record_one(rec, *args, **kw)
        recorded._record_one = record_quietly
        try:
            return release.build_student(parallel_run.shared_folder(tmp_path_factory, "release"), release_ids(),
                                         make_zip=True, answers=release_answers(course_grades))
        finally:
            recorded._record_one = record_one
    return parallel_run.once("student-release", build)


SITE_NOTEBOOKS = ("index", "04b_pipeline_parallelism")   # what tests/website/test_site.py builds its pages from


@pytest.fixture(scope="session")
def release_runs(tmp_path_factory):
    """A folder for the release's notebooks as tests/notebook/test_browser.py ran them in JupyterLab (outputs and
    HTML animations kept): tests/website/test_site.py builds its pages from them instead of running them again."""
    return tmp_path_factory.mktemp("release-runs")


# -- a browser for tests/notebook/test_browser.py ----------------------------------------------------------------

BROWSER_HOW = ("the browser test needs Debian's Chromium (`sudo apt install chromium`, or "
               "COURSE_CHROMIUM=/path/to/chrome) and playwright (`.venv/bin/pip install playwright`, part of "
               "make test's extras); COURSE_BROWSER_TEST=required makes a missing browser an error")


def chromium_path() -> str | None:
    import shutil
    return os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def browser_missing() -> list[str]:
    import importlib.util
    return (([] if importlib.util.find_spec("playwright") else ["playwright"])
            + ([] if chromium_path() else ["chromium"]))


def browser_available() -> bool:
    return not browser_missing()


@contextlib.contextmanager
def headless_chromium():
    """Debian's Chromium (``chromium_path``), headless, driven by playwright; no background traffic to the
    internet, which this machine and CI do not reach."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), headless=True,
                              args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                                    "--disable-background-networking", "--disable-component-update"])
        try:
            yield b
        finally:
            b.close()


def nobody_who_can_run(python: str):
    """The ``nobody`` user if we are root and it can run ``python`` with torch and the course
    (None otherwise, e.g. for a clone in a mode-700 home folder) — for the run-as tests."""
    import pwd
    import subprocess
    try:
        user = pwd.getpwnam("nobody")
    except KeyError:
        return None
    if os.geteuid() != 0:
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        r = subprocess.run([python, "-c", "import torch, reference.launch"], cwd="/", capture_output=True,
                           user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": root}, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return user if r.returncode == 0 else None


# -- nbval: the notebooks' grading cells are graded elsewhere ---------------------------------------------

def grading_cell(source: str) -> bool:
    """A notebook cell that grades (``check("N.M")``, with or without ``from exercises import check``)."""
    import re
    lines = [ln for ln in source.strip().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return bool(lines) and all(re.fullmatch(r"\s*(from exercises import check|check\((\"[\w.]+\"(,\s*)?)*\))\s*", ln)
                               for ln in lines) and any("check(" in ln for ln in lines)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n 2``: one worker per test file, the longest files first (tests/parallel_run.py)."""
    if config.getoption("dist") in ("load", "loadfile", "loadscope"):
        return parallel_run.make_scheduler(config, log)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test (its fixtures too) holds the run's quiet lock shared: a timing recording waits for it."""
    parallel_run.QUIET.shared()
    try:
        return (yield)
    finally:
        parallel_run.QUIET.release()


def pytest_configure(config):
    """nbval's kernels (started with this process's environment) draw each replay's static picture, not its HTML
    animation: tests/notebook/test_browser.py has the replays of the notebooks the website's test builds its pages
    from (SITE_NOTEBOOKS) drawn as animations in JupyterLab, and tests/widgets/test_animation.py checks the drawing;
    drawing every lecture's would cost the suite about 15-20 s of CPU.  COURSE_ANIMATIONS=html make test draws them."""
    os.environ.setdefault("COURSE_ANIMATIONS", "off")
    parallel_run.configure(config)


def pytest_collection_modifyitems(config, items):
    """Under nbval (``make test`` runs the repository's notebooks), a grading cell is not executed: with the
    stubs it only grades them, which ``course_grades("exercises")`` does for every exercise (the same
    ``session.grade``, hidden checks included; tests/grading/test_report.py), tests/notebook/test_demos.py checks
    that every id a notebook grades is registered, and tests/notebook/test_browser.py runs a grading cell of every
    release notebook in JupyterLab (``check`` and its summary in a notebook).  The other cells run as before."""
    skip = pytest.mark.skip(reason="grading cell: graded by course_grades('exercises') and in the browser test")
    for item in items:
        cell = getattr(item, "cell", None)
        if type(item).__module__.startswith("nbval") and cell is not None and cell.get("cell_type") == "code" \
                and grading_cell(cell.get("source", "")):
            item.add_marker(skip)


# -- a learner's module with one classic mistake, graded ---------------------------------------------


def grade_package(tmp_path, monkeypatch, package: str, modules: dict[str, str], ids: list[str], *,
                  hidden: bool = False) -> dict:
    """Grade a learner's package written here — ``{module: source}`` in a fresh package ``package`` under
    ``tmp_path`` — on exercises ``ids``; return ``{exercise id: result}`` (the package is forgotten after)."""
    from exercises.grading import session
    pkg = tmp_path / package
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for module, source in modules.items():
        (pkg / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        return {r.exercise.id: r for r in session.grade(package, ids, include_hidden=hidden)}
    finally:
        for m in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            sys.modules.pop(m, None)


def grade_mutant(tmp_path, monkeypatch, package: str, module: str, source: str, ex_id: str, *, hidden: bool = True):
    """Grade ``source`` as the learner's ``module`` (in a fresh package ``package`` under ``tmp_path``)
    on exercise ``ex_id``; return the messages of its failed checks (it must lose points)."""
    res = grade_package(tmp_path, monkeypatch, package, {module: source}, [ex_id], hidden=hidden)[ex_id]
    assert res.score < res.max_score, f"the mutant {package} earned full marks on {ex_id}"
    return [c.message for c in res.checks if not c.passed]

