"""Build what a teacher hands out: the student release and the Gradescope autograder bundle.

    python -m exercises.grading.release student    [--out release]     # make release
    python -m exercises.grading.release autograder [--out autograder]  # make autograder

**Student release** (``release/splitting-the-work/`` and a zip beside it): the notebooks, the
``exercises/`` stubs, the runtime, the widgets and the grader — but not the solutions.  Every
graded function (found from the registry: ``Exercise.module`` + ``Exercise.functions``) keeps its
signature and docstring in ``reference/``, and its body becomes a call to the learner's function
in ``exercises.<module>``; so the whole reference works once the learner has written it, and says
"not implemented" before (notebook cells wrap that in ``reference.notebook.course.needs``).  Teachers'
hidden checks stay out.  Ground truth that checks take from graded functions (``ctx.oracle``) is
recorded here, from the full reference, into ``exercises/grading/oracle_answers.pt``, which the
release's grader loads by itself.

**Autograder bundle** (``autograder/autograder.zip``): Gradescope's ``setup.sh`` and
``run_autograder`` at the root, next to the full course (reference with bodies, hidden checks).
``run_autograder`` copies the submitted exercise modules into a package of their own, grades
them, and writes ``results.json``; paths come from environment variables so it runs anywhere
(see the script).
"""
from __future__ import annotations

import argparse
import ast
import inspect
import os
import shutil
import stat
import sys
import time
import zipfile
from pathlib import Path

from . import core, provenance, session
from .strip import ROOT, STUDENT_LEAVE_OUT, copy_tree, strip_solutions

NAME = "splitting-the-work"

# What a release holds (relative to the repository root); caches and checkpoints never.
STUDENT_PATHS = ["notebooks", "reference", "exercises", "scripts", "pyproject.toml", "README.md",
                 "environment.yml", "Makefile", "LICENSE", "LICENSE-CONTENT"]
AUTOGRADER_PATHS = ["reference", "exercises", "scripts", "pyproject.toml", "README.md", "LICENSE", "LICENSE-CONTENT"]


def _zip(src_dir: Path, zip_path: Path, prefix: str = "") -> None:
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as z:
        for p in sorted(src_dir.rglob("*")):
            if p.is_file():
                info = zipfile.ZipInfo.from_file(p, (Path(prefix) / p.relative_to(src_dir)).as_posix())
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, p.read_bytes())


# ----------------------------------------------------------------------------------------------
# Ground truth recorded from the full reference


def record_oracle(ids=None, timeout: float | None = None) -> tuple[dict, list]:
    """Grade the reference itself (it must score full marks) while recording every ``ctx.oracle``
    answer; return ``(answers, results)``."""
    core.ORACLE.answers, core.ORACLE.record = None, {}
    try:
        results = session.grade_patiently("reference", ids, include_hidden=False, timeout=timeout)
    finally:
        answers, core.ORACLE.record = core.ORACLE.record, None
    lost = [f"{r.exercise.id} {c.name}: {c.message.splitlines()[0] if c.message else ''}"
            for r in results for c in r.checks if not c.passed]
    if lost:
        raise RuntimeError("the reference does not score full marks, so no release is built:\n  " + "\n  ".join(lost))
    return answers, results


def build_student(out: Path, ids=None, *, make_zip: bool = True, timeout: float | None = None,
                  answers: dict | None = None, dirty: list[str] | None = None) -> Path:
    """Build the student release in ``out/splitting-the-work`` (and ``out/splitting-the-work.zip``).
    ``answers``: the oracle answers :func:`record_oracle` would record for ``ids``, recorded already (the
    test session takes them from its own grading of the reference instead of grading it again).
    ``dirty``: uncommitted files it was built with (``--allow-dirty``), named in its RELEASE.txt."""
    import torch

    registry = core.load_checks()
    t0 = time.perf_counter()
    given = answers is not None
    if not given:
        answers, _ = record_oracle(ids, timeout=timeout)
    graded = time.perf_counter() - t0
    dest = out / NAME
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    copy_tree(STUDENT_PATHS, dest, STUDENT_LEAVE_OUT)
    (dest / "README.md").write_text((ROOT / "docs" / "students.md").read_text())     # written for students
    (dest / "Makefile").write_text(student_makefile((ROOT / "Makefile").read_text()))
    stripped = strip_solutions(dest, registry)
    from .harness import plain
    torch.save(plain(answers, strict=True), dest / "exercises" / "grading" / "oracle_answers.pt")   # read weights_only
    from reference.notebook import recorded
    demos = recorded.record_all(dest / "reference" / "_recorded", progress=None)
    (dest / "RELEASE.txt").write_text(
        provenance.build_note("student release", dirty)
        + f"Exercises: {', '.join(registry)}.\nFunctions you write (their reference bodies are not here):\n"
        + "".join(f"  {i}  {f}: {n}\n" for i, f, n in stripped)
        + f"Reference answers recorded for the grader: {len(answers)}.\n"
        + f"Notebook demos recorded from the reference (reference/_recorded): {demos}.\n")
    if make_zip:
        _zip(dest, out / f"{NAME}.zip", prefix=NAME)
    print(f"student release: {dest} ({len(stripped)} graded functions delegated, {len(answers)} oracle answers, "
          f"{demos} recorded demos; " + ("oracle answers given)" if given else f"reference graded in {graded:.1f} s)"))
    return dest


