"""Lost attention mass per head and candidate window (the budgeted policy's measurement).

For head ``h`` and window ``W`` the *lost mass* is the attention probability
that a query puts on keys at distance ``>= W``, i.e. on keys ``j <= i - W``
that a window of ``W`` would cut off (window convention: query ``i`` keeps
``i - W < j <= i``). It is measured the way the paper's ``usage`` diagnostic is
(section 5.3, see :func:`aah.controller.features.attention_diagnostics`):
without gradient, on a few evenly spaced sampled query positions that see
their full causal context, averaged over the batch and the sampled queries.
``usage`` is the lost mass at the smallest candidate window.

The controller measures it on control updates only and keeps an EMA over
updates in its ``aah_state`` buffers, so it costs nothing in between.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..windows import cut_off, visible
from .features import SampledScores, sample_scores

__all__ = ["lost_mass", "lost_mass_from_probs", "within_context"]


def lost_mass_from_probs(
    probs: torch.Tensor, positions: torch.Tensor, windows: Sequence[int], *, sink_tokens: int = 0
) -> torch.Tensor:
    """Lost mass (..., K) of attention rows ``probs`` (..., S, T) of queries at ``positions`` (S,).

    Entry ``k`` sums each row's probability on the keys ``windows[k]`` cuts off (distance
    ``>= windows[k]``, :func:`aah.windows.cut_off`), averaged over the S rows. Keys
    ``j < sink_tokens`` stay visible, so their mass is never lost.
    """
    keys = torch.arange(probs.shape[-1], device=probs.device)
    pos = positions.to(probs.device)[:, None]
    scratch = torch.empty_like(probs)  # one buffer for every window's masked rows
    out = [
        torch.mul(probs, cut_off(pos, keys, int(w), sink_tokens).to(probs.dtype), out=scratch).sum(-1).mean(-1)
        for w in windows
    ]
    return torch.stack(out, dim=-1)


def within_context(probs: torch.Tensor, positions: torch.Tensor, context: int) -> torch.Tensor:
    """Causal attention rows ``probs`` (..., S, T) of queries at ``positions`` (S,) restricted to
    keys at distance ``< context`` (:func:`aah.windows.visible`) and renormalised: what a layer with
    that sliding window computes."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive window, got {context!r}")
    keys = torch.arange(probs.shape[-1], device=probs.device)
    kept = probs * visible(positions.to(probs.device)[:, None], keys, context).to(probs.dtype)
    return kept / kept.sum(-1, keepdim=True)


@torch.no_grad()
def lost_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    windows: Sequence[int],
    *,
    num_queries: int = 32,
    start: int | None = None,
    scale: float | None = None,
    sampled: SampledScores | None = None,
    sink_tokens: int = 0,
    context: int | None = None,
) -> torch.Tensor:
    """Lost mass per query head and window, shape (H, K), float32.

    ``q`` is (B, H, T, D), ``k`` is (B, H_kv, T, D) (grouped-query attention
    repeats KV heads as the backends do). Queries are sampled as for
    ``usage``: ``num_queries`` evenly spaced positions from ``start``
    (default: the smallest window, so each sampled query can lose mass) to
    the last position. ``sampled`` passes the scores
    :func:`~aah.controller.features.sample_scores` computed for those queries
    (a control update shares them with the diagnostics). Mass on the
    ``sink_tokens`` first keys is not lost (they stay visible). ``context``
    is the layer's own window, where it has one (a pretrained model's sliding
    layer): its queries attend only to keys at distance ``< context``, so the
    rows are renormalised over those keys and no window at or above
    ``context`` loses anything.
    """
    if not windows:
        raise ValueError("windows must name at least one window")
    seq_len, dim = q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    first = min(int(w) for w in windows) if start is None else start
    if sampled is None:
        sampled = sample_scores(q, k, num_queries=num_queries, start=first, scale=scale)
    else:
        sampled.check(seq_len, num_queries, first, scale)
    probs = sampled.causal_probs()
    if context is not None:
        probs = within_context(probs, sampled.positions, context)
    return lost_mass_from_probs(probs, sampled.positions, windows, sink_tokens=sink_tokens).mean(dim=0).float()
