"""Per-head windows in a pretrained causal LM through transformers' ``AttentionInterface``.

``patch`` registers an attention function and a mask function, both named ``"aah"``, and
switches the model to them. Every attention module then attends with its own row of
``windows`` (one window per query head, in the convention of :mod:`aah.windows`) plus
``sink_tokens`` always-visible first positions.

How a call is executed:

* an unpadded prompt without a cache (the prefill) runs through :func:`aah.attend`, sinks
  included, so the chosen backend skips the work outside each window and its sinks;
* padded batches and queries that follow cached keys run fused SDPA with an exact boolean
  mask: correct, but they do not skip work.

A head never sees more than its layer allows: in a layer with its own sliding window (Mistral,
Qwen3's sliding layers) a head's window is ``min(W_h, sliding_window)`` and that layer keeps
no sinks. The mask function hands the attention function only causality and padding; the
windows themselves are applied here, so no overlay of the model's own mask is needed.
Packed sequences (several documents in one row) are not supported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from ..backends import attend, backend_takes_sinks
from ..windows import acr, as_window_tensor, causal_pairs, check_sink_tokens
from ._transformers import require
from .windowed_kv import WindowedKV

__all__ = [
    "AAH_IMPLEMENTATION", "LayerWindows", "attention_modules", "layer_specs", "patch", "patched_windows", "recording",
    "unpatch",
]

#: The name under which the attention and mask functions are registered.
AAH_IMPLEMENTATION = "aah"

_SPEC_ATTR = "aah_windows"
#: A callable ``(q, k, v)`` set on an attention module sees its post-RoPE q/k/v (calibration).
RECORDER_ATTR = "_aah_recorder"
#: A callable ``(out)`` set on an attention module sees its (B, H, T, D) output (calibration).
OUTPUT_RECORDER_ATTR = "_aah_output_recorder"
_PREVIOUS_ATTR = "_aah_previous_attn_implementation"


@dataclass(frozen=True)
class LayerWindows:
    """What one patched attention module executes.

    ``windows`` and ``sink_tokens`` are what the layer really runs: the requested windows
    capped by the layer's own sliding window (``layer_window``), and no sinks in such a layer.
    """

    requested: tuple[int, ...]  # one per query head, as given to patch()
    windows: tuple[int, ...]
    sink_tokens: int
    backend: str
    layer_window: int | None = None

    @classmethod
    def build(cls, requested: tuple[int, ...], sink_tokens: int, backend: str, layer_window: int | None) -> LayerWindows:
        """A head never sees more than its layer allows: cap by ``layer_window`` and drop sinks there."""
        if layer_window is None:
            return cls(requested, requested, sink_tokens, backend, None)
        capped = tuple(min(w, int(layer_window)) for w in requested)
        return cls(requested, capped, layer_sinks(sink_tokens, layer_window), backend, int(layer_window))


def layer_sinks(sink_tokens: int, layer_window: int | None) -> int:
    """The sinks a layer keeps: none in a layer with its own sliding window, which must not see beyond it."""
    return sink_tokens if layer_window is None else 0


def layer_sliding_window(model: torch.nn.Module, module: torch.nn.Module) -> int | None:
    """The layer's own sliding window: the module's (Qwen3-style) or the model's (Mistral-style)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(model.config, "sliding_window", None)


def layer_sliding_windows(model: torch.nn.Module) -> list[int | None]:
    """Each attention layer's own sliding window, in layer order (``None`` where it has none)."""
    return [layer_sliding_window(model, module) for module in attention_modules(model)]


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of ``model`` in layer order (modules with ``layer_idx`` and ``q_proj``)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and hasattr(module, "q_proj") and hasattr(module, "k_proj"):
            if idx in found:
                raise ValueError(f"two attention modules claim layer_idx {idx}")
            found[idx] = module
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention modules with layer_idx and q_proj/k_proj; "
            "aah.hf supports decoder-only causal LMs such as Llama, Mistral and Qwen3"
        )
    if sorted(found) != list(range(len(found))):
        raise ValueError(f"attention layers are not numbered 0..L-1: {sorted(found)}")
    return [found[i] for i in range(len(found))]


def _num_query_heads(model: torch.nn.Module) -> int:
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise ValueError(f"{type(model).__name__}.config has no num_attention_heads")
    return heads


