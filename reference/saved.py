"""What autograd keeps for the backward, measured: the activation memory of a forward pass.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor a node saves for its backward.
:class:`SavedTensorMeter` counts the distinct storages behind them (q, k and v as views of one qkv
output are one storage), leaves out the ones given to ``exclude`` (parameters, buffers), and
follows each storage until the last saved tensor on it is released, so ``peak`` is the largest
activation memory at any moment — one micro-batch's forward, or the micro-batches a pipeline keeps
in flight.  Lecture 4a measures a transformer block with it, lecture 5c a whole composed step.
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["SavedTensorMeter", "saved_bytes"]


def _storage(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device.type, s.data_ptr()), s.nbytes()


class SavedTensorMeter:
    """Context manager: the live and peak bytes of the distinct storages autograd saves for the backward.

    ``exclude``: tensors whose storages are not activations (the parameters and buffers).  A
    storage counts from the first time a tensor on it is saved until the last saved tensor on it
    is released (autograd frees saved tensors as each node's backward runs).  Floating-point
    storages go to ``peak`` / ``live``; integer and boolean ones to ``peak_other`` / ``live_other``.
    ``detail``: also keep (shape, dtype, bytes) of every first save of a storage, in order.
    ``views``: count a saved view by its own bytes, not its whole storage's — one micro-batch's rows
    of a batch as that micro-batch's bytes (a pipeline's first stage keeps slices of the batch it
    was given); ``exclude`` still goes by storage.
    """

    def __init__(self, exclude=(), *, detail: bool = False, views: bool = False):
        self._skip = {_storage(t)[0] for t in exclude}
        self._views = views
        self._refs: dict = {}
        self.live = self.peak = self.live_other = self.peak_other = 0
        self.saves = 0
        self.detail = [] if detail else None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        key, nbytes = _storage(t)
        if key in self._skip:
            return t
        if self._views:
            nbytes = t.numel() * t.element_size()
            key = (key, t.storage_offset(), tuple(t.shape), t.stride())
        self.saves += 1
        floating = t.is_floating_point() or t.is_complex()
        n = self._refs.get(key, (0, 0, floating))[0]
        self._refs[key] = (n + 1, nbytes, floating)
        if n == 0:
            if floating:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            else:
                self.live_other += nbytes
                self.peak_other = max(self.peak_other, self.live_other)
            if self.detail is not None:
                self.detail.append((tuple(t.shape), str(t.dtype).replace("torch.", ""), nbytes))
        holder = _Saved(t)
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def _unpack(holder):
        return holder.tensor if isinstance(holder, _Saved) else holder

    def _release(self, key) -> None:
        n, nbytes, floating = self._refs[key]
        if n > 1:
            self._refs[key] = (n - 1, nbytes, floating)
            return
        del self._refs[key]
        if floating:
            self.live -= nbytes
        else:
            self.live_other -= nbytes


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def saved_bytes(fn, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs (floating-point and integer),
    leaving out those of ``exclude``.  Nothing saved is released before ``fn`` returns, so this is
    the peak too."""
    with SavedTensorMeter(exclude) as meter:
        fn()
    return meter.peak + meter.peak_other