def student_makefile(text: str) -> str:
    """The course's Makefile as a student needs it: ``make lab``, ``make grade`` (``IDS="3.2 4.4"`` for
    some exercises) and ``make clean``; no test suite, release or bundle (their files are not there)."""
    keep = []
    for block in text.split("\n\n"):
        first = next((ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")), "")
        if first.startswith(("$(VENV)/.stamp-test", "test:", ".PHONY: release", "release:", "autograder:")):
            continue
        keep.append(block.replace(".PHONY: lab test clean", ".PHONY: lab grade clean")
                    .replace("`make test` runs everything.", "`make grade` grades your exercises."))
    keep.append("# Grade your exercises in a terminal (the notebooks' check() does the same): make grade IDS=\"3.2\"\n"
                "grade: $(VENV)/.stamp-lab\n\t$(VPY) -m exercises.grade $(IDS)")
    return "\n\n".join(b.rstrip("\n") for b in keep if b.strip()) + "\n"


def _absolute_imports(text: str, package: str) -> str:
    """``text`` with every relative import made absolute (``from . import comm`` in package
    ``reference`` -> ``from reference import comm``)."""
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
            new = ast.ImportFrom(module=mod, names=node.names, level=0)
            indent = " " * node.col_offset
            edits.append((node.lineno - 1, node.end_lineno, indent + ast.unparse(new) + "\n"))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = [new]
    return "".join(lines)


def install_finished_learner(release: Path, registry=None) -> list[str]:
    """Turn a release's ``exercises/`` into the work of a learner who finished every exercise:
    each graded function becomes the full reference's, from a private copy of its reference module
    (``exercises/_finished_*.py``).  Used to prove a release's grader gives full marks."""
    written = []
    per_module: dict[str, list[str]] = {}
    for ex, name, fn in core.graded_functions(registry):
        src = Path(inspect.getsourcefile(fn)).resolve()
        private = "_finished_" + fn.__module__.replace(".", "_")
        target = release / "exercises" / f"{private}.py"
        if not target.exists():
            package = fn.__module__.rpartition(".")[0] if not src.name == "__init__.py" else fn.__module__
            target.write_text(_absolute_imports(src.read_text(), package))
            written.append(target.name)
        per_module.setdefault(ex.module, []).append(f"from exercises.{private} import {name}  # noqa: E402,F811\n")
    for module, lines in per_module.items():
        path = release / "exercises" / f"{module}.py"
        path.write_text(path.read_text() + "\n# A learner who finished:\n" + "".join(lines))
    return written


# ----------------------------------------------------------------------------------------------
# The Gradescope bundle

SETUP_SH = r"""#!/usr/bin/env bash
# Gradescope runs this once, as root, to build the autograder image (the bundle is unpacked in
# /autograder/source).  It makes /autograder/source/.venv with torch 2.13.0 (a CPU build where the
# platform allows, as scripts/bootstrap.py does) and the course, and an unprivileged user that
# runs submitted code.
set -euo pipefail
SOURCE="${AUTOGRADER_SOURCE:-/autograder/source}"
cd "$SOURCE"
if ! command -v python3 >/dev/null || ! python3 -c "import venv, ensurepip" 2>/dev/null; then
    apt-get update && apt-get install -y python3 python3-venv python3-pip
fi
python3 scripts/bootstrap.py
if [ "$(id -u)" = 0 ] && ! id student >/dev/null 2>&1; then
    useradd --no-create-home --shell /usr/sbin/nologin student || true
fi
bash "$SOURCE/lock_source.sh" "$SOURCE"
"""

LOCK_SOURCE_SH = r"""#!/usr/bin/env bash
# Leave submitted code (run as an unprivileged user, GRADER_RUN_AS) what it needs and nothing more:
# the interpreter and its packages (.venv) stay readable by everyone; the reference solutions, the
# checks and the hidden checks become root's alone.  The grader gives the runner its own stripped
# copy of the course (exercises/grading/sandbox.py: runtime_dir), so nothing there needs these files.
# setup.sh runs this; to try it locally: bash lock_source.sh /path/to/unpacked/bundle
set -euo pipefail
SOURCE="${1:-${AUTOGRADER_SOURCE:-/autograder/source}}"
chmod 711 "$SOURCE"
for p in "$SOURCE"/* "$SOURCE"/.[!.]*; do
    [ -e "$p" ] || continue
    if [ "$(basename "$p")" = .venv ]; then chmod -R a+rX "$p"; else chmod -R go-rwx "$p"; fi
done
"""

RUN_AUTOGRADER = r"""#!/usr/bin/env bash
# Gradescope runs this for every submission.  Environment variables (Gradescope's paths by default):
#   AUTOGRADER_SOURCE      the unpacked bundle                 (/autograder/source)
#   AUTOGRADER_SUBMISSION  the student's files                 (/autograder/submission)
#   AUTOGRADER_RESULTS     where results.json goes             (/autograder/results/results.json)
#   AUTOGRADER_PYTHON      the Python to grade with            ($SOURCE/.venv/bin/python)
#   AUTOGRADER_IDS         exercise ids to grade               (all)
#   GRADER_TIMEOUT         seconds per check, at most          (60)
set -uo pipefail
SOURCE="${AUTOGRADER_SOURCE:-/autograder/source}"
SUBMISSION="${AUTOGRADER_SUBMISSION:-/autograder/submission}"
RESULTS="${AUTOGRADER_RESULTS:-/autograder/results/results.json}"
PYTHON="${AUTOGRADER_PYTHON:-$SOURCE/.venv/bin/python}"
mkdir -p "$(dirname "$RESULTS")"
rm -f "$RESULTS"
WORK="$(mktemp -d)"
# Submitted code runs as an unprivileged user when we are root and setup.sh made one (or as
# GRADER_RUN_AS when it is set).
if [ -z "${GRADER_RUN_AS:-}" ] && [ "$(id -u)" = 0 ] && id student >/dev/null 2>&1; then
    export GRADER_RUN_AS=student
fi
cleanup() {
    rm -rf "$WORK"
    # whatever submitted code left in the temporary folders (it could write nowhere else)
    if [ -n "${GRADER_RUN_AS:-}" ]; then
        find /tmp /var/tmp /dev/shm -xdev -user "$GRADER_RUN_AS" -delete 2>/dev/null || true
    fi
}
trap cleanup EXIT
cd "$WORK"
PYTHONPATH="$WORK:$SOURCE" "$PYTHON" -I -m exercises.grading.release collect "$SUBMISSION" "$WORK/submission" \
    || echo "could not collect the submission"
chmod -R a+rX "$WORK"
# Inputs are drawn from a secret seed (--fresh-inputs); the whole submission has GRADER_DEADLINE
# seconds (480 by default, inside Gradescope's limit); results.json is rewritten after each exercise.
# shellcheck disable=SC2086
PYTHONPATH="$WORK:$SOURCE" "$PYTHON" -m exercises.grade ${AUTOGRADER_IDS:-} --solutions submission \
    --gradescope "$RESULTS" --quiet --fresh-inputs
status=$?
if [ $status -ne 0 ] || [ ! -s "$RESULTS" ]; then
    if [ -s "$RESULTS" ]; then
        :   # the grader wrote its own score and reason (e.g. it cannot run as GRADER_RUN_AS)
    else    # no Python here: nothing a submission planted can be imported
        msg="The autograder itself failed (exit status $status); please tell your teacher."
        printf '{"score": 0, "output": "%s", "tests": []}\n' "$msg" > "$RESULTS"
    fi
fi
exit 0
"""


def collect_submission(submission: Path, dest: Path) -> list[str]:
    """Copy the learner's exercise modules (``<module>.py`` for each registered exercise) from a
    Gradescope submission into a fresh package ``dest``.  Accepted layouts: ``exercises/<m>.py``,
    ``<m>.py`` at the top, or anywhere below.  A module not submitted is taken from the stubs (its
    checks then say "not implemented").  Only these modules are taken: a submitted ``grading/`` or
    anything else is ignored."""
    modules = sorted({ex.module for ex in core.load_checks().values()})
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "__init__.py").write_text('"""A submission, collected by the autograder."""\n')
    found, refused = [], []
    for m in modules:
        candidates = [submission / "exercises" / f"{m}.py", submission / f"{m}.py"]
        candidates += sorted(submission.rglob(f"{m}.py"), key=lambda p: len(p.parts))
        text = None
        for c in candidates:
            if "grading" in c.parts or not (c.exists() or c.is_symlink()):
                continue
            text = _read_plain_file(c, submission)
            if text is None:
                refused.append(str(c.relative_to(submission)))
                continue
            found.append(m)
            break
        if text is None:
            text = (ROOT / "exercises" / f"{m}.py").read_bytes()
        (dest / f"{m}.py").write_bytes(text)
    if refused:
        print(f"refused (a symlink, a special file, too large, or outside the submission): "
              f"{', '.join(dict.fromkeys(refused))}")
    print(f"collected {', '.join(found) or 'nothing'} from {submission}; stubs for the rest")
    return found


def _read_plain_file(path: Path, root: Path, limit: int = 1 << 20) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a symlink, device or fifo) of at most
    ``limit`` bytes, inside ``root`` with no symlinked folder on the way; else None.  Opened with
    O_NOFOLLOW and checked on the open descriptor, so nothing can be swapped in between."""
    try:
        inside = os.path.normpath(os.path.join(os.path.realpath(root), os.path.relpath(path.parent, root)))
        if os.path.realpath(path.parent) != inside:     # a symlinked folder on the way
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (OSError, ValueError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        return os.read(fd, limit + 1)[:limit]
    finally:
        os.close(fd)


def verify_fresh_inputs(ids=None, *, solutions: str = "reference") -> list:
    """Grade ``solutions`` (the reference) as ``run_autograder`` grades a submission — fresh inputs
    drawn from a new secret, hidden checks included — and raise unless it scores full marks."""
    before = core._SALT
    core.fresh_inputs()
    try:
        results = session.grade_patiently(solutions, ids, include_hidden=True)
    finally:
        core._SALT = before
    lost = [f"{r.exercise.id} {c.name}: {c.message.splitlines()[0] if c.message else ''}"
            for r in results for c in r.checks if not c.passed]
    if lost:
        raise RuntimeError(f"{solutions} does not score full marks on fresh inputs, so no autograder bundle is "
                           "built (honest students would lose these points):\n  " + "\n  ".join(lost))
    return results


def build_autograder(out: Path, *, verify_ids=None, verify_with: str = "reference",
                     dirty: list[str] | None = None) -> Path:
    """Build ``out/autograder.zip`` (and the unpacked ``out/bundle/``) — after checking that the
    reference scores full marks on fresh inputs (:func:`verify_fresh_inputs`; ``verify_ids``: only
    these exercises, ``verify_with``: another package, for tests)."""
    core.load_checks()
    t0 = time.perf_counter()
    verify_fresh_inputs(verify_ids, solutions=verify_with)
    print(f"{verify_with} scores full marks on fresh inputs ({time.perf_counter() - t0:.0f} s)")
    bundle = out / "bundle"
    if bundle.exists():
        shutil.rmtree(bundle)
    bundle.mkdir(parents=True)
    copy_tree(AUTOGRADER_PATHS, bundle)
    (bundle / "RELEASE.txt").write_text(provenance.build_note("autograder bundle", dirty))
    for name, text in (("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER), ("lock_source.sh", LOCK_SOURCE_SH)):
        p = bundle / name
        p.write_text(text)
        p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    z = out / "autograder.zip"
    _zip(bundle, z)
    print(f"autograder bundle: {z} (setup.sh and run_autograder at its root; hidden checks included)")
    return z


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m exercises.grading.release", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("student", help="build the student release")
    s.add_argument("--out", default=str(ROOT / "release"))
    s.add_argument("--no-zip", action="store_true")
    s.add_argument("--ids", nargs="*", help="record oracle answers for these exercises only (tests)")
    s.add_argument("--timeout", type=float, default=None)
    a = sub.add_parser("autograder", help="build the Gradescope autograder bundle")
    a.add_argument("--out", default=str(ROOT / "autograder"))
    for parser in (s, a):
        parser.add_argument("--allow-dirty", action="store_true",
                            help="build from uncommitted changes (make ... ALLOW_DIRTY=1); the build says so")
    c = sub.add_parser("collect", help="(run_autograder) copy a submission's modules into a package")
    c.add_argument("submission")
    c.add_argument("dest")
    args = p.parse_args(argv)
    if args.what in ("student", "autograder"):
        what, shipped = (("student release", STUDENT_PATHS + ["docs/students.md"]) if args.what == "student"
                         else ("autograder bundle", AUTOGRADER_PATHS))
        try:
            dirty = provenance.refuse_uncommitted(what, shipped, args.allow_dirty)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.what == "student":
        build_student(Path(args.out), args.ids or None, make_zip=not args.no_zip, timeout=args.timeout, dirty=dirty)
    elif args.what == "autograder":
        build_autograder(Path(args.out), dirty=dirty)
    else:
        collect_submission(Path(args.submission), Path(args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