def patch(
    model: torch.nn.Module,
    windows: torch.Tensor | Sequence[Sequence[int]],
    *,
    sink_tokens: int = 4,
    backend: str = "auto",
) -> torch.nn.Module:
    """Give every query head of ``model`` its own causal window; returns ``model`` itself.

    ``windows`` is an int tensor of shape (num_layers, num_query_heads). A wrong shape
    raises ``ValueError``. Patching a patched model replaces its windows.
    """
    require()
    modules = attention_modules(model)
    grid = as_window_tensor(windows)
    expected = (len(modules), _num_query_heads(model))
    if tuple(grid.shape) != expected:
        raise ValueError(
            f"windows must have shape (num_layers, num_query_heads) = {expected} for "
            f"{type(model).__name__}, got {tuple(grid.shape)}"
        )
    specs = layer_windows_for(model, grid, check_sink_tokens(sink_tokens), backend)
    _register()
    for module, spec in zip(modules, specs):
        setattr(module, _SPEC_ATTR, spec)
    if not hasattr(model, _PREVIOUS_ATTR):
        setattr(model, _PREVIOUS_ATTR, model.config._attn_implementation)
        _default_generate_cache(model)
    model.set_attn_implementation(AAH_IMPLEMENTATION)
    return model


def _default_generate_cache(model: torch.nn.Module) -> None:
    """Make ``model.generate`` use an :mod:`aah.hf.cache` window cache unless one is passed."""
    original = model._prepare_cache_for_generation

    def prepare(generation_config, model_kwargs, *args, **kwargs):
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            from .cache import new_cache

            model_kwargs["past_key_values"] = new_cache(model)
        return original(generation_config, model_kwargs, *args, **kwargs)

    model._prepare_cache_for_generation = prepare


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: the model's previous attention implementation and no windows."""
    previous = getattr(model, _PREVIOUS_ATTR, None)
    if previous is None:
        raise ValueError(f"{type(model).__name__} is not patched by aah.hf.patch")
    for module in attention_modules(model):
        if hasattr(module, _SPEC_ATTR):
            delattr(module, _SPEC_ATTR)
    model.set_attn_implementation(previous)
    delattr(model, _PREVIOUS_ATTR)
    if "_prepare_cache_for_generation" in vars(model):
        del model._prepare_cache_for_generation
    return model


def layer_specs(model: torch.nn.Module) -> list[LayerWindows]:
    """Each layer's :class:`LayerWindows`; ``ValueError`` when the model is not patched."""
    specs = [getattr(module, _SPEC_ATTR, None) for module in attention_modules(model)]
    if any(spec is None for spec in specs):
        raise ValueError(f"{type(model).__name__} is not patched by aah.hf.patch")
    return specs


def patched_windows(model: torch.nn.Module, *, effective: bool = False) -> torch.Tensor:
    """The (num_layers, num_query_heads) windows given to :func:`patch` (or, with
    ``effective=True``, the windows that run after the layers' own sliding windows)."""
    rows = [spec.windows if effective else spec.requested for spec in layer_specs(model)]
    return torch.tensor(rows, dtype=torch.int64)


def layer_windows_for(
    model: torch.nn.Module, windows: torch.Tensor, sink_tokens: int, backend: str = "auto"
) -> list[LayerWindows]:
    """What each layer of ``model`` would run given the (num_layers, num_query_heads) ``windows``."""
    return [
        LayerWindows.build(tuple(int(w) for w in row), sink_tokens, backend, layer_window)
        for layer_window, row in zip(layer_sliding_windows(model), windows.tolist())
    ]


def executed_coverage(model: torch.nn.Module, seq_len: int, specs: Sequence[LayerWindows] | None = None) -> tuple[float, float]:
    """ACR and causal coverage of what a patched model runs at ``seq_len`` (or of ``specs``, see
    :func:`layer_windows_for`): every layer's windows after its own sliding window, with the
    sinks that layer keeps (none in a sliding layer)."""
    specs = layer_specs(model) if specs is None else specs
    heads = sum(len(spec.windows) for spec in specs)
    ratio = sum(acr(spec.windows, seq_len, sink_tokens=spec.sink_tokens) * len(spec.windows) for spec in specs)
    full = seq_len * (seq_len + 1) // 2
    pairs = sum(causal_pairs(w, seq_len, sink_tokens=spec.sink_tokens) for spec in specs for w in spec.windows)
    return ratio / heads, pairs / (full * heads)


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    modeling_utils = require("transformers.modeling_utils")
    masking_utils = require("transformers.masking_utils")
    modeling_utils.AttentionInterface.register(AAH_IMPLEMENTATION, aah_attention)
    masking_utils.AttentionMaskInterface.register(AAH_IMPLEMENTATION, _causal_padding_mask)
    _REGISTERED = True


