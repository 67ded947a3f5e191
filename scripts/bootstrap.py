"""Create or refresh the course's virtual environment in .venv (used by `make lab` and `make test`).

Steps: make .venv if missing; install torch, preferring a CPU build (a local wheel if pip's
find-links offer one, else PyTorch's CPU wheel index on Linux, else the default index); then install
the course in editable mode (learners edit `exercises/` in place), with the extras asked for.
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def run(*cmd: str, check: bool = True) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=check).returncode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--extras", default="", help="comma-separated extras, e.g. test")
    args = parser.parse_args()

    if not (VENV / "bin" / "python").exists() and not (VENV / "Scripts" / "python.exe").exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    py = str(VENV / "bin" / "python") if (VENV / "bin").exists() else str(VENV / "Scripts" / "python.exe")

    have_torch = subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0
    if not have_torch:
        pip = [py, "-m", "pip", "install", "--quiet", "--no-deps"]
        # 1) a wheel that pip's find-links already hold (fast, no download);
        # 2) on Linux, PyTorch's CPU-only index (the default index serves a multi-GB CUDA build);
        # 3) the default index (macOS and Windows wheels there are CPU builds).
        ok = run(*pip, "--no-index", TORCH, check=False) == 0
        if not ok and platform.system() == "Linux":
            ok = run(*pip, "--index-url", CPU_INDEX, TORCH, check=False) == 0
        if not ok:
            run(*pip, TORCH)
    target = f".[{args.extras}]" if args.extras else "."
    # "compat" puts the repo root on sys.path (a .pth file): modules added later import without a reinstall.
    run(py, "-m", "pip", "install", "--quiet", "--config-settings", "editable_mode=compat", "-e", target)


if __name__ == "__main__":
    main()
