"""``patch`` and ``unpatch``: per-head windows in a pretrained causal LM.

``patch`` registers the ``"aah"`` attention and mask functions (:mod:`.attention`), gives
every attention module its :class:`~.spec.LayerWindows`, moves the model into the subclass
whose ``generate`` uses a window cache (:mod:`.generation`) and its decoder layers into the
compiled one-token step (:mod:`.block_step`), and switches the model to ``"aah"``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from ...windows import as_window_tensor, check_sink_tokens
from .._transformers import require
from .attention import AAH_IMPLEMENTATION, OUTPUT_RECORDER_ATTR, RECORDER_ATTR, register
from .block_step import adopt_layers, release_layers
from .generation import adopt, release
from .kept_keys import KeptKeys
from .spec import (
    DEFAULT_SINK_TOKENS,
    SPEC_ATTR,
    attention_modules,
    layer_windows_for,
    num_query_heads,
)
from .windows_file import check_windows_for, load_windows

__all__ = ["patch", "recording", "unpatch"]

_PREVIOUS_ATTR = "_aah_previous_attn_implementation"


def patch(
    model: torch.nn.Module,
    windows: torch.Tensor | Sequence[Sequence[int]] | str | os.PathLike,
    *,
    sink_tokens: int | None = None,
    backend: str = "auto",
    kept_keys: KeptKeys | None = None,
) -> torch.nn.Module:
    """Give every query head of ``model`` its own causal window; returns ``model`` itself.

    ``windows`` is an int tensor of shape (num_layers, num_query_heads), or the path of a
    windows file (:func:`aah.hf.save_windows`), which is checked against ``model`` and whose
    ``sink_tokens`` are used unless ``sink_tokens`` is given (else
    :data:`DEFAULT_SINK_TOKENS`). A wrong shape raises ``ValueError``. With ``kept_keys``, the
    window cache ``generate`` builds when given none keeps them (:func:`aah.hf.new_cache`'s
    ``kept_keys``; :func:`aah.hf.patched_kept_keys` reads them back). Patching a patched
    model replaces its windows and its kept keys.
    """
    require()
    if kept_keys is not None and not isinstance(kept_keys, KeptKeys):
        raise TypeError(f"kept_keys must be an aah.hf.KeptKeys or None, got {type(kept_keys).__name__}")
    modules = attention_modules(model)
    if isinstance(windows, (str, os.PathLike)):
        path = windows
        windows, meta = load_windows(path)
        check_windows_for(model, windows, meta, str(path))
        if sink_tokens is None:
            sink_tokens = int(meta["sink_tokens"])
    if sink_tokens is None:
        sink_tokens = DEFAULT_SINK_TOKENS
    grid = as_window_tensor(windows)
    expected = (len(modules), num_query_heads(model))
    if tuple(grid.shape) != expected:
        raise ValueError(
            f"windows must have shape (num_layers, num_query_heads) = {expected} for "
            f"{type(model).__name__}, got {tuple(grid.shape)}"
        )
    specs = layer_windows_for(model, grid, check_sink_tokens(sink_tokens), backend)
    register()
    for module, spec in zip(modules, specs):
        setattr(module, SPEC_ATTR, spec)
    if not hasattr(model, _PREVIOUS_ATTR):
        setattr(model, _PREVIOUS_ATTR, model.config._attn_implementation)
    adopt(model, kept_keys)
    adopt_layers(model)
    model.set_attn_implementation(AAH_IMPLEMENTATION)
    return model




def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: the model's previous attention implementation and no windows."""
    previous = getattr(model, _PREVIOUS_ATTR, None)
    if previous is None:
        raise ValueError(f"{type(model).__name__} is not patched by aah.hf.patch")
    for module in attention_modules(model):
        if hasattr(module, SPEC_ATTR):
            delattr(module, SPEC_ATTR)
    model.set_attn_implementation(previous)
    delattr(model, _PREVIOUS_ATTR)
    release(model)
    release_layers(model)
    return model


@contextmanager
def recording(
    model: torch.nn.Module,
    modules: list,
    recorders: Sequence[Callable],
    seq_len: int,
    output_recorders: Sequence[Callable] | None = None,
) -> Iterator[None]:
    """Run ``model`` at full attention with ``recorders[i]`` seeing layer ``i``'s post-RoPE q/k/v
    and ``output_recorders[i]`` (if given) its attention output, then unpatch it."""
    if hasattr(model, _PREVIOUS_ATTR):
        raise ValueError("calibrate a model that is not patched (aah.hf.unpatch it first)")
    patch(model, torch.full((len(modules), model.config.num_attention_heads), seq_len), sink_tokens=0)
    attrs = [(RECORDER_ATTR, recorders)] + ([(OUTPUT_RECORDER_ATTR, output_recorders)] if output_recorders else [])
    try:
        for attr, callables in attrs:
            for module, recorder in zip(modules, callables):
                setattr(module, attr, recorder)
        yield
    finally:
        for module in modules:
            for attr, _ in attrs:
                if hasattr(module, attr):
                    delattr(module, attr)
        unpatch(model)
