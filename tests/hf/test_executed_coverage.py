"""Executed coverage (aah.hf.bridge.kept_keys.executed_read_coverage): the formula against the
(query, key) entries a prefill really computes, counted by instrumenting every attention call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from aah import hf  # noqa: E402
from aah.hf.bridge import attention as attention_module  # noqa: E402
from aah.hf.bridge import cache as cache_module  # noqa: E402
from aah.hf.bridge import kept_keys as kept_module  # noqa: E402
from aah.hf.bridge.kept_keys import KeptKeys, executed_read_coverage, kept_coverage  # noqa: E402
from aah.hf.bridge.spec import kv_heads, layer_specs  # noqa: E402
from aah.windows import band_mask, causal_coverage  # noqa: E402

VOCAB = 97


@pytest.fixture
def counted(monkeypatch):
    """A list whose first item counts the unmasked (query, key) entries of every attention call:
    SDPA (its boolean mask broadcast over batch and heads), the tail rows' exact attention (their
    visibility over the query heads), and the windowed prefill, run as SDPA with the window rule's
    mask so that it is counted the same way."""
    count = [0]
    sdpa, tail = F.scaled_dot_product_attention, kept_module.tail_attention

    def counting_sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        assert attn_mask is not None and attn_mask.dtype == torch.bool and not kwargs.get("is_causal")
        count[0] += int(torch.broadcast_to(attn_mask, (*query.shape[:-1], key.shape[-2])).sum())
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    def counting_tail(query, key, value, visible, scale):
        count[0] += int(torch.broadcast_to(visible, (*query.shape[:-1], key.shape[-2])).sum())
        return tail(query, key, value, visible, scale)

    def windowed(q, k, v, windows, *, backend, scale, sink_tokens=0):
        mask = band_mask(windows, q.shape[2], sink_tokens=sink_tokens)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])

    # The compiled rolling prefill: its windowed pass (the window rule's pairs), its scoring rows
    # (each reads the keys up to itself) and its kept keys' parts (each row its valid keys).
    scoring, part = kept_module.scoring_probabilities, kept_module.kept_part

    def windowed_lse(q, k, v, windows, scale, *, sink_tokens=0):
        mask = band_mask(windows, q.shape[2], sink_tokens=sink_tokens)
        count[0] += int(torch.broadcast_to(mask, (*q.shape[:-1], k.shape[-2])).sum())
        group = q.shape[1] // k.shape[1]
        scores = (q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ v.repeat_interleave(group, 1), scores.logsumexp(-1)

    def counting_scoring(rows, keys, group):
        n, t = rows.shape[2] // group, keys.shape[2]
        count[0] += rows.shape[0] * rows.shape[1] * group * (n * (t - n + 1) + n * (n - 1) // 2)
        return scoring(rows, keys, group)

    def counting_part(rows, keys, values, valid):
        count[0] += int(valid.sum()) * rows.shape[2]
        return part(rows, keys, values, valid)

    monkeypatch.setattr(kept_module, "strip_attention_lse", windowed_lse)
    monkeypatch.setattr(kept_module, "scoring_probabilities", counting_scoring)
    monkeypatch.setattr(kept_module, "kept_part", counting_part)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(kept_module, "tail_attention", counting_tail)
    monkeypatch.setattr(cache_module, "tail_attention", counting_tail)
    monkeypatch.setattr(attention_module, "attend", windowed)
    return count


def _prefill_pairs(model, count, length: int, kept: KeptKeys | None, mask: bool = False) -> int:
    """The entries one prefill of a ``length``-token prompt computes through a window cache; with
    ``mask``, given as a causal 4-D mask and with gradients on, the two-pass route (the windowed
    pass, then the rolling recompute), which a mask the compiled pass cannot read takes."""
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    extra = {}
    if mask:
        extra["attention_mask"] = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    count[0] = 0
    with torch.set_grad_enabled(mask):
        model(ids, past_key_values=hf.new_cache(model, kept_keys=kept), use_cache=True, **extra)
    return count[0]


def _mistral(sliding_window: int):
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=sliding_window,
        attn_implementation="sdpa", eos_token_id=None, bos_token_id=None,
    )
    return transformers.MistralForCausalLM(config).eval()


CASES = {
    # name: (model, windows per layer, sinks, prompt length, kept keys)
    "windows_alone": ("llama", [[3, 3, 5, 5], [4, 4, 2, 2]], 2, 30, None),
    "kept_keys": ("llama", [[3, 3, 5, 5], [4, 4, 2, 2]], 2, 30, KeptKeys(4, 3, 3)),
    "rolling_uneven_blocks": ("llama", [[3, 3, 5, 5], [4, 4, 2, 2]], 1, 29, KeptKeys(3, 3, 3, prefill_keys=3,
                                                                                    prefill_block=7)),
    "rolling_tail_longer_than_a_block": ("llama", [[3, 3, 30, 30], [2, 2, 4, 4]], 2, 26,
                                         KeptKeys(6, 2, 1, prefill_keys=4, prefill_block=5)),
    "sliding_layers": ("mistral", [[3, 3, 12, 12], [4, 4, 2, 2]], 2, 24, KeptKeys(4, 3, prefill_keys=2,
                                                                                  prefill_block=6)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_executed_coverage_counts_every_entry_the_prefill_computes(case, counted, llama):
    kind, windows, sinks, length, kept = CASES[case]
    model = llama(4, 2) if kind == "llama" else _mistral(8)
    hf.patch(model, torch.tensor(windows), sink_tokens=sinks)
    specs = layer_specs(model)
    computed = _prefill_pairs(model, counted, length, kept)
    executed = executed_read_coverage(specs, length, kept, kv_heads(model))
    assert executed * (length * (length + 1) // 2 * 8) == pytest.approx(computed, abs=1e-6)
    causal = kept_coverage(specs, length, kept, 2)[1] if kept else hf.executed_coverage(model, length)[1]
    if kept is None:
        assert executed == pytest.approx(causal)
    else:  # the tail rows' windowed pass (and the scoring rows) are read besides what the rule keeps
        assert executed > causal
    if kept is not None and kept.prefill_keys and kind == "llama":
        # The masked path reads the later blocks' rows twice: windowed, then with their kept keys.
        masked = _prefill_pairs(model, counted, length, kept, mask=True)
        padded = executed_read_coverage(specs, length, kept, kv_heads(model), padded=True)
        assert padded * (length * (length + 1) // 2 * 8) == pytest.approx(masked, abs=1e-6)
        assert padded > executed


def test_executed_coverage_by_hand():
    """One head, window 3, 1 sink, T = 12, tail 2, rolling blocks of 5 with 2 keys."""
    spec = hf.LayerWindows.build((3,), 1, "auto", None)
    full = 12 * 13 // 2
    window_pairs = 3 * 4 // 2 + 9 * 3 + 9 * 1  # rows 0-2 a triangle, then 3 keys and the sink
    assert executed_read_coverage([spec], 12, None, 1) == pytest.approx(window_pairs / full)
    assert executed_read_coverage([spec], 12, None, 1) == pytest.approx(causal_coverage([3], 12, sink_tokens=1))
    # The tail rows 10 and 11 read 4 keys each in the windowed pass, then 11 and 12.
    tail = KeptKeys(2, 4)
    assert executed_read_coverage([spec], 12, tail, 1) == pytest.approx((window_pairs + 11 + 12) / full)
    # Blocks start at 5 and 10. Far keys at a block start a: positions 1 .. a - 3, so 2 at 5 and
    # 2 (of 7) at 10: rows 5-11 read 2 more each. Scoring: rows 3, 4 read 4 + 5 keys; rows 8, 9: 9 + 10.
    rolling = KeptKeys(2, 4, prefill_keys=2, prefill_block=5)
    expected = window_pairs + 11 + 12 + 7 * 2 + (4 + 5) + (9 + 10)
    assert executed_read_coverage([spec], 12, rolling, 1) == pytest.approx(expected / full)
    # With a mask, rows 5-11 are first read windowed: 4 keys each.
    assert executed_read_coverage([spec], 12, rolling, 1, padded=True) == pytest.approx((expected + 7 * 4) / full)
