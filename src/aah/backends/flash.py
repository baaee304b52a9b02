"""``flash``: flash-attn's sliding-window kernel, one call per window group (CUDA only).

The FlashAttention path of the AAH-v3 paper (section 7.7, backend-realized
local attention): each selected-window bucket runs
``flash_attn_func(..., causal=True, window_size=(W - 1, 0))``, i.e. keys
``i - (W - 1) <= j <= i``, exactly the ``W`` keys of :mod:`aah.windows`; heads
whose window covers the sequence run with ``window_size=(-1, -1)`` (plain
causal). Heads that share a window are gathered into one call (the grouped
execution of section 5.8) and the outputs are scattered back to head order.

flash-attn takes (B, T, H, D) tensors in float16 or bfloat16 on CUDA and
handles grouped-query attention itself (query head ``h`` reads KV head
``h // (H // H_kv)``), so KV heads are never expanded.

Executed coverage is reported as the ideal band (the causal coverage of the
windows). flash-attn skips whole tiles outside the window, so its real work is
this band rounded out to its tile grid (128-row query tiles, 64 to 128-key
tiles depending on head dim and GPU): the figure is a lower bound, within
about ``tile / W`` of the truth.

Sink tokens are not supported: a request with ``sink_tokens > 0`` and a window
shorter than the sequence raises ``BackendUnavailable`` (its sinks would need a
second kernel merged by log-sum-exp); with every window covering the sequence
the sinks change nothing and the call runs as usual.
"""

from __future__ import annotations

import importlib

import torch

from ..windows import causal_coverage
from .banded import gather_group, restore_head_order
from .base import AttentionBackend, BackendUnavailable
from .sinks import sink_span

__all__ = ["FlashBackend"]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _flash_attn_func():
    return importlib.import_module("flash_attn").flash_attn_func


class FlashBackend(AttentionBackend):
    name = "flash"
    supports_sink_tokens = False
    description = (
        "flash-attn sliding-window kernel (window_size=(W-1, 0)) per window group; "
        "CUDA, float16/bfloat16"
    )

    def unavailable_reason(self, device):
        device = torch.device(device)
        if device.type != "cuda":
            return f"flash-attn runs on CUDA only, not {device.type}"
        try:
            _flash_attn_func()
        except Exception as exc:  # ImportError, or a build that fails to load its CUDA library
            return f"flash_attn cannot be imported ({type(exc).__name__}: {exc})"
        return None

    def attend(self, q, k, v, windows, scale, sink_tokens=0):
        _refuse_sinks(windows, q.shape[2], sink_tokens)
        if q.dtype not in _FLASH_DTYPES:
            raise BackendUnavailable(
                f"backend 'flash' needs float16 or bfloat16 inputs, got {q.dtype}; "
                "cast the inputs (e.g. under torch.autocast) or use 'flex' / 'banded'"
            )
        flash = _flash_attn_func()
        b, h, t, d = q.shape
        group = h // k.shape[1]
        by_window: dict[int, list[int]] = {}
        for head, w in enumerate(windows):
            by_window.setdefault(min(w, t), []).append(head)
        outputs, order = [], []
        for w, heads in sorted(by_window.items()):
            q_g, k_g, v_g, heads = gather_group(q, k, v, heads, group)
            window_size = (-1, -1) if w >= t else (w - 1, 0)
            o = flash(
                q_g.transpose(1, 2),
                k_g.transpose(1, 2),
                v_g.transpose(1, 2),
                softmax_scale=scale,
                causal=True,
                window_size=window_size,
            )
            outputs.append(o.transpose(1, 2))
            order.extend(heads)
        return restore_head_order(outputs, order)

    def executed_coverage(self, windows, seq_len, sink_tokens=0):
        _refuse_sinks(windows, seq_len, sink_tokens)
        return causal_coverage(windows, seq_len)


def _refuse_sinks(windows: tuple[int, ...], seq_len: int, sink_tokens: int) -> None:
    """Sinks that some window misses are not supported: say so rather than run something else."""
    if any(sink_span(w, seq_len, sink_tokens) for w in windows):
        raise BackendUnavailable(
            f"backend 'flash' does not support sink_tokens > 0 (got {sink_tokens}) with windows "
            f"shorter than the sequence; use 'flex' or 'banded' (or 'auto', which skips 'flash')"
        )

