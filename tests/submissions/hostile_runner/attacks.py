"""Attacks on the reply channel, run where learner code runs (a rank of the runner's, as a harness
calls learner code there): the grader must neither hang nor blow up its memory."""
import io
import os
import stat
import struct
import time
import zipfile


def _sockets():
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                yield fd
        except OSError:
            pass


def stall_mid_message(module):
    """Announce a 100-byte reply, send one byte of it, then never send the rest."""
    for fd in _sockets():
        try:
            os.write(fd, struct.pack("!i", 100) + b"x")
        except OSError:
            pass
    time.sleep(3600)


def compressed_reply(module):
    """Make the runner answer with a tiny archive whose one record inflates to 200 MB."""
    import torch

    def bomb(obj, f, *args, **kwargs):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr("archive/data.pkl", b"\0" * (200 << 20))
        f.write(buf.getvalue())
    torch.save = bomb
    return 1


def huge_reply(module):
    """An honest-looking answer larger than the grader's cap (64 MiB by default)."""
    import torch
    return torch.zeros(80 << 20, dtype=torch.uint8)
