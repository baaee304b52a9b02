"""``sdpa``: full causal attention through ``torch.nn.functional.scaled_dot_product_attention``.

The full-attention baseline. Geometry: ``j <= i``, the rule when every window covers the whole
sequence; it runs only then: asking it for local windows is an error, never a silent widening.
Sink tokens change nothing there (every key is already visible), so they are
accepted and ignored.
"""

from __future__ import annotations

import torch.nn.functional as F

from .base import AttentionBackend, expand_kv


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    description = "full causal scaled_dot_product_attention (the baseline; rejects local windows)"

    def attend(self, q, k, v, windows, scale, sink_tokens=0):
        seq_len = q.shape[2]
        local = [w for w in windows if w < seq_len]
        if local:
            raise ValueError(
                f"backend 'sdpa' runs full causal attention only, but windows {sorted(set(local))} "
                f"are shorter than the sequence ({seq_len}); use 'dense', 'banded' or 'auto'"
            )
        return causal_sdpa(q, k, v, scale)

    def executed_coverage(self, windows, seq_len, sink_tokens=0):
        # Causal kernels skip the tiles above the diagonal: the causal triangle, nominally.
        return 1.0


def causal_sdpa(q, k, v, scale):
    """Causal SDPA with grouped-query KV heads expanded to the query heads."""
    num_heads = q.shape[1]
    return F.scaled_dot_product_attention(
        q, expand_kv(k, num_heads), expand_kv(v, num_heads), is_causal=True, scale=scale
    )
