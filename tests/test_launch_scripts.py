"""run_world from a script's own functions (as multiprocessing's spawn allows), and a clear error
where that cannot work (``python -c``, standard input) — raised before any rank starts."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import os
    from dataclasses import dataclass
    from reference.launch import run_world
    from helper_next_to_script import offset          # the script's folder is importable in the ranks

    with open(os.environ["MARKS"], "a") as f:          # the top level runs in the caller and in each rank
        f.write(__name__ + "\\n")

    @dataclass
    class Job:                                         # a class defined in the script, sent as an argument
        scale: int

    def work(job, x):
        import torch.distributed as dist
        return dist.get_rank() * job.scale + x + offset()

    if __name__ == "__main__":
        with open(os.environ["MARKS"], "a") as f:
            f.write("main block\\n")
        print("values", run_world(work, 2, Job(10), 1, timeout=60).values)
''')


def _env(tmp_path: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), MARKS=str(tmp_path / "marks.txt"))


def test_a_script_can_run_its_own_function_on_ranks(tmp_path, no_orphans):
    (tmp_path / "bench.py").write_text(SCRIPT)
    (tmp_path / "helper_next_to_script.py").write_text("def offset():\n    return 100\n")
    r = subprocess.run([sys.executable, "bench.py"], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "values [101, 111]" in r.stdout
    marks = (tmp_path / "marks.txt").read_text().split()
    # the caller ran the script as __main__ with its main block once; each rank loaded it as __mp_main__
    assert marks.count("__main__") == 1 and marks.count("block") == 1
    assert marks.count("__mp_main__") == 2


def _refused(r: subprocess.CompletedProcess) -> None:
    assert r.returncode != 0
    assert "ValueError" in r.stderr and "python my_script.py" in r.stderr, r.stderr[-2000:]
    assert "rank" not in r.stderr.split("ValueError")[-1].lower().split("each rank")[0]
    assert "[rank " not in r.stdout + r.stderr, "a rank started before the refusal"


CODE = "from reference.launch import run_world\ndef work(x):\n    return x\nrun_world(work, 2, 1)\n"


def test_python_dash_c_is_refused_before_any_rank_starts(tmp_path, no_orphans):
    r = subprocess.run([sys.executable, "-c", CODE], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=60)
    _refused(r)


def test_a_script_from_stdin_is_refused_before_any_rank_starts(tmp_path, no_orphans):
    r = subprocess.run([sys.executable, "-"], input=CODE, cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=60)
    _refused(r)
