"""The hand-over between an :mod:`aah.hf.bridge.cache` layer and the attention function.

transformers calls ``cache.update(k, v, layer_idx)`` and passes what it returns straight to
the attention function. A window cache layer returns two :class:`WindowedKV` tensors: the new
keys and values themselves, as the cache-layer API asks for tensors, carrying a
:class:`Pending` note (the layer, the new keys and values, their first position). The
``"aah"`` attention function reads the note (:func:`pending_of`); the layer then attends over
its rings and stores the new tokens.

Any other use of these tensors (a model that was unpatched, or another attention function)
raises a ``RuntimeError`` that says so, instead of attending over the new tokens alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Pending", "WindowedKV", "pending_of"]

_MISUSE = (
    "these keys/values come from an aah.hf window cache, which only the 'aah' attention of a model "
    "patched with aah.hf.patch can read (it keeps each head's window, not the whole past); "
    "patch the model again, or use a transformers DynamicCache with an unpatched model"
)
#: Reads of a tensor's metadata that stay allowed (``t.shape``, ``t.dtype``, ``t.size()``, ...).
_METADATA = {"__get__", "size", "dim", "__len__", "numel", "element_size", "__repr__", "__format__"}


@dataclass
class Pending:
    layer: object  # the aah.hf.bridge.cache.WindowCacheLayer that attends and stores
    keys: torch.Tensor  # (B, H_kv, T_new, D), plain tensors
    values: torch.Tensor
    start: int  # absolute position of the first new token


class WindowedKV(torch.Tensor):
    """New keys or values returned by a window cache layer's ``update``, with their :class:`Pending` note."""

    _aah_pending: Pending

    @staticmethod
    def wrap(tensor: torch.Tensor, pending: Pending) -> WindowedKV:
        out = tensor.as_subclass(WindowedKV)
        out._aah_pending = pending
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(_MISUSE)


def pending_of(tensor) -> Pending | None:
    """The :class:`Pending` note of a window cache's keys, or ``None`` for plain tensors."""
    return tensor._aah_pending if isinstance(tensor, WindowedKV) else None
