"""Kept keys (aah.hf.bridge.kept_keys): a windowed prefill whose last tokens read everything, and far keys
kept for decoding, against a float64 reference that applies the rule of the module docstring."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aah import hf  # noqa: E402
from aah.decode import ring_decode  # noqa: E402
from aah.hf.bridge.attention import AAH_IMPLEMENTATION  # noqa: E402
from aah.hf.bridge.kept_keys import (  # noqa: E402
    KeptKeys,
    choose_kept,
    compiled_rolling_prefill,
    kept_coverage,
    rolling_coverage_pairs,
    rolling_kept_attention,
    rolling_prefill,
    tail_coverage_pairs,
)
from aah.hf.bridge.spec import layer_specs  # noqa: E402
from aah.windows import causal_coverage  # noqa: E402

VOCAB = 97
REFERENCE = "kept_keys_reference"


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


class Reference:
    """Whole-sequence attention with the kept-keys rule written out: rows before the prompt's
    tail see their window and the first ``sinks`` positions; the tail's rows see every earlier
    key; each KV head keeps the ``count`` positions (before the prompt's end less the largest
    window of its query heads, not sinks) with the most tail attention, summed over tail rows
    and its query heads, then maximised over the ``pool // 2`` positions on either side; later
    rows see their window, the sinks and those positions.

    With ``prefill`` > 0 (rolling kept keys), the prompt's rows from ``block`` on also see, block
    by block, the ``prefill`` positions per KV head (not sinks, at most the block's first row
    less the group's largest window) that the previous block's last ``tail`` rows attend to
    most under causal attention, scored the same way."""

    def __init__(self, windows, sinks: int, prompt_len: int, tail: int, count: int, pool: int,
                 prefill: int = 0, block: int = 512):
        self.windows, self.sinks, self.prompt_len, self.tail, self.count = windows, sinks, prompt_len, tail, count
        self.pool, self.prefill, self.block = pool, prefill, block
        self.rolled: dict[int, list[list[list[int]]]] = {}  # layer -> block -> KV head -> positions
        self.kept: dict[int, list[list[int]]] = {}
        self.eligible: dict[int, list[int]] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        heads, kv_heads, length = query.shape[1], key.shape[1], query.shape[2]
        rep = heads // kv_heads
        q = query[0].double()
        k = key[0].double().repeat_interleave(rep, 0)
        v = value[0].double().repeat_interleave(rep, 0)
        scores = q @ k.transpose(-1, -2) * scaling
        pos = torch.arange(length)
        qpos, kpos = pos[:, None], pos[None, :]
        causal = kpos <= qpos
        windows = self.windows[module.layer_idx]
        end, first_tail = self.prompt_len, self.prompt_len - self.tail
        kept_here = []
        self.eligible[module.layer_idx] = []
        allowed = torch.zeros(heads, length, length, dtype=torch.bool)
        tail_probs = torch.softmax(scores[:, first_tail:end, :end].masked_fill(~causal[first_tail:end, :end], -torch.inf), -1)
        def best(probs, group, before, reach, count):
            """The ``count`` positions < ``before`` (past the sinks, at most ``before - reach``)
            with the most pooled attention in ``probs`` (heads, rows, keys), and how many could be."""
            summed = probs[list(group)].sum((0, 1))
            summed[: self.sinks] = 0.0  # the sinks lend no score to their neighbours
            r = self.pool // 2
            score = [float(summed[max(0, p - r):p + r + 1].max()) for p in range(before)]
            eligible = [p for p in range(before) if p <= before - reach and p >= self.sinks]
            return sorted(sorted(eligible, key=lambda p: -score[p])[:count]), len(eligible)

        rolled = []
        for a in range(self.block, end, self.block) if self.prefill else ():
            rows = min(self.tail, a)
            probs = torch.softmax(scores[:, a - rows:a, :a].masked_fill(~causal[a - rows:a, :a], -torch.inf), -1)
            rolled.append([best(probs, range(j * rep, (j + 1) * rep), a,
                                max(windows[j * rep:(j + 1) * rep]), self.prefill)[0] for j in range(kv_heads)])
        self.rolled[module.layer_idx] = rolled
        for j in range(kv_heads):
            group = range(j * rep, (j + 1) * rep)
            # A later query at position >= end reads keys after q - window: position end - reach
            # is the last one no window of the group reads again.
            reach = max(windows[h] for h in group)
            ranked, eligible = best(tail_probs, group, end, reach, self.count)
            kept_here.append(ranked)
            self.eligible[module.layer_idx].append(eligible)
            for h in group:
                rule = causal & ((qpos - kpos < windows[h]) | (kpos < self.sinks))
                for i, chosen in enumerate(rolled):
                    a = (i + 1) * self.block
                    rule[a:min(a + self.block, end), chosen[j]] = True
                rule[first_tail:end] = causal[first_tail:end]
                later = rule[end:]
                later[:, ranked] = True
                allowed[h] = rule
        self.kept[module.layer_idx] = kept_here
        probs = torch.softmax(scores.masked_fill(~allowed, -torch.inf), -1)
        return (probs @ v).to(query.dtype)[None].transpose(1, 2).contiguous(), None


def _greedy(model, cache, prompt: torch.Tensor, new_tokens: int):
    """The prompt's logits through ``cache``, then ``new_tokens`` greedy steps: (prompt logits,
    the steps' logits, the whole sequence)."""
    logits = model(prompt, past_key_values=cache, use_cache=True).logits[0]
    tokens, steps = [prompt], [logits[-1]]
    for _ in range(new_tokens):
        nxt = steps[-1].argmax()[None, None]
        tokens.append(nxt)
        steps.append(model(nxt, past_key_values=cache, use_cache=True).logits[0, -1])
    return logits, torch.stack(steps[1:]), torch.cat(tokens, dim=1)


def _reference_logits(model, reference: Reference, seq: torch.Tensor) -> torch.Tensor:
    """``seq``'s logits with every layer attending through ``reference``, without a cache."""
    transformers.AttentionInterface.register(REFERENCE, reference)
    transformers.masking_utils.AttentionMaskInterface.register(REFERENCE, transformers.masking_utils.sdpa_mask)
    model.set_attn_implementation(REFERENCE)
    try:
        return model(seq, use_cache=False).logits[0]
    finally:
        model.set_attn_implementation(AAH_IMPLEMENTATION)


CASES = {
    # name: (heads, kv heads, windows per layer, sinks, prompt length, tail, kept per KV head, pool)
    "gqa_kv_group_with_sinks": (4, 2, [[3, 3, 5, 5], [4, 4, 2, 2]], 2, 24, 4, 3, 1),
    "gqa_pooled_neighbours": (4, 2, [[3, 3, 5, 5], [4, 4, 2, 2]], 2, 30, 4, 5, 3),
    "mha_mixed_no_sinks": (4, 4, [[3, 5, 2, 6], [2, 2, 4, 3]], 0, 20, 3, 2, 5),
    "more_kept_than_far_keys": (4, 2, [[6, 6, 9, 9], [8, 8, 8, 8]], 1, 14, 2, 8, 1),
}


@torch.no_grad()
@pytest.mark.parametrize("route", ["compiled block", "compiled attention", "masked"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kept_keys_decoding_equals_the_reference(case, route, llama, monkeypatch):
    """Every decode route: the compiled steps (the whole layer, or the attention alone where the
    layer's modules must run: here a hook on the MLP) read the kept keys beside the rings in one
    softmax, the masked one reads them as more columns."""
    if route.startswith("compiled") and ring_decode.unavailable_reason() is not None:
        pytest.skip(f"compiled decode step unavailable: {ring_decode.unavailable_reason()}")
    if route == "masked":
        monkeypatch.setenv("AAH_RING_KERNEL", "0")  # the route decision then finds no compiled step
    heads, kv_heads, windows, sinks, prompt_len, tail, count, pool = CASES[case]
    model = llama(heads, kv_heads)
    hf.patch(model, torch.tensor(windows), sink_tokens=sinks)
    if route == "compiled attention":
        for layer in model.model.layers:
            layer.mlp.register_forward_pre_hook(lambda module, args: None)
    prompt = _ids(prompt_len, seed=3)
    cache = hf.new_cache(model, kept_keys=KeptKeys(tail, count, pool))
    plain_logits = model(prompt, past_key_values=hf.new_cache(model), use_cache=True).logits[0, -1]
    logits, steps, seq = _greedy(model, cache, prompt, 6)
    assert hf.cache_route(cache) == route

    reference = Reference(windows, sinks, prompt_len, tail, count, pool)
    expected = _reference_logits(model, reference, seq)
    torch.testing.assert_close(logits, expected[:prompt_len], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(steps, expected[prompt_len:], atol=2e-5, rtol=1e-4)
    for layer, cache_layer in enumerate(cache.layers):
        positions = cache_layer.kept.held()[0]
        assert positions == reference.kept[layer]
        assert [len(row) for row in positions] == [min(count, n) for n in reference.eligible[layer]]
        assert any(positions)
    # The tail changes what the prompt's last token predicts: the rule is not vacuous here.
    assert not torch.allclose(logits[-1], plain_logits, atol=1e-4)


ROLLING = {
    # name: (heads, kv heads, windows per layer, sinks, prompt length, tail, kept, pool, prefill keys, block)
    "gqa_blocks_of_6": (4, 2, [[3, 3, 5, 5], [4, 4, 2, 2]], 2, 30, 4, 3, 1, 2, 6),
    "gqa_pooled_uneven_blocks": (4, 2, [[3, 3, 5, 5], [4, 4, 2, 2]], 1, 29, 3, 3, 3, 3, 7),
    "mha_one_long_head": (4, 4, [[3, 30, 2, 6], [2, 2, 4, 3]], 0, 26, 2, 2, 1, 4, 5),
}


@torch.no_grad()
@pytest.mark.parametrize("case", sorted(ROLLING))
def test_rolling_kept_keys_equal_the_reference(case, llama, monkeypatch):
    """The prompt read in blocks that see the far keys the previous block's last rows read most,
    then decoding with the kept keys: every logit against the float64 rule."""
    import aah.hf.bridge.cache as cache_module

    heads, kv_heads, windows, sinks, prompt_len, tail, count, pool, prefill, block = ROLLING[case]
    model = llama(heads, kv_heads)
    # An unpadded prompt takes the compiled route that reads each window once.
    routes = []
    monkeypatch.setattr(cache_module, "compiled_rolling_prefill",
                        lambda *args: routes.append(args[0].shape) or compiled_rolling_prefill(*args))
    hf.patch(model, torch.tensor(windows), sink_tokens=sinks)
    prompt = _ids(prompt_len, seed=11)
    spec = KeptKeys(tail, count, pool, prefill_keys=prefill, prefill_block=block)
    without = model(prompt, past_key_values=hf.new_cache(model, kept_keys=KeptKeys(tail, count, pool)),
                    use_cache=True).logits[0]
    logits, steps, seq = _greedy(model, hf.new_cache(model, kept_keys=spec), prompt, 4)

    reference = Reference(windows, sinks, prompt_len, tail, count, pool, prefill, block)
    expected = _reference_logits(model, reference, seq)
    torch.testing.assert_close(logits, expected[:prompt_len], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(steps, expected[prompt_len:], atol=2e-5, rtol=1e-4)
    assert any(chosen for layer in reference.rolled.values() for block_keys in layer for chosen in block_keys)
    assert len(routes) == len(windows)  # one prompt call per layer (the "without" run has no rolling keys)
    # The blocks' kept keys change what the prompt's rows before the tail predict.
    assert not torch.allclose(logits[block:prompt_len - tail], without[block:prompt_len - tail], atol=1e-4)


def test_rolling_kept_keys_leave_hidden_rows_as_they_were():
    """A position the mask hides is read by no row; its own row, which may see no key at all
    (window 1, no sink before it), keeps the windowed pass's output instead of a NaN."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 12, 4), torch.randn(1, 1, 12, 4), torch.randn(1, 1, 12, 4)
    windowed = torch.randn(1, 2, 12, 4)
    real = torch.ones(1, 12, dtype=torch.bool)
    real[0, 7] = False
    out = rolling_kept_attention(q, k, v, windowed, [1, 2], 0, real, KeptKeys(2, 3, 1, prefill_keys=2, prefill_block=4),
                                 0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, :, 7], windowed[0, :, 7])
    assert not torch.allclose(out[0, :, 4:7], windowed[0, :, 4:7])  # the block's other rows were recomputed
    # Row 8 (head 1, window 2) reads its own key and the kept keys, never the hidden key 7.
    changed = v.clone()
    changed[0, 0, 7] += 100.0
    again = rolling_kept_attention(q, k, changed, windowed, [1, 2], 0, real,
                                   KeptKeys(2, 3, 1, prefill_keys=2, prefill_block=4), 0.5)
    torch.testing.assert_close(again[0, :, 8:], out[0, :, 8:])


def test_rolling_coverage_by_hand(llama):
    # One KV head of 2 query heads with windows 3 and 4, 1 sink, T = 20, tail 2, blocks of 6, 2 keys:
    # blocks start at 6 and 12 (rows 18, 19 are the tail's); far keys at a block start a are
    # positions 1 .. a - 4: 2 at a = 6 (rows 6-11), 8 (so 2) at a = 12 (rows 12-17).
    spec = KeptKeys(2, 5, prefill_keys=2, prefill_block=6)
    assert rolling_coverage_pairs([3, 4], 1, 20, spec, 1) == 2 * (6 * 2 + 6 * 2)
    assert rolling_coverage_pairs([3, 4], 1, 20, KeptKeys(2, 5, prefill_keys=1, prefill_block=6), 1) == 2 * 12
    assert rolling_coverage_pairs([3, 19], 1, 20, spec, 1) == 0  # window and sink reach every key
    model = llama(4, 2)
    hf.patch(model, torch.tensor([[3, 3, 5, 5], [4, 4, 2, 2]]), sink_tokens=1)
    _, plain = kept_coverage(layer_specs(model), 32, KeptKeys(4, 3), 2)
    _, rolling = kept_coverage(layer_specs(model), 32, KeptKeys(4, 3, prefill_keys=2, prefill_block=8), 2)
    pairs = sum(rolling_coverage_pairs(w, 1, 32, KeptKeys(4, 3, prefill_keys=2, prefill_block=8), 2)
                for w in ([3, 3, 5, 5], [4, 4, 2, 2]))
    assert pairs > 0 and rolling == pytest.approx(plain + pairs / (32 * 33 / 2 * 8))


@torch.no_grad()
def test_kept_keys_add_their_bytes(llama):
    model = llama(4, 2)
    hf.patch(model, torch.tensor([[3, 3, 5, 5], [4, 4, 2, 2]]), sink_tokens=2)
    prompt = _ids(24, seed=4)
    kept, plain = hf.new_cache(model, kept_keys=KeptKeys(4, 3)), hf.new_cache(model)
    for cache in (kept, plain):
        model(prompt, past_key_values=cache, use_cache=True)
        model(prompt[:, -1:], past_key_values=cache, use_cache=True)
    # 2 layers x (keys + values) x 2 KV heads x 3 kept x head_dim 8 x 4 bytes
    assert hf.cache_memory_bytes(kept) - hf.cache_memory_bytes(plain) == 2 * 2 * 2 * 3 * 8 * 4


@torch.no_grad()
def test_a_head_holds_only_the_far_keys_that_exist(llama):
    """A KV head whose window and sinks reach the whole prompt holds no kept slots, the others
    keys_per_head: the bytes follow kept_coverage's count."""
    model = llama(4, 2)
    windows = torch.tensor([[3, 3, 5, 5], [4, 4, 23, 23]])
    hf.patch(model, windows, sink_tokens=2)
    prompt = _ids(24, seed=4)
    kept, plain = hf.new_cache(model, kept_keys=KeptKeys(4, 3)), hf.new_cache(model)
    for cache in (kept, plain):
        model(prompt, past_key_values=cache, use_cache=True)
    # Far keys (positions 2 .. 24 - C: past the sinks, before every later window): 20, 18, 19, none.
    assert [len(h) for layer in kept.layers for h in layer.kept.held()[0]] == [3, 3, 3, 0]
    assert hf.cache_memory_bytes(kept) - hf.cache_memory_bytes(plain) == 2 * 9 * 8 * 4
    acr, _ = kept_coverage(layer_specs(model), 24, KeptKeys(4, 3), 2)
    plain_acr = sum(min(int(w) + 2, 24) for w in windows.flatten()) / (8 * 24)
    assert acr == pytest.approx(plain_acr + 2 * 9 / (8 * 24))  # each kept key is read by 2 query heads


@torch.no_grad()
@pytest.mark.parametrize("spec, long_len, short_len", [
    (KeptKeys(3, 2), 18, 13),
    (KeptKeys(3, 2, prefill_keys=2, prefill_block=5), 22, 17),  # rolling: blocks count from a row's first token
], ids=["kept", "rolling"])
def test_left_padded_rows_keep_what_each_prompt_keeps_alone(spec, long_len, short_len, llama):
    model = llama(4, 2)
    hf.patch(model, torch.tensor([[3, 3, 5, 5], [4, 4, 2, 2]]), sink_tokens=2)
    long_prompt, short_prompt = _ids(long_len, seed=5), _ids(short_len, seed=6)
    batch = torch.cat([long_prompt, torch.cat([torch.zeros(1, 5, dtype=torch.long), short_prompt], 1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    out = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                         past_key_values=hf.new_cache(model, kept_keys=spec))
    for row, prompt, pad in ((0, long_prompt, 0), (1, short_prompt, 5)):
        alone = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
                               pad_token_id=0, past_key_values=hf.new_cache(model, kept_keys=spec))
        assert torch.equal(out[row, pad:], alone[0])


@torch.no_grad()
def test_a_padded_batch_takes_the_compiled_rolling_route_one_row_at_a_time(llama, monkeypatch):
    """Left padding: each row's tokens go through the compiled pass alone (no masked recompute)."""
    import aah.hf.bridge.cache as cache_module

    model = llama(4, 2)
    hf.patch(model, torch.tensor([[3, 3, 5, 5], [4, 4, 2, 2]]), sink_tokens=2)
    batch = torch.cat([_ids(22, seed=5), torch.cat([torch.zeros(1, 5, dtype=torch.long), _ids(17, seed=6)], 1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    calls = []
    monkeypatch.setattr(cache_module, "compiled_rolling_prefill",
                        lambda *args: calls.append(tuple(args[0].shape)) or compiled_rolling_prefill(*args))
    monkeypatch.setattr(cache_module, "rolling_kept_attention", lambda *args: pytest.fail("masked route taken"))
    model(batch, attention_mask=mask, use_cache=True,
          past_key_values=hf.new_cache(model, kept_keys=KeptKeys(3, 2, prefill_keys=2, prefill_block=5)))
    assert calls == [(1, 4, 22, 8), (1, 4, 17, 8)] * 2  # two layers, two rows each (head dim 8)


@pytest.mark.parametrize("empty", [(), ((0, 1, 2),), ((1, 0, 0), (1, 0, 3), (1, 0, 1), (1, 0, 2))],
                         ids=["every_key_read", "one_key_unread", "a_head_with_no_key"])
def test_kept_part_is_the_softmax_share_of_the_kept_keys(empty):
    """The kept keys' part (fused kernel when every key is read, masked otherwise) against float64:
    output and log-sum-exp of the rows' scores over the valid keys only."""
    from aah.hf.bridge.kept_keys import kept_part

    torch.manual_seed(3)
    rows, keys, values = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    valid = torch.ones(2, 3, 4, dtype=torch.bool)
    for where in empty:
        valid[where] = False
    out, lse = kept_part(rows, keys, values, valid)
    scores = (rows.double() @ keys.double().transpose(-1, -2)).masked_fill(~valid[:, :, None], float("-inf"))
    expected_lse = torch.logsumexp(scores, -1)
    expected = (torch.softmax(scores, -1).nan_to_num(0.0) @ values.double()).float()
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("windows, sinks, length, kept", [
    ((3, 3, 20, 20, 2, 5), 1, 20, KeptKeys(3, 4, 3, prefill_keys=2, prefill_block=6)),
    ((4, 4, 7, 7, 2, 2), 2, 29, KeptKeys(4, 3, 1, prefill_keys=3, prefill_block=7)),
    ((5, 2, 3, 9, 4, 6), 0, 33, KeptKeys(2, 3, 5, prefill_keys=5, prefill_block=4)),
], ids=["one_long_group", "uneven_blocks", "no_sinks_pooled"])
def test_compiled_rolling_prefill_equals_the_recompute(windows, sinks, length, kept):
    """One strip pass joined by log-sum-exp with each block's kept keys equals the windowed pass
    followed by the rolling recompute, which the model-level test above holds to the reference."""
    from aah.hf.bridge.attention import attend_without_cache
    from aah.hf.bridge.spec import LayerWindows

    torch.manual_seed(7)
    q, k, v = torch.randn(2, 6, length, 8), torch.randn(2, 3, length, 8), torch.randn(2, 3, length, 8)
    whole = attend_without_cache(q, k, v, None, 0.35, LayerWindows.build(windows, sinks, "auto", None))
    expected = rolling_kept_attention(q, k, v, whole, windows, sinks, torch.ones(2, length, dtype=torch.bool),
                                      kept, 0.35)
    out = compiled_rolling_prefill(q, k, v, windows, sinks, kept, 0.35)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, whole, atol=1e-3)  # the kept keys changed the later blocks


@torch.no_grad()
def test_a_crop_back_into_the_prompt_drops_the_keys_windows_reach_again(llama):
    model = llama(4, 2)
    hf.patch(model, torch.tensor([[3, 3, 5, 5], [4, 4, 2, 2]]), sink_tokens=1)
    cache = hf.new_cache(model, crop_limit=6, kept_keys=KeptKeys(3, 30))
    model(_ids(24, seed=8), past_key_values=cache, use_cache=True)
    before = [layer.kept.held()[0] for layer in cache.layers]
    cache.crop(-4)  # back to 20 positions: later windows of up to 5 reach position 16 again
    for layer, held in zip(cache.layers, before):
        capacity = [max(layer.windows[:2]), max(layer.windows[2:])]
        # Every key a window no longer reaches is still there; the others are gone.
        expected = [[p for p in positions if p <= 20 - c] for positions, c in zip(held, capacity)]
        assert layer.kept.held()[0] == expected
        assert sum(map(len, expected)) < sum(map(len, held))


@torch.no_grad()
def test_a_layer_with_its_own_sliding_window_keeps_no_keys():
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=8,
        attn_implementation="sdpa", eos_token_id=None, bos_token_id=None,
    )
    model = transformers.MistralForCausalLM(config).eval()
    hf.patch(model, torch.tensor([[3, 3, 5, 5], [4, 4, 2, 2]]), sink_tokens=0)
    cache, plain = hf.new_cache(model, kept_keys=KeptKeys(3, 4)), hf.new_cache(model)
    prompt = _ids(24, seed=9)
    model(prompt, past_key_values=cache, use_cache=True)
    model(prompt, past_key_values=plain, use_cache=True)
    assert all(layer.kept is None for layer in cache.layers)
    assert hf.cache_memory_bytes(cache) == hf.cache_memory_bytes(plain)
    acr, _ = kept_coverage(layer_specs(model), 24, KeptKeys(3, 4), 2)
    windows = [3, 3, 5, 5, 4, 4, 2, 2]
    assert acr == pytest.approx(sum(windows) / (8 * 24))


def test_choose_kept_ranks_by_summed_attention_and_leaves_empty_slots():
    # One row, 2 query heads reading 1 KV head, 2 tail rows, 6 keys.
    probs = torch.zeros(1, 2, 2, 6)
    probs[0, 0, 0] = torch.tensor([0.1, 0.5, 0.0, 0.2, 0.2, 0.0])
    probs[0, 1, 1] = torch.tensor([0.0, 0.0, 0.6, 0.1, 0.3, 0.0])
    eligible = torch.tensor([[[True, True, False, True, True, False]]])
    positions, valid = choose_kept(probs, 1, eligible, 3)
    # Summed scores: 0.1, 0.5, (0.6 not eligible), 0.3, 0.5, 0: the three best eligible, in order.
    assert positions.tolist() == [[[1, 3, 4]]] and valid.all()
    positions, valid = choose_kept(probs, 1, eligible, 5)
    assert positions.tolist() == [[[0, 1, 3, 4, -1]]] and valid.tolist() == [[[True] * 4 + [False]]]
    # Pooled over 3: 0.5, 0.6, 0.6, 0.6, 0.5, 0.5; position 3 takes its neighbour 2's 0.6.
    positions, _ = choose_kept(probs, 1, eligible, 2, pool_width=3)
    assert positions.tolist() == [[[1, 3]]]
    # Positions 0 and 4 tie at 0.5: the earlier one is kept.
    positions, _ = choose_kept(probs, 1, eligible, 3, pool_width=3)
    assert positions.tolist() == [[[0, 1, 3]]]


def test_tail_pairs_and_coverage_by_hand(llama):
    # Window 4, 1 sink, T = 10, tail 2: rows 8 and 9 would see 4 + 1 keys; they see 9 and 10.
    assert tail_coverage_pairs([4], 1, 10, 2) == (9 - 5) + (10 - 5)
    # A layer's own sliding window of 6 caps what the tail rows read: 6 each, 1 more than 5.
    assert tail_coverage_pairs([4], 0, 10, 2, layer_window=6) == 2 * (6 - 4)
    model = llama(4, 2)
    hf.patch(model, torch.tensor([[3, 3, 5, 5], [4, 4, 2, 2]]), sink_tokens=1)
    acr, coverage = kept_coverage(layer_specs(model), 32, KeptKeys(4, 3), 2)
    windows = [3, 3, 5, 5, 4, 4, 2, 2]
    base = causal_coverage(torch.tensor(windows), 32, sink_tokens=1)
    extra = sum(tail_coverage_pairs([w], 1, 32, 4) for w in windows) / (32 * 33 / 2 * 8)
    assert coverage == pytest.approx(base + extra)
    assert acr == pytest.approx(sum(w + 1 + 3 for w in windows) / (8 * 32))
    # Few far keys: at T = 8 a group with windows 5 has positions 1..3 (8 - 5, past the sink) to keep.
    acr, _ = kept_coverage(layer_specs(model), 8, KeptKeys(2, 6), 2)
    held = [3 + 1 + 4, 3 + 1 + 4, 5 + 1 + 3, 5 + 1 + 3, 4 + 1 + 4, 4 + 1 + 4, 2 + 1 + 6, 2 + 1 + 6]
    assert acr == pytest.approx(sum(min(h, 8) for h in held) / (8 * 8))


@pytest.mark.parametrize("bad, name", [
    ({"tail_tokens": 0, "keys_per_head": 3}, "tail_tokens"),
    ({"tail_tokens": 2, "keys_per_head": -1}, "keys_per_head"),
    ({"tail_tokens": 2, "keys_per_head": 3, "pool_width": 4}, "pool_width must be odd"),
    ({"tail_tokens": 2, "keys_per_head": 3, "prefill_keys": -1}, "prefill_keys must be an integer >= 0"),
    ({"tail_tokens": 2, "keys_per_head": 3, "prefill_block": 0}, "prefill_block must be an integer >= 1"),
])
def test_kept_keys_refuse_bad_sizes(bad, name):
    with pytest.raises(ValueError, match=name):
        KeptKeys(**bad)


def test_rolling_prefill_reads_later_blocks_of_short_groups_only_once():
    """The unpadded route equals the windowed pass followed by the rolling recompute, and its
    windowed pass reads the groups that leave keys behind over the first block's rows only."""
    from aah.hf.bridge.attention import attend_without_cache
    from aah.hf.bridge.spec import LayerWindows

    torch.manual_seed(3)
    windows, sinks, length = (3, 3, 20, 20, 2, 5), 1, 20  # KV group 1 reaches every key
    q, k, v = torch.randn(2, 6, length, 8), torch.randn(2, 3, length, 8), torch.randn(2, 3, length, 8)
    spec = KeptKeys(3, 4, 3, prefill_keys=2, prefill_block=6)
    calls = []

    def windowed(q_, k_, v_, w):
        calls.append((q_.shape[1], q_.shape[2], w))
        return attend_without_cache(q_, k_, v_, None, 0.35, LayerWindows.build(w, sinks, "auto", None))

    out = rolling_prefill(q, k, v, windows, sinks, spec, 0.35, windowed)
    assert calls == [(2, length, (20, 20)), (4, 6, (3, 3, 2, 5))]
    whole = windowed(q, k, v, windows)
    expected = rolling_kept_attention(q, k, v, whole, windows, sinks, torch.ones(2, length, dtype=torch.bool),
                                      spec, 0.35)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, whole, atol=1e-3)  # the kept keys changed the later blocks


@torch.no_grad()
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_generate_with_kept_keys_equals_the_reference(mode, llama):
    """``generate`` through a kept-keys cache: every token and score follows the documented rule
    (kept keys chosen by the prompt's last rows) written out in float32 by the reference."""
    heads, kv_heads, windows, sinks, prompt_len, tail, count, pool = CASES["gqa_kv_group_with_sinks"]
    model = llama(heads, kv_heads)
    hf.patch(model, torch.tensor(windows), sink_tokens=sinks)
    prompt = _ids(prompt_len, seed=5)
    options = {"greedy": {"do_sample": False}, "sampled": {"do_sample": True, "top_k": 0}}[mode]
    torch.manual_seed(7)
    out = model.generate(prompt, max_new_tokens=5, past_key_values=hf.new_cache(model, kept_keys=KeptKeys(tail, count, pool)),
                         output_logits=True, return_dict_in_generate=True, **options)
    reference = Reference(windows, sinks, prompt_len, tail, count, pool)
    expected = _reference_logits(model, reference, out.sequences)
    torch.testing.assert_close(torch.cat(out.logits), expected[prompt_len - 1:-1], atol=2e-5, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
def test_assisted_decoding_and_prompt_lookup_with_kept_keys_are_refused(mode, llama):
    """Their first call holds draft tokens, which would choose the kept keys: a clear error, not
    silently other tokens than greedy decoding."""
    heads, kv_heads, windows, sinks, prompt_len, tail, count, pool = CASES["gqa_kv_group_with_sinks"]
    model = llama(heads, kv_heads)
    hf.patch(model, torch.tensor(windows), sink_tokens=sinks)
    extra = {"assistant": {"assistant_model": llama(heads, kv_heads)}, "prompt_lookup": {"prompt_lookup_num_tokens": 3}}[mode]
    cache = hf.new_cache(model, kept_keys=KeptKeys(tail, count, pool))
    with pytest.raises(ValueError, match="refused with kept keys"):
        model.generate(_ids(prompt_len, seed=5), max_new_tokens=4, do_sample=False, past_key_values=cache, **extra)
    # Without kept keys the same modes run and keep greedy decoding's tokens.
    greedy = model.generate(_ids(prompt_len, seed=5), max_new_tokens=4, do_sample=False)
    assisted = model.generate(_ids(prompt_len, seed=5), max_new_tokens=4, do_sample=False, **extra)
    assert torch.equal(assisted, greedy)


@torch.no_grad()
@pytest.mark.parametrize("spec", [KeptKeys(4, 3, 3), KeptKeys(3, 3, 1, prefill_keys=2, prefill_block=6)])
def test_a_model_patched_with_kept_keys_generates_with_them(spec, llama):
    """``patch(..., kept_keys=)``: ``generate`` without a cache equals ``generate`` with
    ``new_cache(model, kept_keys=)``, tokens and scores, greedy and sampled."""
    import copy

    heads, kv_heads, windows, sinks, prompt_len, *_ = CASES["gqa_kv_group_with_sinks"]
    model = llama(heads, kv_heads)
    hf.patch(model, torch.tensor(windows), sink_tokens=sinks, kept_keys=spec)
    assert hf.patched_kept_keys(model) == spec and hf.patched_kept_keys(copy.deepcopy(model)) == spec
    prompt = _ids(prompt_len, seed=5)
    def scores(cache, **options):
        torch.manual_seed(7)
        out = model.generate(prompt, max_new_tokens=5, past_key_values=cache, output_scores=True,
                             return_dict_in_generate=True, **options)
        return out.sequences, torch.stack(out.scores)

    for options in ({"do_sample": False}, {"do_sample": True, "top_k": 0}):
        tokens, logits = scores(None, **options)
        expected_tokens, expected = scores(hf.new_cache(model, kept_keys=spec), **options)
        assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    # The kept keys change what is generated: the default is not ignored.
    assert not torch.allclose(scores(hf.new_cache(model), do_sample=False)[1], scores(None, do_sample=False)[1])
    hf.patch(model, torch.tensor(windows), sink_tokens=sinks)  # patching again replaces the kept keys
    assert hf.patched_kept_keys(model) is None
    hf.patch(model, torch.tensor(windows), sink_tokens=sinks, kept_keys=spec)
    hf.unpatch(model)
    with pytest.raises(ValueError, match="not patched"):
        hf.patched_kept_keys(model)
    with pytest.raises(TypeError, match="kept_keys must be an aah.hf.KeptKeys"):
        hf.patch(model, torch.tensor(windows), kept_keys=(4, 3))
