"""Per-head windows in a pretrained causal LM through transformers' ``AttentionInterface``.

``patch`` registers an attention function and a mask function, both named ``"aah"``, and
switches the model to them. Every attention module then attends with its own row of
``windows`` (one window per query head, in the convention of :mod:`aah.windows`) plus
``sink_tokens`` always-visible first positions.

How a call is executed:

* an unpadded prompt without a cache (the prefill) runs through :func:`aah.attend`, sinks
  included, so the chosen backend skips the work outside each window and its sinks;
* everything else (padded batches, packed sequences, custom 4-D masks, queries that follow
  cached keys, a ``StaticCache``) runs fused SDPA with an exact boolean mask built by
  :func:`allowed_keys`: correct, but it does not skip work.

The visibility rule, in absolute positions of the keys a query may see at all (causality,
padding, its own document): a head with window ``W`` keeps the keys ``j`` with
``i - W < j <= i`` and the first ``S`` keys the query may see (its row's or its document's
sink tokens). A head never sees more than its layer allows: in a layer with its own sliding
window (Mistral, Qwen3's sliding layers) a head's window is ``min(W_h, sliding_window)`` and
that layer keeps no sinks. The mask function hands the attention function only causality and
padding; the windows, and the documents of packed rows (``position_ids`` restarting inside a
row, read from the attention call's ``position_ids``), are applied here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..backends import attend, backend_takes_sinks
from ..windows import acr, as_window_tensor, causal_pairs, check_sink_tokens
from ._transformers import require
from .windowed_kv import pending_of

__all__ = [
    "AAH_IMPLEMENTATION", "DEFAULT_SINK_TOKENS", "LayerWindows", "allowed_keys", "attention_modules", "layer_specs", "patch",
    "patched_windows", "recording", "register", "visible_keys",
    "unpatch",
]

#: The name under which the attention and mask functions are registered.
AAH_IMPLEMENTATION = "aah"

#: The attribute of a patched attention module that holds its :class:`LayerWindows`.
SPEC_ATTR = "aah_windows"
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


def kv_heads(model: torch.nn.Module) -> int:
    """The model's number of KV heads (its query heads without grouped-query attention)."""
    config = model.config
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


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


#: The sink tokens ``patch`` keeps when neither the call nor a windows file names them.
DEFAULT_SINK_TOKENS = 4


def patch(
    model: torch.nn.Module,
    windows: torch.Tensor | Sequence[Sequence[int]] | str | os.PathLike,
    *,
    sink_tokens: int | None = None,
    backend: str = "auto",
) -> torch.nn.Module:
    """Give every query head of ``model`` its own causal window; returns ``model`` itself.

    ``windows`` is an int tensor of shape (num_layers, num_query_heads), or the path of a
    windows file (:func:`aah.hf.save_windows`), which is checked against ``model`` and whose
    ``sink_tokens`` are used unless ``sink_tokens`` is given (else
    :data:`DEFAULT_SINK_TOKENS`). A wrong shape raises ``ValueError``. Patching a patched
    model replaces its windows.
    """
    require()
    modules = attention_modules(model)
    if isinstance(windows, (str, os.PathLike)):
        from .windows_file import check_windows_for, load_windows

        path = windows
        windows, meta = load_windows(path)
        check_windows_for(model, windows, meta, str(path))
        if sink_tokens is None:
            sink_tokens = int(meta["sink_tokens"])
    if sink_tokens is None:
        sink_tokens = DEFAULT_SINK_TOKENS
    grid = as_window_tensor(windows)
    expected = (len(modules), _num_query_heads(model))
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
    from .block_step import adopt_layers
    from .generation import adopt

    adopt(model)
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
    from .block_step import release_layers
    from .generation import release

    release(model)
    release_layers(model)
    return model


def layer_specs(model: torch.nn.Module) -> list[LayerWindows]:
    """Each layer's :class:`LayerWindows`; ``ValueError`` when the model is not patched."""
    specs = [getattr(module, SPEC_ATTR, None) for module in attention_modules(model)]
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


