"""What a course others adopt states about itself: one version everywhere, a citation valid by its schema,
a changelog in the keep-a-changelog format, the licence as an SPDX expression."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import yaml
from jsonschema import Draft7Validator, FormatChecker

import reference

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CITATION = yaml.safe_load((ROOT / "CITATION.cff").read_text())
SCHEMA = json.loads((ROOT / "tests" / "schemas" / "cff-1.2.0.schema.json").read_text())
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.M)


def test_citation_is_valid_by_the_citation_file_format_schema():
    # YAML reads an unquoted date as a date; the schema wants strings (its own note to implementers)
    doc = {k: (str(v) if k == "date-released" else v) for k, v in CITATION.items()}
    errors = sorted(Draft7Validator(SCHEMA, format_checker=FormatChecker()).iter_errors(doc), key=str)
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    # and the checker can fail: a citation without authors, with a licence SPDX does not know, is refused
    broken = dict(doc, license="Apache-2", authors=[])
    assert len(list(Draft7Validator(SCHEMA).iter_errors(broken))) == 2


def test_the_citation_names_the_authors_title_and_both_licences():
    assert CITATION["authors"] == [{"name": "Splitting the Work contributors"}]
    assert CITATION["title"].startswith("Splitting the Work")
    assert CITATION.get("repository-code") == PYPROJECT.get("urls", {}).get("Repository")   # both, or neither
    assert CITATION["license"] == "Apache-2.0"     # the code's; CFF reads a list of licences as a choice
    assert "CC BY 4.0" in " ".join(CITATION["message"].split()) or "Creative Commons" in CITATION["message"]


def test_one_version_in_pyproject_the_package_the_citation_and_the_changelog():
    version = PYPROJECT["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert reference.__version__ == version
    assert str(CITATION["version"]) == version
    released = RELEASE.findall(CHANGELOG)
    assert released and released[0][0] == version, "the newest release in CHANGELOG.md is pyproject's version"
    assert str(CITATION["date-released"]) == released[0][1], "CITATION.cff's date is that release's date"


def test_changelog_keeps_a_changelog():
    assert CHANGELOG.startswith("# Changelog")
    assert "keepachangelog.com" in CHANGELOG and "semver.org" in CHANGELOG
    headings = re.findall(r"^## .*$", CHANGELOG, re.M)
    assert headings[0] == "## [Unreleased]"
    assert all(RELEASE.fullmatch(h) for h in headings[1:]), [h for h in headings[1:] if not RELEASE.fullmatch(h)]
    released = RELEASE.findall(CHANGELOG)
    versions = [tuple(map(int, v.split("."))) for v, _ in released]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions), "newest first, once each"
    dates = [d for _, d in released]
    assert dates == sorted(dates, reverse=True)
    kinds = set(re.findall(r"^### (.*)$", CHANGELOG, re.M))
    assert kinds and kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds
    for block in re.split(r"^## ", CHANGELOG, flags=re.M)[2:]:    # every release says what it brought
        assert re.search(r"^### \w+\n\n- ", block, re.M), block[:80]


def test_the_licence_is_an_spdx_expression_of_known_identifiers_and_its_files_ship():
    spdx = set(SCHEMA["definitions"]["license-enum"]["enum"])       # the SPDX list the CFF schema carries
    expression = PYPROJECT["license"]
    ids = re.split(r"\s+(?:AND|OR|WITH)\s+", expression)
    assert ids == ["Apache-2.0", "CC-BY-4.0"] and set(ids) <= spdx
    assert all((ROOT / f).is_file() for f in PYPROJECT["license-files"])
