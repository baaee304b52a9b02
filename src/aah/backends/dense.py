"""``dense``: the paper's dense-masked path (section 5.8), the reference semantics.

Geometry: the whole ``T x T`` square of scores for every head, masked by :func:`aah.windows.band_mask`
(the band ``i - W < j <= i`` plus the sinks ``j < S``, per head), softmax, values. It computes (and
reports) the whole square whatever the windows: the correctness reference, never the fast path.
"""

from __future__ import annotations

import torch

from ..windows import band_mask
from .base import AttentionBackend, expand_kv


class DenseBackend(AttentionBackend):
    name = "dense"
    description = "full T x T scores with a per-head band mask (reference semantics, no work skipped)"

    def attend(self, q, k, v, windows, scale, sink_tokens=0):
        num_heads, seq_len = q.shape[1], q.shape[2]
        k = expand_kv(k, num_heads)
        v = expand_kv(v, num_heads)
        allowed = band_mask(windows, seq_len, device=q.device, sink_tokens=sink_tokens)  # (H, T, T)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v)

    def executed_coverage(self, windows, seq_len, sink_tokens=0):
        # The whole square is computed: T^2 over the causal triangle T(T+1)/2.
        return 2.0 * seq_len / (seq_len + 1)
