"""`make lab` serves the course's index notebook (the README's first command)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_lab_serves_the_course_root_with_the_index_notebook_and_the_exercises(tmp_path):
    port = free_port()
    env = dict(os.environ, JUPYTER_TOKEN="course-test", BROWSER="true", JUPYTER_RUNTIME_DIR=str(tmp_path),
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    proc = subprocess.Popen(["make", "--no-print-directory", "lab", f"PORT={port}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        body = ""
        while time.monotonic() < deadline:
            try:
                url = f"http://127.0.0.1:{port}/api/contents/notebooks/index.ipynb?token=course-test&content=0"
                with urllib.request.urlopen(url, timeout=5) as r:
                    body = r.read().decode()
                break
            except OSError:
                time.sleep(1)
        assert json.loads(body or "{}").get("path") == "notebooks/index.ipynb", "JupyterLab did not serve the index"
        # the exercises the notebooks ask to open are in the same file browser, editable
        url = f"http://127.0.0.1:{port}/api/contents/exercises/collectives.py?token=course-test&content=0"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert json.loads(r.read()).get("writable") is True
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab/tree/notebooks/index.ipynb?token=course-test",
                                    timeout=10) as r:
            assert r.status == 200 and "JupyterLab" in r.read().decode()
        # nothing in the learner's way: the course's settings switch off the news and update pop-ups
        url = f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:notification?token=course-test"
        with urllib.request.urlopen(url, timeout=10) as r:
            defaults = {k: v.get("default") for k, v in json.loads(r.read())["schema"]["properties"].items()}
        assert defaults.get("fetchNews") == "false" and defaults.get("checkForUpdates") is False, defaults
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    assert f":{port}/lab/tree/notebooks/index.ipynb" in out.decode(errors="replace"), "the URL to open was not printed"


def test_the_student_releases_make_lab_serves_its_root_too():
    """The release's Makefile (exercises/grading/release.py: student_makefile) keeps the course's lab recipe."""
    import re

    from exercises.grading.release import student_makefile
    text = student_makefile((ROOT / "Makefile").read_text())
    recipe = re.search(r"^lab:.*\n\t(.*)$", text, re.M).group(1)
    assert "$(LAB_ROOT)" in recipe and "notebooks/index.ipynb" in recipe
    assert '--ServerApp.root_dir="$(CURDIR)"' in re.search(r"^LAB_ROOT := (.*)$", text, re.M).group(1)
