"""``banded``: grouped local attention that computes only the key blocks inside each band.

This is the grouped local execution of the AAH-v3 paper (section 5.8: heads
that selected the same window span run together under one causal local mask)
turned into a backend that really skips work (section 7.7: backend-realized
local attention). Plain PyTorch: it runs on CPU and GPU and supports autograd.

Geometry: the band ``i - W < j <= i`` per window group in query blocks of ``block`` rows (edges
masked by :func:`aah.windows.visible`), plus the sinks ``j < S'``, ``j <= i - W``.

How it works
------------
* Heads are grouped by window. Heads whose window covers the whole sequence
  (``W >= T``) run through fused causal ``scaled_dot_product_attention``,
  except a lone such head, which runs through the banded plan with ``W = T``
  (see :func:`_full_heads_use_sdpa`).
* For a local group the queries are cut into blocks of ``block`` rows. Query
  block ``[s, e)`` needs keys ``(s - W, e)`` only, so it is multiplied against
  ``e - max(0, s - W + 1)`` keys, at most ``W + block - 1``: work and memory
  grow with ``T * W``, not ``T^2``.
* Interior blocks (whose key slice lies inside the sequence) all have the same
  shape, so runs of them are multiplied in one batched product against
  overlapping strided views of the keys (``Tensor.unfold``: no copy). The
  first blocks, whose slice is cut at key 0, go in pairs that share the keys
  of the later block. See :func:`band_plan`.
* One custom :class:`torch.autograd.Function` per group runs that plan in both
  directions (flash style): the forward stores no scores or probabilities;
  the backward recomputes each block's probabilities and accumulates ``dK``
  and ``dV`` into the key slices. No per-position Python loop, no copies of
  the key windows, no autograd through slicing. Only the two edge strips of
  each block's score matrix are masked; the middle is never touched.
* Grouped-query attention: query heads of a group that read the same KV head
  are stacked along the rows of one matrix product, so KV heads are never
  expanded (when every KV head in a group serves the same number of query
  heads, the usual case; otherwise the group gathers one KV head per query
  head).
* Sinks (``sink_tokens = S > 0``): the forward also keeps each row's
  log-sum-exp, then merges the sinks that rows ``i >= W`` miss (one small
  ``(T - W) x S'`` block, ``S' = min(S, T - W)``) into the output by
  log-sum-exp; the merged probabilities of the band are its own softmax times
  its share ``e^(L_w - L)`` of the row, so the backward scales ``dO`` and
  ``delta`` by that share and runs the band loop unchanged, then adds the sink
  block's gradients (:mod:`aah.backends.sinks`). ``S = 0`` runs the plain
  path.

Block size (:func:`block_size`): the band of a block is a parallelogram inside
a ``block x (W + block - 1)`` rectangle, so the wasted fraction is about
``block / W``, while the per-product overhead (Python, thread hand-off,
small-matrix inefficiency) falls as ``1 / block``. Balancing the two gives a
block near ``sqrt(c * W)``; ``c = 8`` measured best on a 2-core CPU, so the
heuristic is ``sqrt(8 W)`` rounded down to a power of two, clamped to
``[16, 128]`` (64 for W = 512 or 1024, 128 from W = 2048; about 6 to 13 %
waste).

Executed coverage (:meth:`BandedBackend.executed_coverage`) counts the score
entries of the rectangles the plan really multiplies (:func:`band_plan`), over
the causal triangle ``T (T + 1) / 2``, plus ``(T - W) S'`` sink entries; heads
on the SDPA path count as exactly their triangle (1.0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from ..windows import visible
from .base import AttentionBackend
from .sdpa import causal_sdpa
from .sinks import merge_sinks, sink_backward, sink_span

__all__ = [
    "BandedBackend",
    "Chunk",
    "band_blocks",
    "band_plan",
    "banded_group_attention",
    "block_size",
    "gather_group",
    "grouped_attention",
    "planned_entries",
    "restore_head_order",
]

_MIN_BLOCK = 16
_MAX_BLOCK = 128
# Most score entries one batched product of interior blocks may produce (2 MB in fp32).
_CHUNK_ENTRIES = 1 << 19


def block_size(window: int, seq_len: int) -> int:
    """Query block size the kernel uses for ``window`` at ``seq_len`` (see the module notes).

    ``sqrt(8 * W)`` rounded down to a power of two, clamped to ``[16, 128]`` and to
    the next power of two >= ``T``: 64 for windows 512 to 1023, 128 from 2048.
    """
    power = 1 << max(0, (math.isqrt(8 * window)).bit_length() - 1)
    power = min(max(power, _MIN_BLOCK), _MAX_BLOCK)
    cap = 1 << max(0, (seq_len - 1).bit_length())  # no point in a block beyond the sequence
    return max(1, min(power, cap))


def band_blocks(window: int, seq_len: int, block: int) -> Iterator[tuple[int, int, int, int]]:
    """Every query block ``[q_start, q_end)`` and the keys ``[k_start, k_end)`` its rows may see."""
    for start in range(0, seq_len, block):
        end = min(seq_len, start + block)
        yield start, end, max(0, start - window + 1), end


class Chunk(NamedTuple):
    """``count`` query blocks multiplied in one batched product.

    Entry ``i`` has query rows ``[q_start + i * rows, ... + rows)`` and keys
    ``[k_start + i * k_step, ... + keys)``: ``k_step == rows`` for interior
    blocks (each its own window), ``0`` for edge pairs (shared keys).
    """

    q_start: int
    count: int
    rows: int
    k_start: int
    k_step: int
    keys: int


def band_plan(window: int, seq_len: int, block: int) -> list[Chunk]:
    """The kernel's plan: which score rectangles it multiplies, in order.

    * Interior blocks (full blocks with ``q_start - window + 1 >= 0``): one
      chunk of consecutive blocks with ``window + block - 1`` keys each; the
      kernel multiplies them in batches (how many per batch changes nothing
      computed).
    * Edge blocks (their band is cut at key 0): consecutive full ones go in
      pairs sharing keys ``[0, end of the second block)`` (a batch of two keeps
      both threads of a 2-core CPU busy; the first block of a pair computes
      ``block x block`` extra, masked, entries); an odd one out and a final
      partial block run alone with exactly their keys.
    """
    plan: list[Chunk] = []
    pending: tuple[int, int] | None = None  # an unpaired full edge block (q_start, q_end)
    interior_start, interior_count = 0, 0
    keys_interior = window + block - 1
    for qs, qe, ks, ke in band_blocks(window, seq_len, block):
        rows = qe - qs
        if rows == block and qs - window + 1 >= 0:
            if interior_count == 0:
                interior_start = qs
            interior_count += 1
            continue
        if rows == block and ks == 0:
            if pending is None:
                pending = (qs, qe)
            else:
                plan.append(Chunk(pending[0], 2, block, 0, 0, qe))
                pending = None
            continue
        plan.append(Chunk(qs, 1, rows, ks, 0, ke - ks))
    if pending is not None:
        plan.append(Chunk(pending[0], 1, block, 0, 0, pending[1]))
    if interior_count:
        plan.append(Chunk(interior_start, interior_count, block, interior_start - window + 1, block, keys_interior))
    plan.sort(key=lambda c: c.q_start)
    return plan


def planned_entries(window: int, seq_len: int, block: int) -> int:
    """Score entries (query rows times keys) one head's plan multiplies."""
    return sum(c.count * c.rows * c.keys for c in band_plan(window, seq_len, block))


