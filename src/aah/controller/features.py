"""Per-head base features and attention diagnostics (paper section 5.3).

The 9-dimensional base feature of head ``h`` is
``[mean|q|, std q, mean|k|, std k, mean|v|, std v, entropy, output norm, usage]``.
The six activation statistics reduce over batch, time and head dimension
(population standard deviation). The last three are *diagnostics* of an
earlier attention pass ("previous attention diagnostics ... from the most
recent stored attention statistics", 5.3). The paper names them but does not
define them; our definitions (the reference's were degenerate):

* entropy: Shannon entropy of the query's attention row divided by the log of
  the number of keys the query may see (so 1 = uniform, 0 = one key);
* output norm: L2 norm of the head's attention output vector;
* usage: attention mass on keys at distance >= the smallest candidate window,
  i.e. how much the head relies on long-range context.

Which attention they describe is a setting: with ``windows`` (the paper's
reading, ``diagnostics_context="executed"``) each head attends inside its
executed window, as in the pass that ran; without (ours,
``diagnostics_context="full"``) every head sees full causal context, so a head
that was shrunk can still show that it wants more. Either way they are
computed without gradient on a few sampled query positions, never on the full
``T x T`` scores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..backends.base import expand_kv
from ..windows import cut_off, visible

__all__ = [
    "NUM_FEATURES", "FEATURE_NAMES", "qkv_moments", "qkv_statistics", "statistics_from_moments",
    "sample_query_positions", "SampledScores", "sample_scores", "attention_diagnostics",
]

FEATURE_NAMES = (
    "mean_abs_q", "std_q", "mean_abs_k", "std_k", "mean_abs_v", "std_v",
    "entropy", "output_norm", "usage",
)
NUM_FEATURES = len(FEATURE_NAMES)


@torch.no_grad()
def qkv_moments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Per query head ``[E|x|, E x, E x^2]`` for x in q, k, v: shape (H, 9), float64.

    Moments (unlike standard deviations) average exactly over equal-sized
    shards, so data-parallel ranks can combine them into the global statistics.
    With grouped-query attention a query head takes the moments of the KV head it reads.
    """
    num_heads = q.shape[1]
    moments = [_head_moments(x).repeat_interleave(num_heads // x.shape[1], dim=0) for x in (q, k, v)]
    return torch.cat(moments, dim=1)  # KV head -> its query heads


def _head_moments(x: torch.Tensor) -> torch.Tensor:
    """``[E|x|, E x, E x^2]`` per head of ``x`` (B, H_x, T, D): shape (H_x, 3), float64 (section 5.3).

    Each (batch, head, dim) column is summed over T in (at least) float32,
    reading ``x`` in place (no float64 or transposed copy of it; torch sums
    pairwise); the column sums are accumulated in float64. One scratch tensor
    holds ``|x|`` and then ``|x|^2 = x^2``.
    """
    x = x.detach()
    count = x.numel() // x.shape[1]
    acc = torch.promote_types(x.dtype, torch.float32)
    scratch = x.abs()
    abs_sum = scratch.sum(2, dtype=acc)
    cols = [abs_sum, x.sum(2, dtype=acc), scratch.mul_(scratch).sum(2, dtype=acc)]
    return torch.stack(cols, dim=-1).sum((0, 2), dtype=torch.float64) / count  # (B, H_x, D, 3) -> (H_x, 3)


def statistics_from_moments(moments: torch.Tensor) -> torch.Tensor:
    """``[mean|q|, std q, mean|k|, std k, mean|v|, std v]`` (population std) from :func:`qkv_moments`."""
    cols = []
    for i in range(3):
        abs_mean, mean, sq_mean = moments[:, 3 * i], moments[:, 3 * i + 1], moments[:, 3 * i + 2]
        cols += [abs_mean, (sq_mean - mean.square()).clamp_min(0).sqrt()]
    return torch.stack(cols, dim=1).float()


def qkv_statistics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The six activation statistics per query head, shape (H, 6), float32."""
    return statistics_from_moments(qkv_moments(q, k, v))


def sample_query_positions(seq_len: int, num_queries: int, start: int) -> torch.Tensor:
    """Evenly spaced query positions in ``[start, seq_len - 1]``, always including the last one."""
    start = max(0, min(start, seq_len - 1))
    count = min(num_queries, seq_len - start)
    # Walk back from the last position so that a single sample is the last one.
    return torch.linspace(seq_len - 1, start, count).round().long().unique()


@dataclass
class SampledScores:
    """Scaled scores of a few sampled queries against every key, shared within a control update.

    The diagnostics (section 5.3) and the lost-mass table sample the same
    query positions of the same q and k, so a control update computes the
    ``(B, H, S, T)`` score product once (:func:`sample_scores`) and both read
    it; the causal softmax is computed at most once too.
    """

    positions: torch.Tensor  # (S,) sampled query positions
    scores: torch.Tensor  # (B, H, S, T) float32, scaled, unmasked
    scale: float
    _causal_probs: torch.Tensor | None = field(default=None, repr=False)

    def causal_probs(self) -> torch.Tensor:
        """Softmax over the keys each sampled query may see (full causal context)."""
        if self._causal_probs is None:
            seq_len = self.scores.shape[-1]
            keys = torch.arange(seq_len, device=self.scores.device)
            blocked = ~visible(self.positions[:, None], keys, seq_len)  # (S, T); W = T is causal
            self._causal_probs = torch.softmax(_mask_scores(self.scores, blocked), dim=-1)
        return self._causal_probs

    def check(self, seq_len: int, num_queries: int, start: int, scale: float) -> None:
        """Raise ``ValueError`` unless these are the scores that sampling would compute."""
        expected = sample_query_positions(seq_len, num_queries, start).to(self.positions.device)
        if self.scores.shape[-1] != seq_len or self.scale != scale or not torch.equal(self.positions, expected):
            raise ValueError("sampled: scores of other query positions, length or scale")


@torch.no_grad()
def sample_scores(
    q: torch.Tensor, k: torch.Tensor, *, num_queries: int, start: int, scale: float | None = None
) -> SampledScores:
    """The scaled scores of :func:`sample_query_positions` queries against every key, without gradient.

    ``q`` is (B, H, T, D), ``k`` is (B, H_kv, T, D) (grouped-query attention
    repeats KV heads as the backends do).
    """
    num_heads, seq_len, dim = q.shape[1], q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    pos = sample_query_positions(seq_len, num_queries, start=start).to(q.device)
    qs = q.detach().float()[:, :, pos]  # (B, H, S, D)
    kf = expand_kv(k.detach().float(), num_heads).contiguous()  # a strided k makes the product slow
    scores = torch.matmul(qs, kf.transpose(-1, -2)).mul_(scale)  # (B, H, S, T)
    return SampledScores(pos, scores, scale)


def _mask_scores(scores: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """``scores`` with ``-inf`` where ``blocked`` (broadcast), as ``masked_fill`` gives it.

    Adding a ``0 / -inf`` bias yields the same values and is much faster on CPU
    than ``masked_fill`` with a broadcast mask.
    """
    bias = torch.zeros(blocked.shape, dtype=scores.dtype, device=scores.device)
    return scores + bias.masked_fill_(blocked, float("-inf"))


@torch.no_grad()
def attention_diagnostics(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    long_range: int,
    num_queries: int = 32,
    scale: float | None = None,
    windows: Sequence[int] | None = None,
    sampled: SampledScores | None = None,
) -> torch.Tensor:
    """Entropy, output norm and long-range usage per head, shape (H, 3), float32.

    ``long_range`` is the distance from which keys count as long range (the
    smallest candidate window). Queries are sampled from positions that can
    see that far back, when the sequence is long enough. ``windows`` (one per
    query head) restricts head ``h`` to keys ``i - W_h < j <= i``
    (:func:`aah.windows.visible`), the attention as executed; ``None`` means
    full causal context. Usage is the mass on the keys a window of
    ``long_range`` cuts off (:func:`aah.windows.cut_off`). ``sampled``
    passes the scores :func:`sample_scores` computed for the same queries.
    """
    num_heads, seq_len, dim = q.shape[1], q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if sampled is None:
        sampled = sample_scores(q, k, num_queries=num_queries, start=long_range, scale=scale)
    else:
        sampled.check(seq_len, num_queries, long_range, scale)
    pos = sampled.positions
    vf = expand_kv(v.detach().float(), num_heads).contiguous()
    keys = torch.arange(seq_len, device=q.device)
    if windows is not None and len(windows) != num_heads:
        raise ValueError(f"windows: need one per query head ({num_heads}), got {len(windows)}")
    w = seq_len if windows is None else torch.as_tensor(list(windows), dtype=torch.long, device=q.device).view(-1, 1, 1)
    allowed = visible(pos[:, None], keys, w)  # (S, T) causal for W = T, else (H, S, T)
    probs = sampled.causal_probs() if windows is None else torch.softmax(_mask_scores(sampled.scores, ~allowed), -1)
    seen = allowed.sum(-1).float().expand(num_heads, -1)  # (H, S) keys each query may see
    # p log p, 0 where p = 0 (there 0 * log(1e-30) is already 0); one scratch tensor serves twice.
    scratch = probs.clamp_min(1e-30)
    plogp_sum = scratch.log_().mul_(probs).sum(-1)
    log_keys = torch.where(seen > 1, seen.log(), torch.ones_like(seen))
    entropy = torch.where(seen > 1, -plogp_sum / log_keys, torch.zeros_like(log_keys))
    out_norm = torch.matmul(probs, vf).norm(dim=-1)
    usage = torch.mul(probs, cut_off(pos[:, None], keys, long_range), out=scratch).sum(-1)
    diag = torch.stack([entropy, out_norm, usage], dim=-1)  # (B, H, S, 3)
    return diag.mean(dim=(0, 2))