def _causal_padding_mask(*args, **kwargs):
    """transformers' SDPA mask with causality and padding only (``None`` when nothing is padded).

    The model's own sliding-window overlay is dropped: :func:`aah_attention` applies each
    head's window, capped by the layer's sliding window, itself.
    """
    masking_utils = require("transformers.masking_utils")
    kwargs["mask_function"] = masking_utils.causal_mask_function
    kwargs.pop("local_size", None)
    return masking_utils.sdpa_mask(*args, **kwargs)


def aah_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | WindowedKV,
    value: torch.Tensor | WindowedKV,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"aah"``; returns ``(out (B, Tq, H, D), None)``.

    ``sliding_window`` and other keywords of the model are accepted and ignored: the layer's
    own sliding window was folded into its windows by :func:`patch`.
    """
    spec: LayerWindows | None = getattr(module, _SPEC_ATTR, None)
    if spec is None:
        raise RuntimeError(
            f"attention layer {getattr(module, 'layer_idx', '?')} runs the 'aah' implementation "
            "but has no windows; call aah.hf.patch(model, windows)"
        )
    recorder = getattr(module, RECORDER_ATTR, None)
    if recorder is not None and not isinstance(key, WindowedKV):
        recorder(query, key, value)
    if isinstance(key, WindowedKV):  # a call that reads and writes an aah.hf window cache
        out = key.layer.attend(query, key, attention_mask, scaling, spec)
    else:
        out = attend_without_cache(query, key, value, attention_mask, scaling, spec, dropout=dropout)
        output_recorder = getattr(module, OUTPUT_RECORDER_ATTR, None)
        if output_recorder is not None:
            output_recorder(out)
    return out.transpose(1, 2).contiguous(), None


def attend_without_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    spec: LayerWindows,
    *,
    dropout: float = 0.0,
) -> torch.Tensor:
    """(B, H, Tq, D) attention over plain keys that end at the last query.

    Unpadded prompts run through :func:`aah.attend`, sinks included (work outside the windows
    and sinks is skipped), unless the backend cannot take the sinks; everything else runs fused
    SDPA with the exact boolean mask.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and q_len == kv_len and not dropout:
        sinks = check_sink_tokens(spec.sink_tokens)
        if not sinks:
            return attend(query, key, value, spec.windows, backend=spec.backend, scale=scaling)
        if backend_takes_sinks(spec.backend, spec.windows, q_len, sinks):
            return attend(query, key, value, spec.windows, backend=spec.backend, scale=scaling, sink_tokens=sinks)
    allowed = allowed_keys(spec.windows, spec.sink_tokens, q_len, kv_len, attention_mask, query.device)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )


@lru_cache(maxsize=32)
def _band(windows: tuple[int, ...], sinks: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """(H, Tq, Tk) window band for queries at the last ``q_len`` of ``kv_len`` positions."""
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)
    kpos = torch.arange(kv_len, device=device)
    dist = qpos[:, None] - kpos[None, :]
    w = torch.tensor(windows, device=device)[:, None, None]
    causal = dist >= 0
    return causal[None] & ((dist[None] < w) | (kpos < sinks)[None, None, :])


def first_real_position(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's first real token: the first visible key in the last query row
    of a (B, 1, Tq, Tk) causal-and-padding mask (boolean, or additive with 0 where visible)."""
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return visible[:, 0, -1, :].to(torch.int8).argmax(dim=-1)


def allowed_keys(
    windows: tuple[int, ...],
    sinks: int,
    q_len: int,
    kv_len: int,
    attention_mask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """Boolean (H, Tq, Tk) or (B, H, Tq, Tk) mask of the keys each query may attend.

    With a padding mask (transformers' causal-and-padding mask, shape (B, 1, Tq, Tk)) the sinks
    of each row are its first ``sinks`` real tokens, and a query with no visible key (a
    padding position) is given its own position so that softmax stays finite.
    """
    if attention_mask is None:
        return _band(windows, sinks, q_len, kv_len, torch.device(device))
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    visible = visible.to(device)
    window_band = _band(windows, 0, q_len, kv_len, torch.device(device))[None]  # (1, H, Tq, Tk)
    allowed = visible & window_band
    if sinks:
        first = first_real_position(visible)
        kpos = torch.arange(kv_len, device=device)
        sink = (kpos[None] >= first[:, None]) & (kpos[None] < first[:, None] + sinks)
        allowed = allowed | (visible & sink[:, None, None, :])
    empty = ~allowed.any(dim=-1, keepdim=True)
    if bool(empty.any()):
        qpos = torch.arange(kv_len - q_len, kv_len, device=device)
        own = (qpos[:, None] == torch.arange(kv_len, device=device)[None, :])[None, None]
        allowed = allowed | (empty & own)
    return allowed


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
