"""Shared test helpers: the float64 attention reference (built from aah.windows.visible), a tiny
offline tokenizer, a tiny random Llama."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch


def reference_attention(q, k, v, windows, scale=None, sink_tokens=0):
    """float64 attention over the keys :func:`aah.windows.visible` allows: one plain softmax over every key.

    The reference every backend, kernel and cache path is tested against; the rule itself is
    checked by hand in tests/test_windows.py. ``q`` (..., H, Tq, D) holds the queries at the
    last ``Tq`` positions of ``k`` and ``v`` (..., H_kv, Tk, D); ``windows`` has one entry per
    query head.
    """
    from aah.windows import visible

    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(group, dim=-3) for t in (k, v))
    tq, tk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    w = torch.as_tensor(list(windows))[:, None, None]
    allowed = visible(torch.arange(tk - tq, tk)[:, None], torch.arange(tk)[None, :], w, sink_tokens)  # (H, Tq, Tk)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


def masked_reference_logits(model, ids, allowed):
    """Logits of ``model`` (a transformers causal LM) on ``ids`` without a cache, every attention
    computed by hand, softmax over the keys ``allowed(layer, num_heads, t)`` ((H, t, t) bool) allows."""
    transformers = pytest.importorskip("transformers")

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        groups = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = (query @ k.transpose(-1, -2)) * scaling
        keep = allowed(module.layer_idx, query.shape[1], query.shape[2])
        scores = scores.masked_fill(~keep, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register("masked_reference_for_test", attention)
    transformers.masking_utils.AttentionMaskInterface.register(
        "masked_reference_for_test", transformers.masking_utils.sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("masked_reference_for_test")
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        model.set_attn_implementation(previous)


def tiny_byte_bpe(texts, vocab_size: int, special_tokens=(), **fast_tokenizer_kwargs):
    """A byte-level BPE tokenizer (transformers' fast tokenizer, built with
    ``fast_tokenizer_kwargs``) trained offline on ``texts``; any text still tokenizes, byte by
    byte where the merges do not reach."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False, special_tokens=list(special_tokens),
    )
    bpe.train_from_iterator(list(texts), trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, **fast_tokenizer_kwargs)


@pytest.fixture(scope="session")
def byte_bpe():
    """:func:`tiny_byte_bpe`, for tests and fixtures of any scope."""
    return tiny_byte_bpe


@pytest.fixture
def ref_attention():
    return reference_attention


@pytest.fixture
def masked_logits():
    return masked_reference_logits


def tiny_llama(heads: int = 4, kv_heads: int = 2, layers: int = 2, vocab: int = 97):
    """A seeded random Llama with head_dim 8 and no special tokens (the window cache's tests)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
        max_position_embeddings=256, attn_implementation="sdpa", eos_token_id=None, bos_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def llama():
    return tiny_llama


@pytest.fixture
def compiled(monkeypatch):
    """The compiled decode step (aah.decode.ring_decode), turned on; the test is skipped where it cannot be built."""
    from aah.decode import ring_decode

    monkeypatch.setenv("AAH_RING_KERNEL", "1")
    reason = ring_decode.unavailable_reason()
    if reason is not None:
        pytest.skip(f"the compiled decode step cannot be built here: {reason}")
    return ring_decode


@pytest.fixture(autouse=True, scope="session")
def _backend_choice_cache(tmp_path_factory):
    """Calibrated ``backend="auto"`` choices go to a temporary folder, never the user's cache."""
    import os

    old = os.environ.get("AAH_CACHE_DIR")
    os.environ["AAH_CACHE_DIR"] = str(tmp_path_factory.mktemp("aah-cache"))
    yield
    if old is None:
        os.environ.pop("AAH_CACHE_DIR", None)
    else:
        os.environ["AAH_CACHE_DIR"] = old


def text_corpus(folder: Path, text: str, documents: int) -> Path:
    """A corpus folder of ``documents`` small text files, each ``text`` and its number (made offline)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(documents):
        (folder / f"doc{i}.txt").write_text(f"{text} part {i}\n")
    return folder