def _strip_geometry(offset: int, shift: int, count: int, rows: int, keys: int, window: int) -> tuple[int, int]:
    """The two edge strips of a batch of score matrices: ``(left, right)`` column bounds.

    Entry ``i``, row ``ii``, column ``jj`` is the pair at distance
    ``offset + i * shift + ii - jj`` (query minus key), which must lie in
    ``[0, window)``. Only columns ``[0, left)`` (too far back for some row) and
    ``[right, keys)`` (in the future of some row) can hold masked pairs; the
    middle strip is fully visible and never touched.
    """
    last = offset + (count - 1) * shift
    left = max(0, min(keys, last + rows - window))
    right = min(keys, offset + 1)
    if right < left:  # the strips overlap (a window shorter than the block): one strip
        return keys, keys
    return left, right


def _strip_mask(
    first: int, shift: int, count: int, rows: int, width: int, window: int, repeat: int,
    dtype: torch.dtype, device: torch.device,
) -> torch.Tensor:
    """Additive mask (0 or -inf), shape (count, repeat * rows, width), of a strip whose first
    column is at distance ``first + i * shift + ii`` from row ``ii`` of entry ``i`` (:func:`aah.windows.visible`)."""
    q_pos = first + torch.arange(count, device=device)[:, None, None] * shift + torch.arange(rows, device=device)[:, None]
    mask = torch.zeros(count, rows, width, dtype=dtype, device=device)
    mask.masked_fill_(~visible(q_pos, torch.arange(width, device=device), window), float("-inf"))
    return mask.repeat(1, repeat, 1) if repeat > 1 else mask


