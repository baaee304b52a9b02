"""``strips``: local attention as strips of keys through PyTorch's fused CPU attention kernel.

The grouped local execution of the AAH-v3 paper (section 5.8) realised with
the fused flash-style kernel that full causal SDPA itself uses on CPU (section
7.7, backend-realized local attention), so scores, masks and probabilities
are never materialised in memory and their backward runs inside the kernel.

Geometry, for one window ``W < T`` (all heads of a window group at once; masks from
:func:`aah.windows.visible`):

* **Prefix**: queries ``[0, W)`` see every earlier key, so they are plain
  causal attention over the first ``W`` positions: one fused causal call, cut
  in halves when the group has too few heads to keep every thread busy
  (:mod:`aah.backends.halves`).
* **Strips**: queries ``[W, T)`` are cut into chunks of ``b`` rows. Chunk
  ``c`` (queries ``W + c b + r``, ``0 <= r < b``) needs keys
  ``(W + c b + r - W, W + c b + r]``, all inside the strip
  ``[1 + c b, 1 + c b + W - 1 + b)`` of ``L = W - 1 + b`` keys. The strips of
  all chunks are overlapping strided views of ``K`` and ``V``
  (``Tensor.as_strided``, no copy), batched as the "heads" dimension of one
  fused call. Every chunk has the same relative geometry, so one additive mask
  of shape ``(b, L)`` (row ``r`` sees strip columns ``r .. r + W - 1``) serves
  all of them.
* When ``T - W`` is not a multiple of ``b`` the sequence is padded at the end
  to a whole chunk; padded keys lie in the future of every real query (so the
  mask hides them) and padded queries get a zero gradient, so nothing leaks.
* **Backward**: the fused kernel's own backward, called with the same views;
  the strip gradients of ``K`` and ``V`` are added back into the positions they
  came from (``ceil(L / b)`` strided additions).
* **Sinks** (``sink_tokens = S > 0``): the strip queries ``i >= W`` also see
  the sinks ``j < S`` their window misses (``j <= i - W``), one small
  ``(T - W) x S'`` block with ``S' = min(S, T - W)``, merged with the strips
  by log-sum-exp; the fused kernel's backward runs with the merged output and
  log-sum-exp (:mod:`aah.backends.sinks`). ``S = 0`` takes the plain path.

Heads whose window covers the sequence run through one fused causal call
(:mod:`aah.backends.sdpa`), or through the halves of :mod:`aah.backends.halves`
when they are too few for the threads. Grouped-query KV heads are expanded to
their query heads inside a group (a copy of ``K`` and ``V`` per group; the
fused kernel batches only equal head counts).

The fused kernel (``aten._scaled_dot_product_flash_attention_for_cpu``)
exists on CPU only, so this backend is CPU-only; on CUDA the ``flash`` and
``flex`` backends do the same job.

Executed coverage counts what the kernel is asked to compute: the prefix
triangle ``W (W + 1) / 2`` plus ``n b L`` strip entries (``n`` chunks, padded
rows included), plus ``n b S'`` sink entries, over the causal triangle
``T (T + 1) / 2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from ..windows import visible
from .banded import grouped_attention
from .base import AttentionBackend, expand_kv
from .halves import balanced_causal, causal_backward, causal_forward, cut_in_halves
from .sinks import merge_sinks, sink_backward, sink_span

__all__ = ["StripsBackend", "strip_attention", "strip_attention_lse", "strip_block", "strip_entries"]

_aten = torch.ops.aten
_MIN_BLOCK = 32
_MAX_BLOCK = 128


def strip_block(window: int, seq_len: int) -> int:
    """Query rows per chunk: ``W / 4`` rounded down to a power of two, clamped to
    ``[min(32, W), 128]``.

    A chunk computes ``b x (W - 1 + b)`` scores for ``b x W`` useful ones at
    most, so the waste is about ``b / W``; each chunk also costs the kernel a
    fixed set-up, so chunks should not be tiny. ``W / 4`` within ``[32, 128]``
    measured best on a 2-core CPU at head dims 32 and 64. Windows below 32 take
    ``b = W``: with 32 rows a window of 16 computed 47 scores per row for 16
    useful ones (docs/backends.md, "Chunk size", for the measurement).
    """
    quarter = max(1, window // 4)
    power = 1 << (quarter.bit_length() - 1)
    floor = min(_MIN_BLOCK, window)
    return max(1, min(max(power, floor), _MAX_BLOCK, max(1, seq_len - window)))


def strip_entries(window: int, seq_len: int, block: int | None = None, *, sink_tokens: int = 0) -> int:
    """Score entries the kernel computes for one head: prefix triangle plus strips
    (plus, with sinks, one ``S'``-key block for every strip row, padded rows included)."""
    if window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    if block is None:
        block = strip_block(window, seq_len)
    chunks = -(-(seq_len - window) // block)
    sinks = chunks * block * sink_span(window, seq_len, sink_tokens)
    return window * (window + 1) // 2 + chunks * block * (window - 1 + block) + sinks


_MASKS: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _strip_mask(window: int, block: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask (1, 1, b, W - 1 + b): row ``r``, the query at column ``r + W - 1``, sees ``r .. r + W - 1``."""
    key = (window, block, dtype, device)
    mask = _MASKS.get(key)
    if mask is None:
        q_pos = torch.arange(window - 1, window - 1 + block, device=device)[:, None]
        allowed = visible(q_pos, torch.arange(window - 1 + block, device=device), window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, float("-inf"))
        mask = mask[None, None]
        if len(_MASKS) > 64:
            _MASKS.clear()
        _MASKS[key] = mask
    return mask


def _strips(x: torch.Tensor, window: int, block: int, chunks: int) -> torch.Tensor:
    """Strip ``c`` of ``x`` (N, T, D) is rows ``[1 + c b, 1 + c b + W - 1 + b)``: (N, n, L, D) view."""
    n_rows, d = x.shape[1], x.shape[2]
    return x.as_strided(
        (x.shape[0], chunks, window - 1 + block, d),
        (n_rows * d, block * d, d, 1),
        x.storage_offset() + d,
    )


@dataclass
class _StripParts:
    """What one strip forward computes: the (padded) inputs, the prefix's and the strips' outputs
    and log-sum-exps, and its geometry."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out_pre: torch.Tensor
    lse_pre: torch.Tensor
    out_s: torch.Tensor
    lse_s: torch.Tensor
    length: int
    chunks: int
    halves: bool

    def output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Output (N, T, D) and log-sum-exp (N, T) of every query, padding dropped."""
        n_heads, d = self.q.shape[0], self.q.shape[2]
        out = torch.cat([self.out_pre, self.out_s.reshape(n_heads, -1, d)], 1)
        lse = torch.cat([self.lse_pre, self.lse_s.reshape(n_heads, -1)], 1)
        return out[:, :self.length], lse[:, :self.length]


def _strip_forward(q, k, v, window: int, block: int, scale: float, sinks: int) -> _StripParts:
    """The forward pass of the module docstring for (N, T, D) inputs, ``window < T``."""
    n_heads, t, d = q.shape
    chunks = -(-(t - window) // block)
    padded = window + chunks * block
    if padded > t:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, padded - t)) for x in (q, k, v))
    else:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    halves = cut_in_halves(n_heads, window)
    out_pre, lse_pre = causal_forward(q[:, :window], k[:, :window], v[:, :window], scale, halves)
    mask = _strip_mask(window, block, q.dtype, q.device)
    q_s = q[:, window:].view(n_heads, chunks, block, d)
    out_s, lse_s = _aten._scaled_dot_product_flash_attention_for_cpu(
        q_s, _strips(k, window, block, chunks), _strips(v, window, block, chunks), 0.0, False,
        attn_mask=mask, scale=scale,
    )
    if sinks:
        out_s, lse_s = _merge_strip_sinks(q, k, v, window, sinks, scale, out_s, lse_s)
    return _StripParts(q, k, v, out_pre, lse_pre, out_s, lse_s, t, chunks, halves)


class _StripAttention(torch.autograd.Function):
    """Local causal attention with one window for ``q``, ``k``, ``v`` of shape (N, T, D);
    the strip queries also see the first ``sinks`` keys when ``sinks > 0``."""

    @staticmethod
    def forward(ctx, q, k, v, window: int, block: int, scale: float, sinks: int):
        parts = _strip_forward(q, k, v, window, block, scale, sinks)
        ctx.save_for_backward(parts.q, parts.k, parts.v, parts.out_pre, parts.lse_pre, parts.out_s, parts.lse_s)
        ctx.geometry = (q.shape[1], window, block, parts.chunks, scale, sinks, parts.halves)
        return parts.output()[0]

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out_pre, lse_pre, out_s, lse_s = ctx.saved_tensors
        t, window, block, chunks, scale, sinks, halves = ctx.geometry
        n_heads, padded, d = q.shape
        grad = grad_out.contiguous()
        if padded > t:
            grad = torch.nn.functional.pad(grad, (0, 0, 0, padded - t))
        prefix = slice(0, window)
        dq_pre, dk_pre, dv_pre = causal_backward(
            grad[:, prefix], q[:, prefix], k[:, prefix], v[:, prefix], out_pre, lse_pre, scale, halves
        )
        mask = _strip_mask(window, block, q.dtype, q.device)
        dq_s, dk_s, dv_s = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad[:, window:].view(n_heads, chunks, block, d),
            q[:, window:].view(n_heads, chunks, block, d),
            _strips(k, window, block, chunks), _strips(v, window, block, chunks),
            out_s, lse_s, 0.0, False, attn_mask=mask, scale=scale,
        )
        dq = torch.cat([dq_pre, dq_s.reshape(n_heads, chunks * block, d)], 1)
        # Put the strip gradients back: strip c starts at key 1 + c b; its columns
        # [s b, (s + 1) b) land on rows 1 + (c + s) b + [0, b) for every c at once.
        rows = padded + block
        dk = torch.zeros(n_heads, rows, d, dtype=q.dtype, device=q.device)
        dv = torch.zeros(n_heads, rows, d, dtype=q.dtype, device=q.device)
        dk[:, :window] = dk_pre
        dv[:, :window] = dv_pre
        strip_len = window - 1 + block
        for lo in range(0, strip_len, block):
            width = min(block, strip_len - lo)
            span = slice(1 + lo, 1 + lo + chunks * block)
            dk[:, span].view(n_heads, chunks, block, d)[:, :, :width] += dk_s[:, :, lo : lo + width]
            dv[:, span].view(n_heads, chunks, block, d)[:, :, :width] += dv_s[:, :, lo : lo + width]
        if sinks:
            tail = slice(window, padded)
            dq_k, dk_k, dv_k = sink_backward(
                q[:, tail], k[:, :sinks], v[:, :sinks], scale,
                out_s.reshape(n_heads, -1, d), lse_s.reshape(n_heads, -1), grad[:, tail], window=window,
            )
            dq[:, window:] += dq_k.to(dq.dtype)
            dk[:, :sinks] += dk_k.to(dk.dtype)
            dv[:, :sinks] += dv_k.to(dv.dtype)
        return dq[:, :t], dk[:, :t], dv[:, :t], None, None, None, None


def _merge_strip_sinks(q, k, v, window, sinks, scale, out_s, lse_s):
    """The strip queries' output and log-sum-exp with their sinks merged in (:mod:`.sinks`)."""
    n_heads, d = q.shape[0], q.shape[2]
    out, lse = merge_sinks(
        q[:, window:], k[:, :sinks], v[:, :sinks], scale,
        out_s.reshape(n_heads, -1, d), lse_s.reshape(n_heads, -1), window=window,
    )
    return out.view(out_s.shape), lse.view(lse_s.shape)


def strip_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scale: float,
    block: int | None = None,
    *,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Local causal attention with one ``window`` for all heads of ``q`` (B, H, T, D).

    ``k`` and ``v`` are (B, H_kv, T, D); grouped KV heads are expanded here.
    With ``sink_tokens`` the strip queries also see the first keys, merged by
    log-sum-exp (:mod:`aah.backends.sinks`).
    """
    b, h, t, d = q.shape
    if block is None:
        block = strip_block(window, t)
    if window >= t:
        return balanced_causal(q, k, v, scale)
    k, v = expand_kv(k, h), expand_kv(v, h)
    out = _StripAttention.apply(
        q.reshape(b * h, t, d), k.reshape(b * h, t, d), v.reshape(b * h, t, d), window, block, scale,
        sink_span(window, t, sink_tokens),
    )
    return out.view(b, h, t, d)


def strip_attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, windows: Sequence[int], scale: float, *, sink_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The windowed attention of :meth:`StripsBackend.attend` (heads grouped by window, sinks
    included) and its log-sum-exp, forward only: output (B, H, T, D) and float32 log-sum-exp
    (B, H, T) of the scaled scores each query reads, so that a caller can join more keys to the
    same softmax (kept keys, :mod:`aah.hf.bridge.kept_keys`). ``k``, ``v`` (B, H_kv, T, D)."""
    b, h, t, d = q.shape
    out = q.new_empty(b, h, t, v.shape[-1])
    lse = torch.empty(b, h, t, dtype=torch.float32, device=q.device)
    group = h // k.shape[1]
    by_window: dict[int, list[int]] = {}
    for head, w in enumerate(windows):
        by_window.setdefault(min(int(w), t), []).append(head)
    with torch.no_grad():
        for window, heads in by_window.items():
            kv = [head // group for head in heads]
            q_g = q[:, heads].reshape(b * len(heads), t, d)
            k_g = k[:, kv].reshape(b * len(heads), t, d)
            v_g = v[:, kv].reshape(b * len(heads), t, v.shape[-1])
            if window >= t:
                out_g, lse_g = causal_forward(q_g.contiguous(), k_g.contiguous(), v_g.contiguous(), scale,
                                              cut_in_halves(b * len(heads), t))
            else:
                block = strip_block(window, t)
                out_g, lse_g = _strip_forward(q_g, k_g, v_g, window, block, scale,
                                              sink_span(window, t, sink_tokens)).output()
            out[:, heads] = out_g.view(b, len(heads), t, -1)
            lse[:, heads] = lse_g.view(b, len(heads), t).float()
    return out, lse


class StripsBackend(AttentionBackend):
    name = "strips"
    description = (
        "heads grouped by window; a causal prefix plus chunks of queries against strided key "
        "strips, all through the fused CPU attention kernel (CPU only)"
    )

    def unavailable_reason(self, device):
        device = torch.device(device)
        if device.type != "cpu":
            return f"the fused strip kernel is PyTorch's CPU attention kernel; not available on {device.type}"
        return None

    def attend(self, q, k, v, windows, scale, sink_tokens=0):
        return grouped_attention(q, k, v, windows, scale, partial(strip_attention, sink_tokens=sink_tokens))

    def executed_coverage(self, windows, seq_len, sink_tokens=0):
        t = seq_len
        triangle = t * (t + 1) / 2
        entries = (strip_entries(min(w, t), t, sink_tokens=sink_tokens) for w in windows)
        return sum(e / triangle for e in entries) / len(windows)