def register() -> None:
    """Register the ``"aah"`` attention and mask functions with transformers (once per process)."""
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

    The model's own sliding-window overlay and its packed-sequence overlay are dropped:
    :func:`aah_attention` applies each head's window, capped by the layer's sliding window, and
    the documents of a packed row (from ``position_ids``) itself.
    """
    masking_utils = require("transformers.masking_utils")
    kwargs["mask_function"] = masking_utils.causal_mask_function
    kwargs.pop("local_size", None)
    return masking_utils.sdpa_mask(*args, **kwargs)


def aah_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"aah"``; returns ``(out (B, Tq, H, D), None)``.

    ``sliding_window`` and other keywords of the model are accepted and ignored: the layer's
    own sliding window was folded into its windows by :func:`patch`. ``position_ids`` are read
    to find the documents of packed rows.
    """
    spec: LayerWindows | None = getattr(module, SPEC_ATTR, None)
    if spec is None:
        raise RuntimeError(
            f"attention layer {getattr(module, 'layer_idx', '?')} runs the 'aah' implementation "
            "but has no windows; call aah.hf.patch(model, windows)"
        )
    pending = pending_of(key)
    documents = packed_documents(kwargs.get("position_ids"), query.shape[2], key.shape[2], attention_mask)
    if documents is not None and (pending is not None or key.shape[2] != query.shape[2]):
        raise NotImplementedError(
            "packed sequences (position_ids restarting inside a row) are supported in a forward "
            "without a cache; run them with use_cache=False"
        )
    if pending is not None:  # a call that reads and writes an aah.hf window cache
        out = pending.layer.attend(query, pending, attention_mask, scaling, spec)
        return out.transpose(1, 2).contiguous(), None
    recorder = getattr(module, RECORDER_ATTR, None)
    if recorder is not None:
        recorder(query, key, value)
    out = attend_without_cache(query, key, value, attention_mask, scaling, spec, dropout=dropout, documents=documents)
    output_recorder = getattr(module, OUTPUT_RECORDER_ATTR, None)
    if output_recorder is not None:
        output_recorder(out)
    return out.transpose(1, 2).contiguous(), None


def packed_documents(
    position_ids: torch.Tensor | None, q_len: int, kv_len: int, attention_mask: torch.Tensor | None = None
) -> torch.Tensor | None:
    """(B, T) document index of each token of a packed row, or ``None`` when no row is packed.

    A row is packed when its ``position_ids`` restart between two real tokens (a token's
    position is not its predecessor's plus one), as transformers detects packing; the restarts
    that left padding makes next to padding positions do not count. Only a call whose queries
    are all its keys (a prompt) can be packed.
    """
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[1] != q_len or q_len < 2:
        return None
    restarts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(restarts.any()):
        return None
    if attention_mask is not None:
        if q_len != kv_len or attention_mask.dim() != 4 or attention_mask.shape[-1] != kv_len:
            return None
        real = visible_keys(1, kv_len, attention_mask[:, :, -1:], position_ids.device)[:, 0, 0]  # (B, T)
        restarts = restarts & real[:, 1:] & real[:, :-1]
    if not bool(restarts.any()):
        return None
    starts = torch.cat([torch.zeros_like(restarts[:, :1]), restarts], dim=1)
    return starts.cumsum(dim=1)


def attend_without_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    spec: LayerWindows,
    *,
    dropout: float = 0.0,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, H, Tq, D) attention over plain keys (a prompt, a ``DynamicCache`` or ``StaticCache``).

    Unpadded, unpacked prompts run through :func:`aah.attend`, sinks included (work outside the
    windows and sinks is skipped), unless the backend cannot take the sinks; everything else
    runs fused SDPA with the exact boolean mask of :func:`allowed_keys`.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and 1 < q_len < kv_len:
        # No mask means SDPA's is_causal (transformers skips the mask only then): aligned top-left,
        # so these queries sit at positions 0..q_len-1 (a StaticCache's prefill) and see no later key.
        key, value, kv_len = key[:, :, :q_len], value[:, :, :q_len], q_len
    if attention_mask is None and documents is None and q_len == kv_len and not dropout:
        sinks = check_sink_tokens(spec.sink_tokens)
        if not sinks:
            return attend(query, key, value, spec.windows, backend=spec.backend, scale=scaling)
        if backend_takes_sinks(spec.backend, spec.windows, q_len, sinks):
            return attend(query, key, value, spec.windows, backend=spec.backend, scale=scaling, sink_tokens=sinks)
    visible = visible_keys(q_len, kv_len, attention_mask, query.device, documents)
    allowed = allowed_keys(spec.windows, spec.sink_tokens, visible)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )


def visible_keys(
    q_len: int,
    kv_len: int,
    attention_mask: torch.Tensor | None,
    device: torch.device,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean (B or 1, 1, Tq, Tk): the keys each query may see at all, before any window.

    That is the given causal-and-padding mask (boolean, or additive with 0 where visible:
    transformers' own, a ``StaticCache``'s, or a custom 4-D mask), or, without one, causality
    for queries at the last ``q_len`` of ``kv_len`` positions (one query sees every key, as
    transformers means a missing mask; longer query blocks are given only their own keys by
    :func:`attend_without_cache`); and, for packed rows
    (``documents``, (B, Tk) with the queries the keys), only the query's own document.
    """
    if attention_mask is None:
        qpos = torch.arange(kv_len - q_len, kv_len, device=device)
        visible = (torch.arange(kv_len, device=device)[None, :] <= qpos[:, None])[None, None]
    else:
        if attention_mask.dim() != 4 or attention_mask.shape[-2:] != (q_len, kv_len):
            raise ValueError(
                f"aah.hf takes 4-D attention masks of shape (B, 1, {q_len}, {kv_len}), got {tuple(attention_mask.shape)}"
            )
        if attention_mask.dtype == torch.bool:
            visible = attention_mask
        else:
            hidden = ~torch.isfinite(attention_mask) | (attention_mask <= torch.finfo(attention_mask.dtype).min / 2)
            if bool((~hidden & (attention_mask != 0)).any()):
                raise ValueError(
                    "aah.hf takes additive 4-D masks of 0 (visible) and -inf or the dtype's minimum (hidden) "
                    "only; a mask with other values is a bias that per-head windows cannot keep exact"
                )
            visible = attention_mask == 0
        visible = visible.to(device)
        if q_len == kv_len and bool(torch.triu(visible, diagonal=1).any()):
            raise ValueError(
                "aah.hf takes causal 4-D masks only (no query may see a later key): a window is counted "
                "back from the query"
            )
        if visible.shape[1] != 1:
            raise ValueError(f"aah.hf takes one mask for all heads (B, 1, Tq, Tk), got {tuple(visible.shape)}")
    if documents is not None:
        documents = documents.to(device)
        same = documents[:, -q_len:, None] == documents[:, None, :]  # (B, Tq, Tk)
        visible = visible & same[:, None]
    return visible


def allowed_keys(windows: Sequence[int], sinks: int, visible: torch.Tensor) -> torch.Tensor:
    """Boolean (B or 1, H, Tq, Tk) mask of the keys each head's queries attend.

    ``visible`` (B or 1, 1, Tq, Tk) says which keys a query may see at all (:func:`visible_keys`).
    A query sits at the last key it may see (itself); a head with window ``W`` keeps the visible
    keys less than ``W`` positions before it, and every query keeps the first ``sinks`` keys it
    may see (its row's or document's sink tokens). A query that may see nothing (a padding
    position) is given its own position, so that softmax stays finite.
    """
    kv_len = visible.shape[-1]
    kpos = torch.arange(kv_len, device=visible.device)
    own = torch.where(visible, kpos, -1).amax(dim=-1, keepdim=True)  # (B, 1, Tq, 1)
    empty = own < 0
    w = torch.tensor(list(windows), device=visible.device).view(1, -1, 1, 1)
    allowed = visible & (kpos > own - w)
    if sinks:
        allowed = allowed | (visible & (visible.cumsum(dim=-1) <= sinks))
    if bool(empty.any()):
        allowed = allowed | (empty & (kpos == 0))
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
