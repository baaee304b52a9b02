"""The aah.hf window cache: generation and chunked prefill equal recomputation under the same windows."""

from __future__ import annotations

import pytest
import torch

from aah.decode.rings import RingStore

transformers = pytest.importorskip("transformers")

from aah import hf  # noqa: E402

VOCAB = 97


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _greedy_by_recompute(model, prompt, steps):
    seq = prompt
    for _ in range(steps):
        nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


CASES = {
    # name: (heads, kv_heads, windows per layer, sinks, prompt length)
    "mha_mixed_short_prompt": (4, 4, [[3, 5, 2, 9], [4, 4, 6, 1]], 2, 4),
    "gqa_mixed_long_prompt": (4, 2, [[3, 5, 2, 9], [4, 4, 6, 1]], 2, 20),
    "gqa_kv_group_windows": (4, 2, [[5, 5, 7, 7], [3, 3, 3, 3]], 0, 20),
    "gqa_kv_group_with_sinks": (6, 2, [[4, 4, 4, 6, 6, 6], [9, 9, 9, 2, 2, 2]], 3, 17),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generate_with_window_cache_equals_recompute(case, llama):
    heads, kv_heads, windows, sinks, prompt_len = CASES[case]
    model = llama(heads, kv_heads)
    hf.patch(model, torch.tensor(windows), sink_tokens=sinks)
    prompt = _ids(2, prompt_len, seed=1)
    with torch.no_grad():
        cache = hf.new_cache(model)
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, past_key_values=cache, pad_token_id=0)
    assert torch.equal(out, _greedy_by_recompute(model, prompt, 12))
    # The cache keeps S + max(window of the group) entries per KV head, whatever the length.
    rep = heads // kv_heads
    slots = sum(sinks + max(row[g * rep:(g + 1) * rep]) for row in windows for g in range(kv_heads))
    assert hf.cache_memory_bytes(cache) == 2 * 2 * slots * 8 * 4


def test_generate_uses_the_window_cache_by_default(llama):
    model = llama()
    hf.patch(model, torch.tensor([[5, 5, 7, 7], [3, 3, 3, 3]]), sink_tokens=1)
    prompt = _ids(1, 30, seed=2)
    with torch.no_grad():
        result = model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                return_dict_in_generate=True)
    layers = result.past_key_values.layers
    assert all(isinstance(layer, hf.WindowCacheLayer) for layer in layers)
    assert torch.equal(result.sequences, _greedy_by_recompute(model, prompt, 3))


@pytest.mark.parametrize("chunks", [[7, 5, 1, 9], [1, 1, 2, 18], [12, 10]])
def test_chunked_prefill_through_the_cache_is_exact(chunks, llama):
    model = llama()
    hf.patch(model, torch.tensor([[3, 5, 2, 9], [4, 4, 6, 1]]), sink_tokens=2)
    ids = _ids(2, sum(chunks), seed=3)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        cache = hf.new_cache(model)
        got, start = [], 0
        for size in chunks:
            got.append(model(ids[:, start:start + size], past_key_values=cache, use_cache=True).logits)
            start += size
    torch.testing.assert_close(torch.cat(got, dim=1), expected, rtol=1e-5, atol=1e-5)


def test_left_padded_batch_generation_equals_each_prompt_alone(llama):
    model = llama()
    hf.patch(model, torch.tensor([[3, 5, 2, 9], [4, 4, 6, 1]]), sink_tokens=2)
    long_prompt, short_prompt = _ids(1, 14, seed=4), _ids(1, 9, seed=5)
    batch = torch.cat([long_prompt, torch.cat([torch.zeros(1, 5, dtype=torch.long), short_prompt], 1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0], _greedy_by_recompute(model, long_prompt, 6)[0])
    assert torch.equal(out[1, 5:], _greedy_by_recompute(model, short_prompt, 6)[0])


def test_a_cache_for_other_windows_is_refused(llama):
    model = llama()
    hf.patch(model, torch.tensor([[3] * 4, [4] * 4]), sink_tokens=0)
    cache = hf.new_cache(model)
    hf.patch(model, torch.tensor([[5] * 4, [4] * 4]), sink_tokens=0)
    with torch.no_grad(), pytest.raises(ValueError, match="other windows"):
        model(_ids(1, 6, seed=6), past_key_values=cache, use_cache=True)


def test_decode_with_full_rings_and_group_windows_builds_no_mask(monkeypatch, llama):
    model = llama()
    hf.patch(model, torch.tensor([[5, 5, 7, 7], [3, 3, 3, 3]]), sink_tokens=2)
    prompt = _ids(2, 12, seed=7)
    masked_calls = []
    original = RingStore.attend

    def spy(self, query, *args, **kwargs):
        masked_calls.append(query.shape[2])
        return original(self, query, *args, **kwargs)

    monkeypatch.setattr(RingStore, "attend", spy)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, _greedy_by_recompute(model, prompt, 6))
    # From position 12 on every ring is full and the sinks (0, 1) are outside every window.
    assert masked_calls == []


@pytest.mark.parametrize("route", ["compiled block", "compiled attention"])
@pytest.mark.parametrize("case", ["gqa_mixed_long_prompt", "gqa_kv_group_with_sinks", "mha_mixed_short_prompt"])
def test_one_token_steps_run_compiled_and_equal_recompute(compiled, monkeypatch, case, route, llama):
    """A decode step runs the whole decoder layer compiled (aah.hf.bridge.block_step), or, where the
    layer's modules must run (here a forward hook on the MLP), its attention compiled."""
    heads, kv_heads, windows, sinks, prompt_len = CASES[case]
    model = llama(heads, kv_heads)
    hf.patch(model, torch.tensor(windows), sink_tokens=sinks)
    if route == "compiled attention":
        for layer in model.model.layers:
            layer.mlp.register_forward_pre_hook(lambda module, args: None)
    calls = []
    kernel = compiled.ring_decode

    def counted(*args, **kwargs):
        calls.append(kwargs["sinks"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(compiled, "ring_decode", counted)
    ids = _ids(2, prompt_len + 14, seed=8)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        cache = hf.new_cache(model)
        got = [model(ids[:, :prompt_len], past_key_values=cache, use_cache=True).logits]
        for t in range(prompt_len, ids.shape[1]):  # rings filling, then wrapping past every window
            got.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
            assert [layer.route for layer in cache.layers] == [route] * len(cache.layers)
    torch.testing.assert_close(torch.cat(got, dim=1), expected, rtol=1e-5, atol=1e-5)
    # The attention alone: one kernel call per layer and step, whatever the layer's groups.
    assert calls == ([sinks] * (14 * len(cache.layers)) if route == "compiled attention" else [])
