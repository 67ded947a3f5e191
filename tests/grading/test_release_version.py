"""What a release was built from: the student release and the autograder bundle name the course's version and
commit (``exercises/grading/provenance.py``), and ``make release`` / ``make autograder`` refuse uncommitted
changes in what they ship unless told ``ALLOW_DIRTY=1``."""
from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

import reference
from exercises.grading import provenance, release

ROOT = Path(__file__).resolve().parents[2]


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.org", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path) -> Path:
    """A git work tree with a committed notebooks/a.ipynb, docs/b.md and an ignored build/ folder."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "a.ipynb").write_text("{}")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("b")
    (tmp_path / ".gitignore").write_text("build/\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "start")
    return tmp_path


def test_uncommitted_lists_changed_and_new_files_in_the_shipped_paths_only(repo):
    assert provenance.uncommitted(["notebooks"], repo) == []
    (repo / "notebooks" / "a.ipynb").write_text('{"changed": 1}')
    (repo / "notebooks" / "new.ipynb").write_text("{}")
    (repo / "docs" / "b.md").write_text("changed, but not shipped")
    (repo / "build").mkdir()
    (repo / "build" / "ignored.txt").write_text("x")
    assert sorted(provenance.uncommitted(["notebooks"], repo)) == ["notebooks/a.ipynb", "notebooks/new.ipynb"]
    assert provenance.uncommitted(["notebooks"], repo.parent / "not-a-repo-here") is None


def test_refusal_names_the_files_and_the_way_round_it(repo):
    (repo / "notebooks" / "a.ipynb").write_text('{"changed": 1}')
    with pytest.raises(RuntimeError, match=r"(?s)notebooks/a.ipynb.*ALLOW_DIRTY=1"):
        provenance.refuse_uncommitted("student release", ["notebooks"], False, repo)
    assert provenance.refuse_uncommitted("student release", ["notebooks"], True, repo) == ["notebooks/a.ipynb"]
    assert provenance.refuse_uncommitted("student release", ["docs"], False, repo) == []


@pytest.mark.parametrize("what", ["student", "autograder"])
def test_make_release_and_autograder_refuse_a_dirty_tree_before_building_anything(what, monkeypatch, tmp_path,
                                                                                   capsys):
    builds = []
    monkeypatch.setattr(provenance, "uncommitted", lambda paths, root=ROOT: ["exercises/collectives.py"])
    monkeypatch.setattr(release, "build_student", lambda *a, **k: builds.append(("student", k["dirty"])))
    monkeypatch.setattr(release, "build_autograder", lambda *a, **k: builds.append(("autograder", k["dirty"])))
    assert release.main([what, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "exercises/collectives.py" in err and "ALLOW_DIRTY=1" in err and not builds
    assert release.main([what, "--out", str(tmp_path), "--allow-dirty"]) == 0
    assert builds == [(what, ["exercises/collectives.py"])]


def test_the_makefile_passes_allow_dirty_only_when_asked():
    def commands(*extra: str) -> str:
        return subprocess.run(["make", "-n", "release", "autograder", *extra], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
    plain, allowed, zero = commands(), commands("ALLOW_DIRTY=1"), commands("ALLOW_DIRTY=0")
    assert "--allow-dirty" not in plain and "--allow-dirty" not in zero
    assert allowed.count("--allow-dirty") == 2


def test_the_student_release_names_its_version_and_commit(student_release):
    note = (student_release / "RELEASE.txt").read_text().splitlines()[0]
    assert f"Splitting the Work {reference.__version__}: student release built" in note
    assert provenance.commit() in note
    # and the release's own package says the same version
    assert f'version = "{reference.__version__}"' in (student_release / "pyproject.toml").read_text()


def test_the_autograder_bundle_names_its_version_commit_and_uncommitted_files(monkeypatch, tmp_path):
    monkeypatch.setattr(release, "verify_fresh_inputs", lambda *a, **k: [])     # its grading is test_autograder's
    z = release.build_autograder(tmp_path, dirty=["reference/comm.py"])
    with zipfile.ZipFile(z) as bundle:
        note = bundle.read("RELEASE.txt").decode()
    assert f"Splitting the Work {reference.__version__}: autograder bundle built" in note
    assert provenance.commit() in note and "uncommitted changes in 1 file(s) (ALLOW_DIRTY): reference/comm.py" in note
