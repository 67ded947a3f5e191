"""What a student release or an autograder bundle was built from: the course's version, the commit, and
whether the work tree held changes not committed there.

``make release`` and ``make autograder`` refuse to build from uncommitted changes in what they ship (a
class would get files no commit holds, and nobody could say later what they were given);
``ALLOW_DIRTY=1`` builds anyway, and the build's note then says so.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

from .strip import ROOT

__all__ = ["version", "commit", "uncommitted", "refuse_uncommitted", "build_note"]


def version() -> str:
    import reference
    return reference.__version__


def _git(*args: str, root: Path = ROOT) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def commit(root: Path = ROOT) -> str | None:
    """The commit checked out at ``root`` (None outside a git work tree)."""
    out = _git("rev-parse", "HEAD", root=root)
    return out.strip() if out else None


def uncommitted(paths: list[str], root: Path = ROOT) -> list[str] | None:
    """The files under ``paths`` that differ from the commit: changed, staged, deleted, or new and not
    ignored by ``.gitignore``.  None where ``root`` is not a git work tree (nothing can be told)."""
    out = _git("status", "--porcelain", "--untracked-files=all", "--", *paths, root=root)
    if out is None:
        return None
    return [line[3:] for line in out.splitlines() if line.strip()]


def refuse_uncommitted(what: str, paths: list[str], allow_dirty: bool, root: Path = ROOT) -> list[str]:
    """Raise unless what ``paths`` hold is committed (or ``allow_dirty``); return the uncommitted files."""
    changed = uncommitted(paths, root)
    if changed is None:
        if allow_dirty:
            return []
        raise RuntimeError(f"{root} is not a git work tree, so nobody could tell which commit the {what} was built "
                           f"from; build it anyway with ALLOW_DIRTY=1 (python -m exercises.grading.release ... "
                           f"--allow-dirty)")
    if changed and not allow_dirty:
        shown = "\n  ".join(changed[:20]) + (f"\n  ... and {len(changed) - 20} more" if len(changed) > 20 else "")
        raise RuntimeError(f"the work tree has changes not committed in what the {what} ships, so no {what} is "
                           f"built (it would name commit {(commit(root) or '?')[:12]}, which does not hold them):\n  "
                           f"{shown}\nCommit them, or build anyway with ALLOW_DIRTY=1 (make release ALLOW_DIRTY=1; "
                           f"the build then says it holds uncommitted changes).")
    return changed


def build_note(what: str, dirty: list[str] | None = None, root: Path = ROOT) -> str:
    """The first lines of a build's RELEASE.txt: version, commit and date (and the uncommitted files, if any)."""
    sha = commit(root)
    lines = [f"Splitting the Work {version()}: {what} built {time.strftime('%Y-%m-%d %H:%M')} "
             f"from commit {sha or 'unknown (not a git work tree)'}."]
    if dirty:
        lines.append(f"Built with uncommitted changes in {len(dirty)} file(s) (ALLOW_DIRTY): {', '.join(dirty[:10])}"
                     + (" ..." if len(dirty) > 10 else "") + ".")
    return "\n".join(lines) + "\n"
