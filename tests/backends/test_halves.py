"""Causal attention cut in halves (aah.backends.halves) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import aah
from aah.backends import halves
from aah.backends.halves import balanced_causal, causal_backward, causal_forward, cut_in_halves

from .test_banded_and_flex import _check, _qkv


@pytest.mark.parametrize("items, seq_len, threads, expected", [
    (1, 4096, 2, True),     # a lone head: one thread would idle
    (3, 4096, 2, True),     # odd count
    (5, 512, 2, True),
    (2, 4096, 2, False),    # already even
    (8, 4096, 2, False),
    (1, 4096, 1, False),    # one thread: nothing to balance
    (3, 4096, 4, True),
    (4, 4096, 4, False),
    (1, 1024, 2, False),    # too small to pay
    (1, 4098, 2, False),    # T not divisible by 4
])
def test_cut_rule(items, seq_len, threads, expected):
    assert cut_in_halves(items, seq_len, threads) is expected


@pytest.mark.parametrize("halves_on", [True, False])
@pytest.mark.parametrize("n, t, d", [(1, 8, 4), (3, 64, 8), (2, 100, 16)])
def test_causal_forward_and_backward_match_the_reference(ref_attention, n, t, d, halves_on):
    q, k, v = (x[0] for x in _qkv(1, n, n, t, d))
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    scale = d ** -0.5
    out, lse = causal_forward(q, k, v, scale, halves_on)
    ref = ref_attention(q[None], k[None], v[None], [t] * n)[0]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-12, rtol=1e-12)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    got = causal_backward(g, q.detach(), k.detach(), v.detach(), out, lse, scale, halves_on)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("b, h, h_kv", [(1, 1, 1), (1, 3, 1), (2, 1, 1)])
def test_balanced_causal_cut_in_halves_is_exact(ref_attention, monkeypatch, b, h, h_kv):
    monkeypatch.setattr(halves, "cut_in_halves", lambda items, seq_len, threads=None: True)
    q, k, v = _qkv(b, h, h_kv, 48, 8)
    out = balanced_causal(q, k, v, 8 ** -0.5)
    _check(out, q, k, v, [48] * h, ref_attention, atol=1e-10, rtol=1e-10)


def test_strips_with_every_causal_part_cut_in_halves_is_exact(ref_attention, monkeypatch):
    """Lone full heads and single-head prefixes cut in halves, as at batch 1 on a 2-thread CPU."""
    from aah.backends import strips

    always = lambda items, seq_len, threads=None: seq_len % 4 == 0  # noqa: E731
    monkeypatch.setattr(halves, "cut_in_halves", always)
    monkeypatch.setattr(strips, "cut_in_halves", always)
    cuts = []
    square = halves._square
    monkeypatch.setattr(halves, "_square", lambda q, k, v: cuts.append(q.shape) or square(q, k, v))
    windows = [16, 16, 16, 32, 64, 128]
    q, k, v = _qkv(1, 6, 6, 128, 8)
    out = aah.attend(q, k, v, windows, backend="strips")
    _check(out, q, k, v, windows, ref_attention, atol=1e-10, rtol=1e-10)
    # forward and backward of the prefixes of 16, 32, 64 and of the full head of 128
    assert sorted(shape[1] for shape in cuts) == [16, 16, 32, 32, 64, 64, 128, 128]
    q, k, v = _qkv(1, 6, 6, 128, 8)
    out = aah.attend(q, k, v, windows, backend="strips", sink_tokens=2)
    _check(out, q, k, v, windows, ref_attention, atol=1e-10, rtol=1e-10, sink_tokens=2)


def test_halves_in_bfloat16_match_the_float64_reference(ref_attention, monkeypatch):
    from .test_banded_and_flex import check_low_precision

    monkeypatch.setattr(halves, "cut_in_halves", lambda items, seq_len, threads=None: True)
    q, k, v = _qkv(1, 1, 1, 64, 16)
    check_low_precision(q, k, v, [64], "strips", torch.bfloat16, ref_attention)
