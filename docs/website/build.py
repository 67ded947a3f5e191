"""``make site``: the executed course as a static website in ``site/``.

    python docs/website/build.py [--out site] [--release DIR] [--only 00_ranks_and_collectives ...] [--jobs 2]

1. **The student release** (``make release``'s build, into ``build/website/``; or ``--release DIR``, one
   built already): the site shows what a learner is given, so no page can hold a reference solution.
2. **Executed**: every notebook of the release (``pages.lecture_order``: the index, the lectures it links,
   any other), run by nbclient with no Jupyter server, two at a time; the replays then carry their
   self-contained HTML animations (``reference/widgets/animation.py``).
3. **Pages**: the executed notebooks as the site shows them (``pages.prepare``), the run-it-yourself page,
   the papers (``docs/references.md`` with the lectures citing each) and the changelog, in
   ``build/website/src``.
4. **Sphinx** (MyST-NB, the book theme, MathJax served locally: ``conf.py``) writes ``site/``.
5. **Checked** (``check.py``): no line of a reference solution in any file, every link inside the site
   resolving.  A problem stops the build (exit status 1) and names the page.

Why Sphinx and not Jupyter Book 2 (MyST's ``mystmd``): the MyST site build downloads its theme from
``api.mystmd.org`` at build time, which fails without the internet (offline CI, a classroom's firewall);
Sphinx, MyST-NB and sphinx-book-theme install from PyPI and read the same MyST Markdown and notebooks.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:                 # run as a script: the course's packages beside it
    sys.path.insert(0, str(ROOT))

from docs.website import check, pages  # noqa: E402

BUILD = ROOT / "build" / "website"


def execute_one(source: Path, dest: Path, timeout: float = 600) -> float:
    """Run every cell of notebook ``source`` (in its own folder) with nbclient; write it, outputs and all, to
    ``dest``; return the seconds it took.  The kernel inherits this process's environment."""
    import nbformat
    from nbclient import NotebookClient
    t0 = time.perf_counter()
    nb = nbformat.read(source, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(source.parent)}}).execute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest)
    return time.perf_counter() - t0


def execute(release: Path, names: list[str], dest: Path, jobs: int = 2, progress=print) -> dict[str, float]:
    """Execute the release's notebooks ``names`` into ``dest`` (``jobs`` kernels at a time), each kernel
    importing the release's packages and drawing its replays as HTML animations."""
    env = {"PYTHONPATH": str(release), "COURSE_ANIMATIONS": "html"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # spawned, not forked: the caller may hold threads and ranks (a test session's kept-alive worlds)
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {n: pool.submit(execute_one, release / "notebooks" / f"{n}.ipynb", dest / f"{n}.ipynb")
                       for n in names}
            seconds = {}
            for n, f in futures.items():
                seconds[n] = f.result()
                progress(f"  executed {n} in {seconds[n]:.0f} s")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return seconds


def write_sources(executed: Path, src: Path, names: list[str]) -> None:
    """The Sphinx source folder: the prepared notebooks and the pages around them."""
    import nbformat
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    books = {n: nbformat.read(executed / f"{n}.ipynb", as_version=4) for n in names}
    lectures = [n for n in names if n != "index"]
    for n, nb in books.items():
        nbformat.write(pages.prepare(nb, toc=lectures if n == "index" else None, pages=set(names)),
                       src / f"{n}.ipynb")
    shutil.copy(HERE / "run_it_yourself.md", src / "run_it_yourself.md")
    texts = {n: "\n".join(c.source for c in nb.cells if c.cell_type == "markdown") for n, nb in books.items()}
    titles = {n: pages.notebook_title(nb) for n, nb in books.items()}
    (src / "references.md").write_text(pages.references_page((ROOT / "docs" / "references.md").read_text(),
                                                             {n: titles[n] for n in lectures}, texts))
    shutil.copy(ROOT / "CHANGELOG.md", src / "changelog.md")


def sphinx(src: Path, out: Path, doctrees: Path) -> str:
    """Build the HTML; return Sphinx's warnings (it fails only on an error)."""
    import reference
    env = dict(os.environ, COURSE_SITE_VERSION=reference.__version__)
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-c", str(HERE), "-d", str(doctrees),
                           str(src), str(out)], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"sphinx-build failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc.stderr


def build(out: Path, executed: Path, names: list[str], work: Path = BUILD) -> list[str]:
    """Pages from the executed notebooks in ``executed`` to a checked site in ``out``; return its problems."""
    write_sources(executed, work / "src", names)
    html = work / "html"        # MyST-NB keeps the outputs' files beside Sphinx's output folder: inside work/
    for folder in (html, out):
        if folder.exists():
            shutil.rmtree(folder)
    warnings = sphinx(work / "src", html, work / "doctrees")
    if warnings.strip():
        print(warnings.strip())
    shutil.move(html, out)
    return check.problems(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python docs/website/build.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "site"), help="where the site goes (default: site/)")
    p.add_argument("--release", help="a student release built already (default: build one in build/website/)")
    p.add_argument("--only", nargs="*", help="these notebooks (stems) besides the index, for a quick look")
    p.add_argument("--jobs", type=int, default=2, help="notebooks executed at a time (default 2)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.release:
        release = Path(args.release).resolve()
    else:
        from exercises.grading import release as make_release
        print("building the student release (the reference graded, its demos recorded: a few minutes) ...", flush=True)
        release = make_release.build_student(BUILD, make_zip=False)
    names = pages.lecture_order(release / "notebooks")
    if args.only:
        names = ["index"] + [n for n in names if n in args.only]
    print(f"executing {len(names)} notebooks, {args.jobs} at a time ...", flush=True)
    execute(release, names, BUILD / "executed", jobs=args.jobs, progress=lambda s: print(s, flush=True))
    found = build(Path(args.out), BUILD / "executed", names)
    if found:
        print(f"the site in {args.out} has {len(found)} problem(s):\n  " + "\n  ".join(found), file=sys.stderr)
        return 1
    print(f"site: {args.out}/index.html ({len(names)} notebooks, {time.perf_counter() - t0:.0f} s); "
          f"no solution line, every link inside resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
