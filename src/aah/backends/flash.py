"""``flash``: flash-attn's sliding-window kernel, one call per window group (CUDA only).

The FlashAttention path of the AAH-v3 paper (section 7.7, backend-realized
local attention): each selected-window bucket runs
``flash_attn_func(..., causal=True, window_size=(W - 1, 0))``. Geometry: keys
``i - (W - 1) <= j <= i``, exactly the ``W`` keys of :func:`aah.windows.visible`; heads
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

Sink tokens (:mod:`aah.backends.sinks`): a window group whose window misses
some sinks runs ``flash_attn_func(..., return_attn_probs=True)`` for its output
and log-sum-exp, and the few sink keys outside the window are merged into the
rows that miss them by log-sum-exp. The merge needs the gradient of the
window's log-sum-exp, which flash-attn does not give, so the group runs
through :class:`_FlashWithLse`: its backward recomputes the window call for the
output's gradients and adds the log-sum-exp's with one more call whose values
are the keys (``dL/dq_i = scale * sum_j P_ij k_j`` is that call's output,
``dL/dk_j = scale * sum_i dL_i P_ij q_i`` its value gradient). Only flash-attn's
public ``flash_attn_func`` is used.
"""

from __future__ import annotations

import importlib

import torch

from ..windows import causal_coverage
from .banded import grouped_attention
from .base import AttentionBackend, BackendUnavailable
from .sinks import merge_sinks, sink_span

__all__ = ["FlashBackend"]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _flash_attn_func():
    return importlib.import_module("flash_attn").flash_attn_func


class _FlashWithLse(torch.autograd.Function):
    """flash-attn's output (B, T, H, D) and log-sum-exp (B, H, T), both differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, scale, window_size):
        out, lse, _ = _flash_attn_func()(
            q, k, v, softmax_scale=scale, causal=True, window_size=window_size, return_attn_probs=True
        )
        ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.window_size = scale, window_size
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v = ctx.saved_tensors
        flash = _flash_attn_func()
        kwargs = {"softmax_scale": ctx.scale, "causal": True, "window_size": ctx.window_size}
        with torch.enable_grad():
            q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
            out = flash(q_, k_, v_, **kwargs)
            dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), grad_out)
            if grad_lse is not None:
                keys_as_values = k.detach().requires_grad_()
                pk = flash(q.detach(), k.detach(), keys_as_values, **kwargs)  # sum_j P_ij k_j
                wide = torch.promote_types(q.dtype, torch.float32)
                g = (grad_lse.to(wide) * ctx.scale).transpose(1, 2)[..., None]  # (B, T, H, 1)
                (dk_lse,) = torch.autograd.grad(pk, keys_as_values, (g * q.to(wide)).to(q.dtype))
                dq = dq + (g * pk.detach().to(wide)).to(dq.dtype)
                dk = dk + dk_lse
        return dq, dk, dv, None, None


class FlashBackend(AttentionBackend):
    name = "flash"
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
        if q.dtype not in _FLASH_DTYPES:
            raise BackendUnavailable(
                f"backend 'flash' needs float16 or bfloat16 inputs, got {q.dtype}; "
                "cast the inputs (e.g. under torch.autocast) or use 'flex' / 'banded'"
            )
        flash, t = _flash_attn_func(), q.shape[2]

        def run(q_g, k_g, v_g, w, scale):
            window_size = (-1, -1) if w >= t else (w - 1, 0)
            qt, kt, vt = (x.transpose(1, 2) for x in (q_g, k_g, v_g))
            span = sink_span(w, t, sink_tokens)
            if span == 0:
                return flash(qt, kt, vt, softmax_scale=scale, causal=True, window_size=window_size).transpose(1, 2)
            return _with_sinks(q_g, k_g, v_g, *_FlashWithLse.apply(qt, kt, vt, scale, window_size), w, span, scale)

        return grouped_attention(q, k, v, windows, scale, run)

    def executed_coverage(self, windows, seq_len, sink_tokens=0):
        return causal_coverage(windows, seq_len, sink_tokens=sink_tokens)


def _with_sinks(q, k, v, out_t, lse, window, span, scale):
    """(B, h, T, D): the window output ``out_t`` (B, T, h, D) with the ``span`` sinks merged
    into the rows ``[window, T)`` that miss them (``lse`` (B, h, T) of the window part)."""
    repeat = q.shape[1] // k.shape[1]  # query heads per KV head within the group
    k_sink = k[:, :, :span].repeat_interleave(repeat, dim=1)
    v_sink = v[:, :, :span].repeat_interleave(repeat, dim=1)
    out = out_t.transpose(1, 2)
    tail = slice(window, None)
    merged, _ = merge_sinks(q[:, :, tail], k_sink, v_sink, scale, out[:, :, tail], lse[:, :, tail], window=window)
    return torch.cat([out[:, :, :window], merged], dim=2)

