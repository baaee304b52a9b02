"""aah.hf.patch on tiny random Llama, Mistral and Qwen3 models, against independent references."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aah import hf  # noqa: E402

T = 24  # sequence length of the tests
VOCAB = 97


def _tiny(kind: str, **extra):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        attn_implementation="sdpa", eos_token_id=None, bos_token_id=None,
    )
    common.update(extra)
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        raise AssertionError(kind)
    return model.eval()


def _ids(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def _grid(rows):
    return torch.tensor(rows, dtype=torch.int64)


def _reference_mask(windows, sinks: int, length: int) -> torch.Tensor:
    """Additive (1, H, T, T) float64 mask written from the convention, loop by loop."""
    heads = len(windows)
    mask = torch.full((1, heads, length, length), float("-inf"), dtype=torch.float64)
    for h, w in enumerate(windows):
        for i in range(length):
            for j in range(i + 1):
                if i - w < j or j < sinks:
                    mask[0, h, i, j] = 0.0
    return mask


@torch.no_grad()
def _eager_reference_logits(model, ids, windows, sinks):
    """float64 eager attention with a custom per-head mask; every layer has the same windows."""
    ref = _tiny("llama").double()
    ref.load_state_dict(model.state_dict())
    ref.set_attn_implementation("eager")
    return ref(ids, attention_mask=_reference_mask(windows, sinks, ids.shape[1])).logits


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_windows_at_least_t_equal_the_unpatched_model(kind):
    model = _tiny(kind)
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits
        hf.patch(model, _grid([[T, T, 4 * T, T]] * 2), sink_tokens=0)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["dense", "banded"])
def test_uniform_window_equals_mistral_sliding_window(backend):
    full = _tiny("mistral", sliding_window=None)
    sliding = _tiny("mistral", sliding_window=5)
    sliding.load_state_dict(full.state_dict())
    ids = _ids()
    with torch.no_grad():
        expected = sliding(ids).logits
        hf.patch(full, _grid([[5] * 4] * 2), sink_tokens=0, backend=backend)
        got = full(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_qwen3_sliding_layers_cap_the_head_windows():
    # Layer 0 is full, layer 1 slides with W = 6: transformers' own model is the reference.
    model = _tiny("qwen3", layer_types=["full_attention", "sliding_attention"], sliding_window=6,
                  use_sliding_window=True, max_window_layers=1)
    assert model.model.layers[1].self_attn.sliding_window == 6
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
        hf.patch(model, _grid([[T] * 4, [T, 50, 6, 9]]), sink_tokens=2)
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_qwen3_uniform_window_on_full_layer_equals_all_sliding_model():
    mixed = _tiny("qwen3", layer_types=["full_attention", "sliding_attention"], sliding_window=6,
                  use_sliding_window=True, max_window_layers=1)
    all_sliding = _tiny("qwen3", layer_types=["sliding_attention", "sliding_attention"], sliding_window=6,
                        use_sliding_window=True, max_window_layers=0)
    all_sliding.load_state_dict(mixed.state_dict())
    ids = _ids()
    with torch.no_grad():
        expected = all_sliding(ids).logits
        hf.patch(mixed, _grid([[6] * 4, [T] * 4]), sink_tokens=0)
        got = mixed(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sinks", [0, 3])
def test_per_head_windows_with_sinks_equal_float64_reference(sinks):
    model = _tiny("llama")
    windows = [3, 7, 1, 16]
    ids = _ids()
    expected = _eager_reference_logits(model, ids, windows, sinks)
    with torch.no_grad():
        hf.patch(model, _grid([windows] * 2), sink_tokens=sinks)
        got = model(ids).logits
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_left_padding_equals_each_sequence_alone():
    model = _tiny("llama")
    hf.patch(model, _grid([[3, 5, 2, 9], [4, 4, 6, 1]]), sink_tokens=2)
    long_ids = _ids(1, T, seed=3)
    short_ids = _ids(1, T - 7, seed=4)
    pad = torch.zeros(1, 7, dtype=torch.long)
    batch = torch.cat([long_ids, torch.cat([pad, short_ids], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :7] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
        alone_long = model(long_ids).logits
        alone_short = model(short_ids).logits
    torch.testing.assert_close(padded[0], alone_long[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded[1, 7:], alone_short[0], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(padded).all()


def test_greedy_generate_with_dynamic_cache_equals_recompute():
    model = _tiny("llama")
    hf.patch(model, _grid([[3, 5, 2, 9], [4, 4, 6, 1]]), sink_tokens=2)
    prompt = _ids(1, 10, seed=5)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
        seq = prompt
        for _ in range(8):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)


def test_wrong_windows_shape_is_a_value_error():
    model = _tiny("llama")
    with pytest.raises(ValueError, match=r"\(num_layers, num_query_heads\) = \(2, 4\)"):
        hf.patch(model, _grid([[4, 4, 4]] * 2))
    with pytest.raises(ValueError, match="sink_tokens"):
        hf.patch(model, _grid([[4] * 4] * 2), sink_tokens=-1)


def test_unpatch_restores_the_model():
    model = _tiny("llama")
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits
        hf.patch(model, _grid([[2] * 4] * 2), sink_tokens=0)
        windowed = model(ids).logits
        assert torch.equal(hf.patched_windows(model), _grid([[2] * 4] * 2))
        hf.unpatch(model)
        after = model(ids).logits
    assert not torch.allclose(windowed, before)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(after, before)
    with pytest.raises(ValueError, match="not patched"):
        hf.unpatch(model)


def test_hf_convert_errors_are_one_line(tmp_path, capsys):
    from aah.cli import main

    assert main(["hf", "convert", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aah hf: GGUF file not found") and "\n" not in err
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"x")
    assert main(["hf", "convert", str(not_gguf), str(tmp_path / "out")]) == 2
    assert "expected a .gguf file" in capsys.readouterr().err
