"""Lost attention mass per head and window against a dense float64 computation."""

from __future__ import annotations

import math

import pytest
import torch

from aah.controller.features import attention_diagnostics, sample_query_positions
from aah.controller.lost_mass import lost_mass


def dense_lost_mass(q, k, windows, positions):
    """Full float64 causal attention; mass at distance >= W, averaged over batch and queries."""
    q, k = q.double(), k.double()
    h, h_kv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // h_kv, dim=1)
    t = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    scores = scores.masked_fill(j > i, float("-inf"))
    probs = scores.softmax(-1)  # (B, H, T, T)
    out = torch.zeros(h, len(windows), dtype=torch.float64)
    for idx, w in enumerate(windows):
        far = (i - j >= w).double()
        per_query = (probs * far).sum(-1)  # (B, H, T)
        out[:, idx] = per_query[:, :, positions].mean(dim=(0, 2))
    return out


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_lost_mass_matches_dense_float64(kv_heads):
    gen = torch.Generator().manual_seed(kv_heads)
    b, h, t, d = 2, 4, 40, 8
    q = torch.randn(b, h, t, d, generator=gen) * 2
    k = torch.randn(b, kv_heads, t, d, generator=gen) * 2
    windows = [4, 8, 16, 40]
    got = lost_mass(q, k, windows, num_queries=12)
    positions = sample_query_positions(t, 12, start=4)
    expected = dense_lost_mass(q, k, windows, positions)
    assert got.shape == (h, 4)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # Larger windows lose less; the full window loses nothing.
    assert bool((got[:, 1:] <= got[:, :-1] + 1e-6).all())
    assert torch.allclose(got[:, -1], torch.zeros(h))


def test_lost_mass_of_a_hand_worked_head():
    # Zero queries: uniform attention over the i + 1 visible keys. Query i loses
    # (i + 1 - W) / (i + 1) at window W (the keys j <= i - W), and nothing when i < W.
    t, w = 10, 4
    q = torch.zeros(1, 1, t, 2)
    k = torch.randn(1, 1, t, 2)
    got = lost_mass(q, k, [w], num_queries=t, start=0)
    expected = sum(max(0, i + 1 - w) / (i + 1) for i in range(t)) / t
    assert float(got[0, 0]) == pytest.approx(expected, abs=1e-6)


def test_lost_mass_at_smallest_window_is_usage():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 32, 8, generator=gen) for _ in range(3))
    got = lost_mass(q, k, [8, 16, 32], num_queries=10)
    usage = attention_diagnostics(q, k, v, long_range=8, num_queries=10)[:, 2]
    torch.testing.assert_close(got[:, 0], usage, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("windows", [None, (8, 32, 16, 8)])
def test_shared_sampled_scores_give_the_same_diagnostics_and_lost_mass(windows):
    from aah.controller.features import sample_scores

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 32, 8, generator=gen)
    k, v = torch.randn(2, 2, 32, 8, generator=gen), torch.randn(2, 2, 32, 8, generator=gen)
    sampled = sample_scores(q, k, num_queries=10, start=8)
    shared_lost = lost_mass(q, k, [8, 16, 32], num_queries=10, sampled=sampled)
    shared_diag = attention_diagnostics(q, k, v, long_range=8, num_queries=10, windows=windows, sampled=sampled)
    assert torch.equal(shared_lost, lost_mass(q, k, [8, 16, 32], num_queries=10))
    assert torch.equal(shared_diag, attention_diagnostics(q, k, v, long_range=8, num_queries=10, windows=windows))
    with pytest.raises(ValueError, match="sampled"):
        lost_mass(q, k, [8, 16, 32], num_queries=12, sampled=sampled)  # other query positions
