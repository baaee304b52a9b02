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

import torch

from ..backends.base import expand_kv

__all__ = ["NUM_FEATURES", "FEATURE_NAMES", "qkv_moments", "qkv_statistics", "statistics_from_moments", "sample_query_positions", "attention_diagnostics"]

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
    moments = []
    for x in (q, k, v):
        # Reduced over (B, T, D) with float64 accumulation: no float64 or transposed copy.
        x, dims, f64 = x.detach(), (0, 2, 3), torch.float64
        count = x.numel() // x.shape[1]
        per_head = [t.sum(dims, dtype=f64) / count for t in (x.abs(), x, x * x)]
        moments += [m.repeat_interleave(num_heads // x.shape[1]) for m in per_head]  # KV head -> its query heads
    return torch.stack(moments, dim=1)


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
) -> torch.Tensor:
    """Entropy, output norm and long-range usage per head, shape (H, 3), float32.

    ``long_range`` is the distance from which keys count as long range (the
    smallest candidate window). Queries are sampled from positions that can
    see that far back, when the sequence is long enough. ``windows`` (one per
    query head) restricts head ``h`` to keys ``i - W_h < j <= i``, the
    attention as executed; ``None`` means full causal context.
    """
    b, num_heads, seq_len, dim = q.shape
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    pos = sample_query_positions(seq_len, num_queries, start=long_range).to(q.device)
    qs = q.detach().float()[:, :, pos]  # (B, H, S, D)
    kf = expand_kv(k.detach().float(), num_heads)
    vf = expand_kv(v.detach().float(), num_heads)
    scores = torch.matmul(qs, kf.transpose(-1, -2)) * scale  # (B, H, S, T)
    keys = torch.arange(seq_len, device=q.device)
    distance = pos[:, None] - keys[None, :]  # (S, T)
    visible = (pos + 1).float().expand(num_heads, -1)  # (H, S) keys each query may see
    if windows is None:
        blocked = distance < 0
    else:
        if len(windows) != num_heads:
            raise ValueError(f"windows: need one per query head ({num_heads}), got {len(windows)}")
        w = torch.as_tensor(list(windows), dtype=torch.long, device=q.device).view(num_heads, 1, 1)
        blocked = (distance < 0) | (distance >= w)  # (H, S, T)
        visible = torch.minimum(visible, w.view(num_heads, 1).float())
    scores = scores.masked_fill(blocked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    plogp = torch.where(probs > 0, probs * probs.clamp_min(1e-30).log(), torch.zeros_like(probs))
    log_keys = torch.where(visible > 1, visible.log(), torch.ones_like(visible))
    entropy = torch.where(visible > 1, -plogp.sum(-1) / log_keys, torch.zeros_like(log_keys))
    out_norm = torch.matmul(probs, vf).norm(dim=-1)
    usage = (probs * (distance >= long_range)).sum(-1)
    diag = torch.stack([entropy, out_norm, usage], dim=-1)  # (B, H, S, 3)
    return diag.mean(dim=(0, 2))
