"""``make test`` on two workers (tests/parallel_run.py), checked on a small suite run with ``pytest -n 2``: a file's
tests stay on one worker, a value asked for on both workers is computed once, and a block run ``alone`` overlaps
no test of the other worker."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """
from tests import parallel_run
from tests.conftest import pytest_runtest_protocol, pytest_xdist_make_scheduler  # noqa: F401


def pytest_configure(config):
    parallel_run.configure(config)
"""

# Each test logs "worker file test start end" (and the once's computations) to LOG.
TEST_FILE = """
import os, time
import pytest
from tests import parallel_run

LOG = {log!r}


def note(*words):
    with open(LOG, "a") as f:
        f.write(" ".join(map(str, words)) + "\\n")


def compute():
    note("computed", os.environ["PYTEST_XDIST_WORKER"])
    time.sleep(1.0)
    return 42


@pytest.mark.parametrize("k", range(6))
def test_{name}(k):
    t0 = time.time()
    if k == 0:
        assert parallel_run.once("answer", compute) == 42
    if {alone} and k == 2:
        with parallel_run.QUIET.alone():
            a0 = time.time()
            time.sleep(0.6)
            note("alone", a0, time.time())
    time.sleep(0.3)
    note(os.environ["PYTEST_XDIST_WORKER"], "{name}", k, t0, time.time())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock and fork: Linux")
def test_two_workers_keep_a_file_together_compute_once_and_leave_a_recording_alone(tmp_path):
    pytest.importorskip("xdist")
    suite, log = tmp_path / "suite", tmp_path / "log.txt"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for name, alone in [("a", True), ("b", False), ("c", False)]:
        (suite / f"test_{name}.py").write_text(textwrap.dedent(TEST_FILE.format(log=str(log), name=name,
                                                                              alone=alone)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}   # (when make test runs this)
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                           "--basetemp", str(tmp_path / "tmp"), "--rootdir", str(suite), "-c", os.devnull, str(suite)],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln.split() for ln in log.read_text().splitlines()]
    runs = [(w, f, float(t0), float(t1)) for w, f, _, t0, t1 in (ln for ln in lines if ln[0].startswith("gw"))]
    assert len(runs) == 18
    workers = {f: {w for w, g, *_ in runs if g == f} for f in "abc"}
    assert all(len(ws) == 1 for ws in workers.values()), workers          # each file on one worker
    assert len(set().union(*workers.values())) == 2                        # and both workers used
    assert len([ln for ln in lines if ln[0] == "computed"]) == 1           # once, on both workers
    (a0, a1), = [(float(ln[1]), float(ln[2])) for ln in lines if ln[0] == "alone"]
    other = [(t0, t1) for w, f, t0, t1 in runs if w not in workers["a"]]
    assert other and all(t1 <= a0 or t0 >= a1 for t0, t1 in other)       # no other test while alone
