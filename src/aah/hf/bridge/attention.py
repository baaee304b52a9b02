"""The attention function a patched model runs, registered with transformers as ``"aah"``.

Every attention module attends with its own row of windows (one per query head, in the
convention of :mod:`aah.windows`) plus the sink tokens its layer keeps (:mod:`.spec`).

How a call is executed:

* an unpadded prompt without a cache (the prefill) runs through :func:`aah.attend`, sinks
  included, so the chosen backend skips the work outside each window and its sinks;
* a call through an :mod:`aah.hf` window cache hands its queries to the cache layer, which
  attends over its rings (:mod:`.cache`);
* a plainly padded prompt (left or right padding) runs the same way one row at a time;
* everything else (packed sequences, custom 4-D masks, queries that follow
  cached keys, a ``StaticCache``) runs fused SDPA with the exact boolean mask of
  :func:`.masks.allowed_keys`: correct, but it does not skip work.

The mask function hands the attention function only causality and padding; the windows, and
the documents of packed rows (``position_ids`` restarting inside a row), are applied here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...backends import attend, backend_takes_sinks
from ...windows import check_sink_tokens
from .._transformers import require
from .masks import allowed_keys, packed_documents, padded_spans, visible_keys
from .spec import SPEC_ATTR, LayerWindows
from .windowed_kv import pending_of

__all__ = ["AAH_IMPLEMENTATION", "OUTPUT_RECORDER_ATTR", "RECORDER_ATTR", "aah_attention", "attend_without_cache", "by_rows",
           "register"]

#: The name under which the attention and mask functions are registered.
AAH_IMPLEMENTATION = "aah"
#: A callable ``(q, k, v)`` set on an attention module sees its post-RoPE q/k/v (calibration).
RECORDER_ATTR = "_aah_recorder"
#: A callable ``(out)`` set on an attention module sees its (B, H, T, D) output (calibration).
OUTPUT_RECORDER_ATTR = "_aah_output_recorder"

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


def by_rows(spans: list[tuple[int, int]], query: torch.Tensor,
            attend_row: Callable[[slice, slice], torch.Tensor]) -> torch.Tensor:
    """(B, H, T, D): ``attend_row(rows, span)`` (b, H, n, D) for the tokens ``span`` of the batch
    ``rows`` of a padded prompt (:func:`.masks.padded_spans`; rows that hold the same positions go
    in one call), zeros at its padding."""
    out = query.new_zeros(query.shape)
    if len(set(spans)) == 1:  # every row holds the same positions: one call
        first, stop = spans[0]
        if stop > first:
            rows = slice(0, query.shape[0])
            out[:, :, first:stop] = attend_row(rows, slice(first, stop))
        return out
    for row, (first, stop) in enumerate(spans):
        if stop > first:
            out[row:row + 1, :, first:stop] = attend_row(slice(row, row + 1), slice(first, stop))
    return out


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
    windows and sinks is skipped), unless the backend cannot take the sinks; a plainly padded
    prompt (:func:`.masks.padded_spans`) the same way one row at a time, over its tokens (its
    padding rows' outputs are zeros); everything else runs fused SDPA with the exact boolean mask
    of :func:`allowed_keys`.
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
    plain_padding = attention_mask is not None and q_len == kv_len and documents is None and not dropout
    spans = padded_spans(visible) if plain_padding else None
    if spans is not None:
        return by_rows(spans, query, lambda rows, span: attend_without_cache(
            query[rows, :, span], key[rows, :, span], value[rows, :, span], None, scaling, spec))
    allowed = allowed_keys(spec.windows, spec.sink_tokens, visible)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