class _MaskCache:
    """Strip masks of one call. A strip's mask depends only on its distances
    relative to its first column, so most chunks share their masks (all
    interior chunks share both strips, all edge pairs share the right one)."""

    def __init__(self, window: int, repeat: int, dtype: torch.dtype, device: torch.device):
        self.window, self.repeat, self.dtype, self.device = window, repeat, dtype, device
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def _mask(self, first: int, shift: int, count: int, rows: int, width: int) -> torch.Tensor:
        key = (first, shift, count, rows, width)
        mask = self._cache.get(key)
        if mask is None:
            mask = _strip_mask(
                first, shift, count, rows, width, self.window, self.repeat, self.dtype, self.device
            )
            self._cache[key] = mask
        return mask

    def resolve(
        self, offset: int, shift: int, count: int, rows: int, keys: int
    ) -> tuple[int, torch.Tensor | None, int, torch.Tensor | None]:
        """``(left, left_mask, right, right_mask)`` for a batch of ``count`` score matrices
        whose entry ``i`` has its queries ``offset + i * shift`` after its first key."""
        count = count if shift else 1
        left, right = _strip_geometry(offset, shift, count, rows, keys, self.window)
        left_mask = self._mask(offset, shift, count, rows, left) if left > 0 else None
        right_mask = self._mask(offset - right, shift, count, rows, keys - right) if right < keys else None
        return left, left_mask, right, right_mask


def _rows_of(x: torch.Tensor, start: int, count: int, rows: int) -> torch.Tensor:
    """Rows ``[start, start + count * rows)`` of ``x`` (r, T, D) as (count, r * rows, D)."""
    r, _, d = x.shape
    part = x[:, start : start + count * rows]
    if r == 1:
        return part.view(count, rows, d)
    return part.reshape(r, count, rows, d).transpose(0, 1).reshape(count, r * rows, d)


def _put_rows(dst: torch.Tensor, start: int, count: int, rows: int, value: torch.Tensor) -> None:
    """Inverse of :func:`_rows_of`: write ``value`` (count, r * rows, D) into ``dst`` (r, T, D)."""
    r, _, d = dst.shape
    part = dst[:, start : start + count * rows].view(r, count, rows, d)
    part.copy_(value.view(count, r, rows, d).transpose(0, 1))


class _Step(NamedTuple):
    """One batched product of the plan (for every KV unit), with its strip masks resolved."""

    q_lo: int  # query rows [q_lo, q_hi) of the whole batch
    q_hi: int
    count: int
    rows: int
    k_lo: int  # keys [k_lo, k_hi) touched by the whole batch
    k_hi: int
    k_step: int
    keys: int
    left: int  # columns [0, left) get left_mask, [right, keys) get right_mask
    left_mask: torch.Tensor | None
    right: int
    right_mask: torch.Tensor | None


