"""The per-window KV cache: cached decoding must reproduce a full recompute exactly (fp32)."""

from __future__ import annotations

import pytest
import torch

from aah import GPT, ControllerConfig, GPTConfig
from aah.attention import RotaryEmbedding
from aah.cache import LayerKVCache, WindowKVCache, kv_capacities, slot_positions
from aah.generate import cache_memory_report, generate

VOCAB = 61
T_MAX = 64
CANDIDATES = (1, 2, 4, 8, 16, 64)
TOL = {"rtol": 1e-5, "atol": 5e-5}


def make_model(
    windows: list[tuple[int, ...]] | None,
    *,
    n_kv_heads: int = 4,
    positional: str = "rope",
    seed: int = 0,
) -> GPT:
    """2 layers, d_model 32, 4 heads; ``windows`` pinned per layer (None: plain full attention)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=VOCAB,
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        max_seq_len=T_MAX,
        positional=positional,
    )
    controller = None if windows is None else ControllerConfig(windows=CANDIDATES, scoring="none")
    model = GPT(cfg, controller)
    # Larger weights than the GPT-2 init make attention peaked, so every window really matters.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    if windows is not None:
        for ctrl, w in zip(model.controllers(), windows, strict=True):
            ctrl.pin_windows(w)
    return model.eval()


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def cached_logits(model: GPT, idx: torch.Tensor, chunks: list[int]) -> tuple[torch.Tensor, WindowKVCache]:
    """Logits of ``idx`` fed through a fresh cache in chunks of the given sizes."""
    assert sum(chunks) == idx.shape[1]
    cache = model.new_cache(idx.shape[0])
    parts, start = [], 0
    with torch.no_grad():
        for n in chunks:
            assert cache.length == start
            parts.append(model(idx[:, start : start + n], cache=cache)[0])
            start += n
    return torch.cat(parts, dim=1), cache


# name -> (windows per layer, KV heads, positional)
CASES = {
    "mha_local_rope": ([(2, 4, 8, 1), (4, 1, 2, 8)], 4, "rope"),
    "mha_local_learned": ([(2, 4, 8, 1), (4, 1, 2, 8)], 4, "learned"),
    "gqa_mixed_rope": ([(1, 8, 64, 2), (4, 2, 1, 16)], 2, "rope"),
    "gqa_mixed_learned": ([(1, 8, 64, 2), (4, 2, 1, 16)], 2, "learned"),
    "mqa_mixed_rope": ([(1, 2, 4, 8), (8, 16, 1, 2)], 1, "rope"),
    "windows_1": ([(1, 1, 1, 1), (1, 1, 1, 1)], 2, "rope"),
    "full_pinned": ([(64, 64, 64, 64), (64, 64, 64, 64)], 2, "rope"),
    "no_controller_learned": (None, 4, "learned"),
}

# prompt 10 > every local window: the ring buffers wrap many times.
SCHEDULES = {
    "prefill10_steps": [10] + [1] * 38,
    "prefill1_steps": [1] * 48,
    "prefill5_chunks": [5, 3, 1, 7, 1, 1, 12, 2, 16],
    "one_shot": [48],
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("case", list(CASES))
def test_cached_logits_equal_full_recompute(case: str, schedule: str) -> None:
    windows, kv, positional = CASES[case]
    model = make_model(windows, n_kv_heads=kv, positional=positional)
    idx = tokens(2, 48)
    with torch.no_grad():
        full, _ = model(idx)
    got, cache = cached_logits(model, idx, SCHEDULES[schedule])
    assert cache.length == 48
    torch.testing.assert_close(got, full, **TOL)


@pytest.mark.parametrize("case", ["gqa_mixed_rope", "mha_local_learned"])
def test_every_step_equals_forward_on_its_prefix(case: str) -> None:
    windows, kv, positional = CASES[case]
    model = make_model(windows, n_kv_heads=kv, positional=positional)
    idx = tokens(1, 30, seed=3)
    cache = model.new_cache(1)
    with torch.no_grad():
        model(idx[:, :6], cache=cache)
        for pos in range(6, 30):
            step, _ = model(idx[:, pos : pos + 1], cache=cache)
            prefix, _ = model(idx[:, : pos + 1])
            torch.testing.assert_close(step[:, 0], prefix[:, -1], **TOL)


def test_windows_change_the_logits() -> None:
    """Guards the equality tests: local and full windows really give different logits here."""
    local = make_model(CASES["gqa_mixed_rope"][0], n_kv_heads=2)
    full = make_model(None, n_kv_heads=2)
    idx = tokens(2, 48)
    with torch.no_grad():
        a, _ = local(idx)
        b, _ = full(idx)
    assert (a[:, 20:] - b[:, 20:]).abs().max() > 0.1
    # Same weights, so the first position (every window sees only itself) agrees.
    torch.testing.assert_close(a[:, 0], b[:, 0], **TOL)


def test_reset_reuses_the_cache() -> None:
    model = make_model(CASES["mha_local_rope"][0])
    idx = tokens(2, 20)
    first, cache = cached_logits(model, idx, [4] + [1] * 16)
    cache.reset()
    assert cache.length == 0
    with torch.no_grad():
        parts = [model(idx[:, :4], cache=cache)[0]]
        parts += [model(idx[:, i : i + 1], cache=cache)[0] for i in range(4, 20)]
    again = torch.cat(parts, dim=1)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


# ---------------------------------------------------------------------- generation
@pytest.mark.parametrize("case", ["mha_local_rope", "gqa_mixed_learned", "windows_1", "no_controller_learned"])
def test_greedy_generation_with_cache_equals_without(case: str) -> None:
    windows, kv, positional = CASES[case]
    model = make_model(windows, n_kv_heads=kv, positional=positional)
    prompt = tokens(2, 9, seed=5)
    with_cache = generate(model, prompt, 30)
    without = generate(model, prompt, 30, use_cache=False)
    assert with_cache.shape == (2, 39)
    assert torch.equal(with_cache[:, :9], prompt)
    assert torch.equal(with_cache, without)


def test_sampling_with_cache_equals_without_and_restores_mode() -> None:
    model = make_model(CASES["gqa_mixed_rope"][0], n_kv_heads=2).train()
    prompt = tokens(1, 6, seed=7)[0]
    a = generate(model, prompt, 20, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(3))
    b = generate(
        model, prompt, 20, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(3), use_cache=False
    )
    assert a.shape == (26,)
    assert torch.equal(a, b)
    assert model.training  # restored after the call


def test_generate_validates() -> None:
    model = make_model(CASES["mha_local_rope"][0])
    prompt = tokens(1, 10)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, prompt, T_MAX - 8)  # 10 + 55 fed positions > 64
    assert generate(model, prompt, T_MAX - 9).shape == (1, T_MAX + 1)  # 64 fed positions: fits
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, prompt, 2, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="integer"):
        generate(model, prompt.float(), 2)
    with pytest.raises(ValueError, match=r"\[0, 61\)"):
        generate(model, prompt + VOCAB, 2)
    assert torch.equal(generate(model, prompt, 0), prompt)


# ---------------------------------------------------------------------- memory
def test_memory_follows_the_windows() -> None:
    windows = [(1, 8, 64, 2), (4, 2, 1, 16)]
    model = make_model(windows, n_kv_heads=2)
    batch, head_dim, element = 3, 8, 4
    cache = model.new_cache(batch)
    # GQA: each KV head keeps the largest window of its two query heads.
    expected_caps = [[8, 64], [4, 16]]
    assert cache.capacities.tolist() == expected_caps
    expected = sum(c * head_dim * 2 * batch * element for caps in expected_caps for c in caps)
    assert cache.memory_bytes() == expected
    held = sum(b.keys.nbytes + b.values.nbytes for layer in cache.layers for b in layer._buckets)
    assert held == expected
    full = 2 * 2 * T_MAX * head_dim * 2 * batch * element
    assert cache.full_memory_bytes() == full
    assert cache.memory_bytes() < cache.full_memory_bytes()
    report = cache_memory_report(model, batch)
    assert report["memory_bytes"] == expected and report["full_memory_bytes"] == full
    assert report["capacities"] == expected_caps
    assert report["ratio"] == pytest.approx(expected / full)


def test_memory_of_full_windows_short_max_len_and_dtype() -> None:
    full_model = make_model(None, n_kv_heads=2)
    cache = full_model.new_cache(2)
    assert cache.memory_bytes() == cache.full_memory_bytes()
    local = make_model([(1, 8, 64, 2), (4, 2, 1, 16)], n_kv_heads=2)
    short = local.new_cache(1, max_len=10)  # capacities are capped by max_len
    assert short.capacities.tolist() == [[8, 10], [4, 10]]
    assert short.windows.tolist() == [[1, 8, 10, 2], [4, 2, 1, 10]]
    half = local.new_cache(1, max_len=10, dtype=torch.bfloat16)
    assert half.memory_bytes() * 2 == short.memory_bytes()
    assert cache_memory_report(local, 1, 10, dtype=torch.bfloat16)["memory_bytes"] == half.memory_bytes()


def test_capacity_rule_and_ring_positions() -> None:
    assert kv_capacities((1, 8, 64, 2), 2, 64) == (8, 64)
    assert kv_capacities((1, 8, 64, 2), 4, 32) == (1, 8, 32, 2)
    assert kv_capacities((1, 8, 64, 2), 1, 64) == (64,)
    with pytest.raises(ValueError, match="KV heads"):
        kv_capacities((1, 2, 3), 2, 64)
    # Simulate a ring of capacity 5 written 12 times.
    ring = [-1] * 5
    for n in range(13):
        assert [p if p >= 0 else -1 for p in slot_positions(n, 5).tolist()] == ring
        ring[n % 5] = n


def test_cached_contents_are_the_last_positions() -> None:
    model = make_model([(2, 8, 64, 2), (4, 2, 1, 16)], n_kv_heads=2)
    _, cache = cached_logits(model, tokens(1, 20), [7] + [1] * 13)
    layer = cache.layers[0]
    for kv, cap in enumerate(layer.capacities):
        keys, values, pos = layer.cached(kv)
        assert pos.tolist() == list(range(max(0, 20 - cap), 20))
        assert keys.shape == values.shape == (1, len(pos), 8)


# ---------------------------------------------------------------------- positions and errors
def test_rotary_offset_matches_slice_of_full_table() -> None:
    rope = RotaryEmbedding(8, 16)
    x = torch.randn(2, 3, 16, 8)
    torch.testing.assert_close(rope(x[:, :, 5:9], 5), rope(x)[:, :, 5:9])
    torch.testing.assert_close(rope(x), rope(x, offset=0))
    with pytest.raises(ValueError, match="rotary positions"):
        rope(x[:, :, :4], 13)


def test_decoding_past_max_seq_len_is_an_error() -> None:
    model = make_model(CASES["mha_local_rope"][0])
    cache = model.new_cache(1)
    idx = tokens(1, T_MAX + 1)
    with torch.no_grad():
        model(idx[:, :60], cache=cache)
        for i in range(60, T_MAX):
            model(idx[:, i : i + 1], cache=cache)
        assert cache.length == T_MAX
        with pytest.raises(ValueError, match="max_len 64"):
            model(idx[:, T_MAX:], cache=cache)
    assert cache.length == T_MAX  # nothing was written by the failed call
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        model.new_cache(1, max_len=T_MAX + 1)
    short = model.new_cache(1, max_len=8)
    with pytest.raises(ValueError, match="max_len 8"):
        model(idx[:, :9], cache=short)


def test_cache_misuse_is_an_error() -> None:
    model = make_model(CASES["mha_local_rope"][0])
    idx = tokens(2, 4)
    cache = model.new_cache(2)
    with torch.no_grad():
        with pytest.raises(ValueError, match="batch size 2"):
            model(idx[:1], cache=cache)
        with pytest.raises(ValueError, match="at least one new token"):
            model(idx[:, :0], cache=cache)
        with pytest.raises(TypeError, match="WindowKVCache"):
            model(idx, cache=cache.layers)
        model.train()
        with pytest.raises(ValueError, match="eval"):
            model(idx, cache=cache)
        model.eval()
        model.controllers()[1].pin_windows((64, 64, 64, 64))
        with pytest.raises(ValueError, match="layer 1: the windows changed"):
            model(idx, cache=cache)
        assert [layer.length for layer in cache.layers] == [0, 0]  # checked before any layer ran
        other = make_model([(1, 1, 1, 1)] * 2)
        three = WindowKVCache([LayerKVCache((4,) * 4, 4, 8, batch_size=2, max_len=64)] * 3)
        with pytest.raises(ValueError, match="3 layers"):
            other(idx, cache=three)
    with pytest.raises(ValueError, match="max_len"):
        LayerKVCache((4, 4), 2, 8, batch_size=1, max_len=0)