def _steps(plan: list[Chunk], masks: _MaskCache) -> list[_Step]:
    """The plan as batched products: interior chunks split into batches of an even size (2 to 8)."""
    steps = []
    for c in plan:
        if c.k_step == 0:
            batches = [(c.q_start, c.count, c.k_start)]
        else:
            entries = masks.repeat * c.rows * c.keys
            size = min(8, max(2, (_CHUNK_ENTRIES // max(1, entries)) // 2 * 2))
            batches = [
                (c.q_start + f * c.rows, min(size, c.count - f), c.k_start + f * c.k_step)
                for f in range(0, c.count, size)
            ]
        for qs, count, ks in batches:
            span = (count - 1) * c.k_step + c.keys
            masking = masks.resolve(qs - ks, c.rows - c.k_step, count, c.rows, c.keys)
            steps.append(
                _Step(qs, qs + count * c.rows, count, c.rows, ks, ks + span, c.k_step, c.keys, *masking)
            )
    return steps


def _keys_t(x: torch.Tensor, st: _Step) -> torch.Tensor:
    """Keys of every entry of ``st`` as a (count, D, keys) view of ``x`` (T, D): no copy."""
    part = x[st.k_lo : st.k_hi]
    if st.k_step:
        return part.unfold(0, st.keys, st.k_step)  # overlapping windows
    return part.t().expand(st.count, -1, -1)  # shared keys


def _values(x: torch.Tensor, st: _Step) -> torch.Tensor:
    """Values of every entry of ``st`` as a (count, keys, D) view of ``x`` (T, D): no copy."""
    part = x[st.k_lo : st.k_hi]
    if st.k_step:
        return part.unfold(0, st.keys, st.k_step).transpose(1, 2)
    return part.expand(st.count, -1, -1)


def _masked(scores: torch.Tensor, st: _Step) -> torch.Tensor:
    if st.left_mask is not None:
        scores[:, :, : st.left] += st.left_mask
    if st.right_mask is not None:
        scores[:, :, st.right :] += st.right_mask
    return scores


class _BandedAttention(torch.autograd.Function):
    """Local causal attention for one window group, flash style (scores never stored).

    ``qg`` is (N, r, T, D): ``r`` query heads per KV head, ``N`` = batch x KV heads;
    ``kg``, ``vg`` are (N, T, D). Returns (N, r, T, D).
    """

    @staticmethod
    def forward(ctx, qg, kg, vg, window: int, block: int, scale: float, sinks: int):
        n, r, t, d = qg.shape
        out = torch.empty_like(qg)
        # With sinks, each row's log-sum-exp (window part, then merged with the sinks) and the
        # factor e^(L_w - L) that turns the band's own softmax into its merged probabilities.
        lse = torch.empty(n, r, t, 1, dtype=_acc_dtype(qg.dtype), device=qg.device) if sinks else None
        band_share = torch.ones_like(lse) if sinks else None
        steps = _steps(band_plan(window, t, block), _MaskCache(window, r, qg.dtype, qg.device))
        zero = qg.new_zeros(1, 1, 1)  # ignored input of the beta=0 products (alpha applies the scale)
        for u in range(n):
            q_u, k_u, v_u, o_u = qg[u], kg[u], vg[u], out[u]
            for st in steps:
                qb = _rows_of(q_u, st.q_lo, st.count, st.rows)
                scores = _masked(torch.baddbmm(zero, qb, _keys_t(k_u, st), beta=0, alpha=scale), st)
                if lse is None:
                    probs = torch.softmax(scores, dim=-1)
                else:
                    probs = _softmax_keeping_lse(scores, lse[u], st)
                if r == 1:
                    dst = o_u[0, st.q_lo : st.q_hi].view(st.count, st.rows, d)
                    torch.bmm(probs, _values(v_u, st), out=dst)
                else:
                    _put_rows(o_u, st.q_lo, st.count, st.rows, torch.bmm(probs, _values(v_u, st)))
            if lse is not None:
                _merge_unit_sinks(q_u, k_u, v_u, o_u, lse[u], band_share[u], window, sinks, scale)
        ctx.save_for_backward(qg, kg, vg, out, lse, band_share)
        ctx.window, ctx.block, ctx.scale, ctx.sinks = window, block, scale, sinks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qg, kg, vg, out, lse, band_share = ctx.saved_tensors
        window, block, scale, sinks = ctx.window, ctx.block, ctx.scale, ctx.sinks
        n, r, t, d = qg.shape
        grad_out = grad_out.contiguous()
        low_precision = qg.dtype in (torch.float16, torch.bfloat16)
        acc_dtype = torch.float32 if low_precision else qg.dtype
        # delta_i = sum_j P_ij dP_ij = dO_i . O_i, for every row.
        delta = (grad_out.to(acc_dtype) * out.to(acc_dtype)).sum(-1, keepdim=True).to(qg.dtype)
        dq = torch.empty(qg.shape, dtype=qg.dtype, device=qg.device)
        dk = torch.zeros(n, t, d, dtype=acc_dtype, device=qg.device)
        dv = torch.zeros(n, t, d, dtype=acc_dtype, device=qg.device)
        steps = _steps(band_plan(window, t, block), _MaskCache(window, r, qg.dtype, qg.device))
        zero = qg.new_zeros(1, 1, 1)
        zero2 = qg.new_zeros(1, 1)
        index_cache: dict[tuple[int, int, int], torch.Tensor] = {}
        for u in range(n):
            q_u, k_u, v_u, g_u, d_u, dq_u = qg[u], kg[u], vg[u], grad_out[u], delta[u], dq[u]
            dk_u, dv_u = dk[u], dv[u]
            if lse is not None:
                # The merged probabilities of the band are its own softmax times its share
                # e^(L_w - L) of the row; scaling dO and delta by it (rows x D, not rows x keys)
                # leaves the band loop as it is without sinks.
                share = band_share[u].to(qg.dtype)
                g_u, d_u = grad_out[u] * share, delta[u] * share
            for st in steps:
                k_t = _keys_t(k_u, st)
                qb = _rows_of(q_u, st.q_lo, st.count, st.rows)
                gb = _rows_of(g_u, st.q_lo, st.count, st.rows)
                db = _rows_of(d_u, st.q_lo, st.count, st.rows)
                scores = _masked(torch.baddbmm(zero, qb, k_t, beta=0, alpha=scale), st)
                probs = torch.softmax(scores, dim=-1)
                dscores = torch.bmm(gb, _keys_t(v_u, st)).sub_(db).mul_(probs)  # softmax backward
                # dQ = scale dS K.
                if r == 1:
                    dst = dq_u[0, st.q_lo : st.q_hi].view(st.count, st.rows, d)
                    torch.baddbmm(zero, dscores, k_t.transpose(1, 2), beta=0, alpha=scale, out=dst)
                else:
                    dqb = torch.baddbmm(zero, dscores, k_t.transpose(1, 2), beta=0, alpha=scale)
                    _put_rows(dq_u, st.q_lo, st.count, st.rows, dqb)
                # dV = P^T dO and dK = scale dS^T Q, added into the keys they came from.
                # (Out-of-place products then adds: FlopCounterMode does not count in-place ones.)
                if st.k_step == 0:  # shared keys: one product over all entries' rows
                    rows_all = st.count * probs.shape[1]
                    dv_u[st.k_lo : st.k_hi] += torch.mm(probs.view(rows_all, -1).t(), gb.reshape(rows_all, d))
                    dk_u[st.k_lo : st.k_hi] += torch.addmm(
                        zero2, dscores.view(rows_all, -1).t(), qb.reshape(rows_all, d), beta=0, alpha=scale
                    )
                else:  # overlapping windows: add every entry's slice at its offset
                    key = (st.count, st.keys, st.k_step)
                    index = index_cache.get(key)
                    if index is None:
                        index = (
                            torch.arange(st.count, device=qg.device)[:, None] * st.k_step
                            + torch.arange(st.keys, device=qg.device)[None, :]
                        ).flatten()
                        index_cache[key] = index
                    dv_w = torch.bmm(probs.transpose(1, 2), gb).view(-1, d)
                    dk_w = torch.baddbmm(zero, dscores.transpose(1, 2), qb, beta=0, alpha=scale).view(-1, d)
                    dv_u[st.k_lo : st.k_hi].index_add_(0, index, dv_w.to(acc_dtype))
                    dk_u[st.k_lo : st.k_hi].index_add_(0, index, dk_w.to(acc_dtype))
            if lse is not None:
                tail = slice(window, t)
                dq_s, dk_s, dv_s = sink_backward(
                    q_u[:, tail], k_u[:sinks], v_u[:sinks], scale, out[u][:, tail], lse[u][:, tail, 0],
                    grad_out[u][:, tail], window=window,
                )
                dq_u[:, tail] += dq_s.to(dq_u.dtype)
                dk_u[:sinks] += dk_s.sum(0).to(acc_dtype)
                dv_u[:sinks] += dv_s.sum(0).to(acc_dtype)
        dtype = qg.dtype
        return dq, dk.to(dtype), dv.to(dtype), None, None, None, None


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _softmax_keeping_lse(scores: torch.Tensor, lse_u: torch.Tensor, st: _Step) -> torch.Tensor:
    """Softmax of a step's scores that also writes the rows' log-sum-exp into ``lse_u`` (r, T, 1).

    ``L = max(s) - log(max(p))`` (the largest probability is ``e^(max(s) - L)``, at least
    ``1 / keys``): two read-only reductions next to the fused softmax. Half-precision scores
    take ``logsumexp`` in float32 instead.
    """
    probs = torch.softmax(scores, dim=-1)
    if scores.dtype == lse_u.dtype:
        lse_b = scores.amax(-1, keepdim=True) - probs.amax(-1, keepdim=True).log_()
    else:
        lse_b = torch.logsumexp(scores.to(lse_u.dtype), dim=-1, keepdim=True)
    _put_rows(lse_u, st.q_lo, st.count, st.rows, lse_b)
    return probs


def _merge_unit_sinks(
    q_u: torch.Tensor, k_u: torch.Tensor, v_u: torch.Tensor, o_u: torch.Tensor, lse_u: torch.Tensor,
    share_u: torch.Tensor, window: int, sinks: int, scale: float,
) -> None:
    """Merge the sinks into rows ``[W, T)`` of one KV unit's output and log-sum-exp, in place,
    and keep the band's share ``e^(L_w - L)`` of each row in ``share_u``."""
    tail = slice(window, q_u.shape[1])
    lse_w = lse_u[:, tail, 0]
    out, lse = merge_sinks(q_u[:, tail], k_u[:sinks], v_u[:sinks], scale, o_u[:, tail], lse_w, window=window)
    o_u[:, tail] = out
    share_u[:, tail, 0] = torch.exp(lse_w - lse)
    lse_u[:, tail, 0] = lse


def banded_group_attention(
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

    ``k`` and ``v`` are (B, H_kv, T, D) with ``H`` divisible by ``H_kv``; the
    ``r = H // H_kv`` query heads of each KV head are stacked, not expanded.
    With ``sink_tokens`` the rows ``i >= W`` also see the sinks their window
    misses, merged by log-sum-exp (:mod:`aah.backends.sinks`).
    """
    b, h, t, d = q.shape
    h_kv = k.shape[1]
    if block is None:
        block = block_size(window, t)
    qg = q.reshape(b * h_kv, h // h_kv, t, d)
    kg = k.reshape(b * h_kv, t, d).contiguous()
    vg = v.reshape(b * h_kv, t, d).contiguous()
    sinks = sink_span(window, t, sink_tokens)
    return _BandedAttention.apply(qg, kg, vg, window, block, scale, sinks).reshape(b, h, t, d)


class BandedBackend(AttentionBackend):
    name = "banded"
    description = (
        "heads grouped by window; each query block multiplies only the key slice of its band "
        "(custom autograd, plain PyTorch, CPU and GPU); full windows use causal SDPA"
    )

    def attend(self, q, k, v, windows, scale, sink_tokens=0):
        full = sum(1 for w in windows if w >= q.shape[2])

        def run(q_g, k_g, v_g, w, scale):
            if w >= q.shape[2] and _full_heads_use_sdpa(full):
                return causal_sdpa(q_g, k_g, v_g, scale)
            return banded_group_attention(q_g, k_g, v_g, w, scale, sink_tokens=sink_tokens)

        return grouped_attention(q, k, v, windows, scale, run)

    def executed_coverage(self, windows, seq_len, sink_tokens=0):
        t = seq_len
        triangle = t * (t + 1) / 2
        full = sum(1 for w in windows if w >= t)
        total = 0.0
        for w in windows:
            if w >= t and _full_heads_use_sdpa(full):
                total += 1.0  # causal SDPA: the triangle
            else:
                w = min(w, t)
                sinks = (t - w) * sink_span(w, t, sink_tokens)
                total += (planned_entries(w, t, block_size(w, t)) + sinks) / triangle
        return total / len(windows)


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    windows: tuple[int, ...],
    scale: float,
    run_group: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor],
) -> torch.Tensor:
    """Group heads by window (paper, section 5.8), run each group, restore head order.

    ``run_group(q_g, k_g, v_g, window, scale)`` computes one group (windows
    ``>= T`` are passed as ``T``). Without GQA, q, k and v are cut into the
    groups with one permutation and a split: its backward is one
    concatenation, not a zero-filled copy per group.
    """
    t = q.shape[2]
    group = q.shape[1] // k.shape[1]
    by_window: dict[int, list[int]] = {}
    for head, w in enumerate(windows):
        by_window.setdefault(min(w, t), []).append(head)  # W >= T is plain causal
    groups = sorted(by_window.items())
    order = [head for _, heads in groups for head in heads]
    sizes = [len(heads) for _, heads in groups]
    q_parts = torch.split(_permute_heads(q, order), sizes, dim=1)
    if group == 1:
        k_parts = torch.split(_permute_heads(k, order), sizes, dim=1)
        v_parts = torch.split(_permute_heads(v, order), sizes, dim=1)
    outputs: list[torch.Tensor] = []
    for i, (w, heads) in enumerate(groups):
        if group == 1:
            q_g, k_g, v_g = q_parts[i], k_parts[i], v_parts[i]
        else:
            q_g = q_parts[i]
            _, k_g, v_g, _ = gather_group(q, k, v, heads, group)
        outputs.append(run_group(q_g, k_g, v_g, w, scale))
    return restore_head_order(outputs, order)


def _full_heads_use_sdpa(count: int) -> bool:
    """Whether ``count`` full-window heads of one call go to causal SDPA (else the banded plan).

    PyTorch's CPU SDPA kernel hands each thread a contiguous run of (head,
    query block) items, so with a single causal head one thread gets the
    short early rows and the other the long late ones: about 1.4x slower per
    head than with two or more heads. A lone full head therefore runs through
    the banded plan (``W = T``: the edge pairs split evenly over threads).
    """
    return count >= 2


def gather_group(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: list[int], group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The query heads ``heads`` and the KV heads they read, ready for one grouped call.

    ``group = H // H_kv``. Returns ``(q_g, k_g, v_g, heads)`` with the heads in
    ascending order (which is also KV-head order). When every KV head used
    serves the same number ``r`` of these query heads, ``k_g`` holds each KV head
    once and query head ``i`` of ``q_g`` reads KV head ``i // r`` (no expansion);
    otherwise ``k_g`` holds one KV head per query head. Whole tensors are passed
    through uncopied when the group is every head.
    """
    heads = sorted(heads)
    kv_of = [hd // group for hd in heads]
    counts: dict[int, int] = {}
    for kv in kv_of:
        counts[kv] = counts.get(kv, 0) + 1
    kv_list = sorted(counts) if len(set(counts.values())) == 1 else kv_of
    q_g = q if heads == list(range(q.shape[1])) else _take_heads(q, heads)
    if kv_list == list(range(k.shape[1])):
        return q_g, k, v, heads
    return q_g, _take_heads(k, kv_list), _take_heads(v, kv_list), heads


def _permute_heads(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``x[:, order]`` for a permutation ``order``, without a copy when it is the identity."""
    if order == list(range(x.shape[1])):
        return x
    return _HeadPermutation.apply(x, order)


def _inverse_order(order: list[int]) -> list[int]:
    """The permutation that undoes ``order``: ``inverse[order[i]] = i``."""
    inverse = [0] * len(order)
    for position, head in enumerate(order):
        inverse[head] = position
    return inverse


class _HeadPermutation(torch.autograd.Function):
    """``x[:, order]`` whose gradient is the inverse permutation of the incoming one.

    ``index_select``'s own backward scatters into a zero-filled tensor
    (``index_add_``); for a permutation every head is hit exactly once, so a
    gather by the inverse order gives the same gradient without the fill and
    the scatter. At the suite's size (B = 32, H = 4, T = 128) the four
    permutations of a mixed-window call cost about as much as the short
    heads' attention itself.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        ctx.inverse = torch.tensor(_inverse_order(order), device=x.device)
        return x.index_select(1, torch.tensor(order, device=x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.index_select(1, ctx.inverse), None


def _take_heads(x: torch.Tensor, heads: list[int]) -> torch.Tensor:
    """``x[:, heads]``: a slice (a view) for a run of consecutive heads, else a gather."""
    if heads == list(range(heads[0], heads[0] + len(heads))):
        return x[:, heads[0] : heads[0] + len(heads)]
    return x.index_select(1, torch.tensor(heads, device=x.device))


def restore_head_order(outputs: list[torch.Tensor], order: list[int]) -> torch.Tensor:
    """Concatenate per-group outputs (B, g, T, D) and put the heads back in ``order``."""
    stacked = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
    return _permute_heads(stacked, _inverse_order(order))
