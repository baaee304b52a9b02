"""A patched model keeps transformers' contract: every generate mode and cache is exact or refused.

Every result is compared with an independent float64 reference: the same model in float64 with
an attention function written here, which applies each head's window and sinks from a mask
built position by position over the whole sequence (padding and documents included), with no
cache at all.
"""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aah import hf  # noqa: E402
from aah.cli import main  # noqa: E402
from aah.hf.bridge.spec import layer_specs  # noqa: E402
from aah.hf.bridge.windows_file import model_signature, save_windows  # noqa: E402

VOCAB = 97
KINDS = ["llama", "mistral", "qwen3"]
# Per layer and query head (4 query heads, 2 KV heads); windows shorter than the sequences.
WINDOWS = torch.tensor([[3, 5, 2, 9], [4, 4, 6, 1]])
SINKS = 2


def _tiny(kind: str, seed: int = 0, layers: int = 2):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        attn_implementation="sdpa", eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(seed)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    if kind == "mistral":  # sliding_window above every length here: no layer is capped, none keeps sinks
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=64, **common)).eval()
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common)).eval()
    raise AssertionError(kind)


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _layer_sinks(model, sinks: int) -> list[int]:
    """A layer with its own sliding window keeps no sinks (Mistral: every layer)."""
    sliding = getattr(model.config, "sliding_window", None) if model.config.model_type == "mistral" else None
    return [0 if sliding is not None else sinks] * model.config.num_hidden_layers


def _reference_allowed(windows, sinks: int, real: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """(B, H, T, T) bool, loop by loop: query i sees key j of its own document and row when
    j <= i and (i - j < W or j is one of the first ``sinks`` real tokens of that document)."""
    batch, length = real.shape
    allowed = torch.zeros(batch, len(windows), length, length, dtype=torch.bool)
    for b in range(batch):
        for i in range(length):
            seen = [j for j in range(i + 1) if real[b, j] and documents[b, j] == documents[b, i]]
            for h, w in enumerate(windows):
                for j in seen:
                    if i - j < w or j in seen[:sinks]:
                        allowed[b, h, i, j] = True
            if not seen:  # a padding query: anything finite
                allowed[b, :, i, i] = True
    return allowed


@torch.no_grad()
def reference_logits(model, ids, windows, sinks, real=None, documents=None) -> torch.Tensor:
    """float64 logits of ``model``'s weights over the whole of ``ids``, windows applied by mask."""
    ref = copy.deepcopy(model)
    if hasattr(ref, "_aah_previous_attn_implementation"):
        hf.unpatch(ref)
    ref = ref.double()
    real = torch.ones_like(ids, dtype=torch.bool) if real is None else real.bool()
    documents = torch.zeros_like(ids) if documents is None else documents
    per_layer_sinks = _layer_sinks(model, sinks)
    masks = [_reference_allowed(row.tolist(), s, real, documents) for row, s in zip(windows, per_layer_sinks)]

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        scores = (query @ key.transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~masks[module.layer_idx], float("-inf"))
        return (scores.softmax(dim=-1) @ value).transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register("aah_test_reference", attention)
    ref.set_attn_implementation("aah_test_reference")
    position_ids = None
    if real is not None:
        position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)
    if documents is not None and bool(documents.any()):
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
        index = torch.arange(ids.shape[1]).expand_as(ids)
        position_ids = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
    return ref(ids, position_ids=position_ids, use_cache=False).logits.float()


def _greedy_with_scores(model, prompt, steps, **kwargs):
    out = model.generate(prompt, max_new_tokens=steps, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits, dim=1)


def _check_against_reference(model, prompt, sequences, logits, real=None):
    """Every generated token is the reference's argmax and every step's logits are the reference's."""
    if real is not None:
        real = torch.cat([real, torch.ones(real.shape[0], sequences.shape[1] - real.shape[1], dtype=real.dtype)], 1)
    ref = reference_logits(model, sequences, WINDOWS, SINKS, real=real)
    steps = sequences.shape[1] - prompt.shape[1]
    expected = ref[:, prompt.shape[1] - 1:prompt.shape[1] - 1 + steps]
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)
    assert torch.equal(sequences[:, prompt.shape[1]:], expected.argmax(-1))


# ---- caches and generate modes ----------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_default_generate_uses_the_window_cache_and_equals_the_reference(kind):
    model = hf.patch(_tiny(kind), WINDOWS, sink_tokens=SINKS)
    prompt = _ids(2, 14)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=10, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    assert isinstance(out.past_key_values.layers[0], hf.WindowCacheLayer)
    _check_against_reference(model, prompt, out.sequences, torch.stack(out.logits, 1))


@pytest.mark.parametrize("kind", KINDS)
def test_static_cache_is_exact(kind):
    model = hf.patch(_tiny(kind), WINDOWS, sink_tokens=SINKS)
    prompt = _ids(2, 14)
    with torch.no_grad():
        static = transformers.StaticCache(config=model.config, max_cache_len=40)
        seq, logits = _greedy_with_scores(model, prompt, 10, past_key_values=static)
        _check_against_reference(model, prompt, seq, logits)
        seq2, logits2 = _greedy_with_scores(model, prompt, 10, cache_implementation="static")
    assert torch.equal(seq2, seq)
    torch.testing.assert_close(logits2, logits)


@pytest.mark.parametrize("kind", KINDS)
def test_cache_implementation_maps_or_refuses_with_the_choices(kind):
    model = hf.patch(_tiny(kind), WINDOWS, sink_tokens=SINKS)
    prompt = _ids(1, 12)
    with torch.no_grad():
        plain, _ = _greedy_with_scores(model, prompt, 6)
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="dynamic",
                             return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain)
        assert isinstance(out.past_key_values.layers[0], hf.WindowCacheLayer)
        config = copy.deepcopy(model.generation_config)
        config.cache_implementation = "dynamic"
        assert torch.equal(model.generate(prompt, generation_config=config, max_new_tokens=6, do_sample=False), plain)
        model.generation_config.cache_implementation = "dynamic"  # the model's own setting
        assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), plain)
        model.generation_config.cache_implementation = "static"
        static = model.generate(prompt, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        assert isinstance(static.past_key_values, transformers.StaticCache)
        model.generation_config.cache_implementation = None
        for name in ("offloaded", "offloaded_static", "quantized"):
            with pytest.raises(ValueError, match=r"cache_implementation='.*' is not supported.*'dynamic'.*'static'"):
                model.generate(prompt, max_new_tokens=2, cache_implementation=name)


@pytest.mark.parametrize("kind", KINDS)
def test_assisted_decoding_and_prompt_lookup_equal_plain_greedy(kind):
    model = hf.patch(_tiny(kind), WINDOWS, sink_tokens=SINKS)
    assistant = _tiny(kind, seed=3)
    prompt = torch.cat([_ids(1, 8), _ids(1, 8)], dim=1)  # repeats: prompt lookup finds candidates
    with torch.no_grad():
        plain, _ = _greedy_with_scores(model, prompt, 16)
        assisted = model.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=assistant)
        lookup = model.generate(prompt, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(assisted, plain)
    assert torch.equal(lookup, plain)


def test_crop_takes_back_exactly_and_refuses_beyond_its_records():
    model = hf.patch(_tiny("llama"), WINDOWS, sink_tokens=SINKS)
    ids = _ids(2, 30)
    with torch.no_grad():
        cache = hf.new_cache(model, crop_limit=8)
        model(ids[:, :20], past_key_values=cache)
        model(ids[:, 20:27], past_key_values=cache)  # a write longer than the rings
        cache.crop(-5)
        assert cache.get_seq_length() == 22
        again = model(ids[:, 22:30], past_key_values=cache).logits
        with pytest.raises(ValueError, match="down to 22"):
            cache.crop(-12)
        plain = hf.new_cache(model)
        model(ids[:, :22], past_key_values=plain)
        with pytest.raises(ValueError, match="crop_limit"):
            plain.crop(-1)
    ref = reference_logits(model, ids, WINDOWS, SINKS)[:, 22:30]
    torch.testing.assert_close(again, ref, atol=2e-4, rtol=1e-4)


def test_a_crop_never_reaches_into_a_write_an_earlier_crop_cut():
    model = hf.patch(_tiny("llama"), WINDOWS, sink_tokens=SINKS)
    ids = _ids(2, 40)
    with torch.no_grad():
        cache = hf.new_cache(model, crop_limit=8)
        model(ids[:, :20], past_key_values=cache)
        model(ids[:, 20:27], past_key_values=cache)
        cache.crop(-5)  # cuts the write of 20..26 at 22
        model(ids[:, 22:24], past_key_values=cache)
        with pytest.raises(ValueError, match="an earlier crop cut"):
            cache.crop(-3)
        cache.crop(-2)  # back to 22 exactly: allowed and exact
        out = model(ids[:, 22:30], past_key_values=cache).logits
    torch.testing.assert_close(out, reference_logits(model, ids, WINDOWS, SINKS)[:, 22:30], atol=2e-4, rtol=1e-4)


def test_past_recording_takes_back_a_whole_long_write():
    """transformers turns recording on before assisted decoding: a block of drafts longer than
    any limit (here 30 positions, rings of at most 9) is taken back exactly."""
    model = hf.patch(_tiny("llama"), WINDOWS, sink_tokens=SINKS)
    ids = _ids(1, 60)
    with torch.no_grad():
        cache = hf.new_cache(model)
        model(ids[:, :20], past_key_values=cache)
        cache.activate_past_recording()
        model(ids[:, 20:50], past_key_values=cache)
        cache.crop(-29)
        out = model(ids[:, 21:60], past_key_values=cache).logits
    torch.testing.assert_close(out, reference_logits(model, ids, WINDOWS, SINKS)[:, 21:60], atol=2e-4, rtol=1e-4)


def test_a_patched_assistant_and_early_exit_equal_plain_greedy():
    model = hf.patch(_tiny("llama"), WINDOWS, sink_tokens=SINKS)
    assistant = hf.patch(_tiny("llama", seed=3), torch.full((2, 4), 3), sink_tokens=1)
    prompt = torch.cat([_ids(1, 8), _ids(1, 8)], dim=1)
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=12, do_sample=False)
        assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=assistant), plain)
        assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False, assistant_early_exit=1), plain)


def test_chunked_prefill_with_a_first_chunk_of_padding():
    model = hf.patch(_tiny("llama"), WINDOWS, sink_tokens=SINKS)
    prompt = _ids(2, 12)
    real = torch.ones_like(prompt)
    real[1, :6] = 0
    prompt[1, :6] = 0
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=real, prefill_chunk_size=4, max_new_tokens=8, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    full_real = torch.cat([real, torch.ones(2, 8, dtype=real.dtype)], 1)
    ref = reference_logits(model, out.sequences, WINDOWS, SINKS, real=full_real)[:, 11:19]
    torch.testing.assert_close(torch.stack(out.logits, 1), ref, atol=2e-4, rtol=1e-4)


def test_a_cache_never_loses_keys_inside_a_window_silently():
    model = _tiny("llama")
    model.config.max_position_embeddings = 16
    full = torch.full((2, 4), 2**20)
    hf.patch(model, full, sink_tokens=0)
    with torch.no_grad():  # past the model's context: still every key (transformers only warns)
        out = model.generate(_ids(1, 10), max_new_tokens=14, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        capped = hf.new_cache(model, max_cache_len=8)
        with pytest.raises(ValueError, match="max_cache_len=8"):
            model(_ids(1, 9), past_key_values=capped)
        assert capped.get_seq_length() == 0  # a refused write is not counted
        # A one-token step past the cap raises too, on whichever decode route it takes.
        capped = hf.new_cache(model, max_cache_len=8)
        model(_ids(1, 8), past_key_values=capped)
        with pytest.raises(ValueError, match="max_cache_len=8"):
            model(_ids(1, 1), past_key_values=capped)
        # The refused step counted nothing: the cache still holds the 8 positions it stored.
        assert capped.get_seq_length() == 8
    ref = reference_logits(model, out.sequences, full, 0)[:, 9:23]
    torch.testing.assert_close(torch.stack(out.logits, 1), ref, atol=2e-4, rtol=1e-4)


def test_beam_search_and_several_return_sequences_match_the_dynamic_cache_path():
    """Beam bookkeeping (repeat, select, reorder) moves the rings with their rows: the window
    cache gives what the exact masked path over transformers' own StaticCache gives."""
    model = hf.patch(_tiny("llama"), WINDOWS, sink_tokens=SINKS)
    prompt = _ids(2, 12)
    kwargs = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        window = model.generate(prompt, **kwargs)
        static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(window, static)


@pytest.mark.parametrize("kind", KINDS)
def test_reset_then_a_batch_of_another_size(kind):
    model = hf.patch(_tiny(kind), WINDOWS, sink_tokens=SINKS)
    cache = hf.new_cache(model)
    with torch.no_grad():
        model(_ids(2, 10), past_key_values=cache)
        cache.reset()
        assert cache.get_seq_length() == 0
        ids = _ids(3, 12, seed=5)
        reused = model(ids, past_key_values=cache).logits
        fresh = model(ids, past_key_values=hf.new_cache(model)).logits
        with pytest.raises(ValueError, match="cache.reset"):
            model(_ids(1, 1), past_key_values=cache)
    torch.testing.assert_close(reused, fresh)


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_row_shorter_than_the_sinks(kind):
    model = hf.patch(_tiny(kind), WINDOWS, sink_tokens=4)
    prompt = _ids(2, 10)
    real = torch.ones_like(prompt)
    real[1, :9] = 0  # one real token, four sinks
    prompt[1, :9] = 0
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=real, max_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    full_real = torch.cat([real, torch.ones(2, 8, dtype=real.dtype)], 1)
    ref = reference_logits(model, out.sequences, WINDOWS, 4, real=full_real)[:, 9:17]
    torch.testing.assert_close(torch.stack(out.logits, 1), ref, atol=2e-4, rtol=1e-4)


# ---- inputs: packed rows and custom masks -----------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_rows_equal_each_document_alone(kind, use_cache):
    model = hf.patch(_tiny(kind), WINDOWS, sink_tokens=SINKS)
    first, second = _ids(1, 9, seed=2), _ids(1, 13, seed=3)
    packed = torch.cat([first, second], dim=1)
    position_ids = torch.cat([torch.arange(9), torch.arange(13)])[None]
    with torch.no_grad():
        both = model(packed, position_ids=position_ids, use_cache=use_cache).logits
        alone = model(second, use_cache=False).logits
    torch.testing.assert_close(both[:, 9:], alone, atol=1e-5, rtol=1e-5)
    documents = torch.cat([torch.zeros(9), torch.ones(13)]).long()[None]
    torch.testing.assert_close(both, reference_logits(model, packed, WINDOWS, SINKS, documents=documents),
                               atol=2e-4, rtol=1e-4)


def test_packed_rows_through_a_window_cache_are_refused():
    model = hf.patch(_tiny("llama"), WINDOWS, sink_tokens=SINKS)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with pytest.raises(NotImplementedError, match="packed sequences"):
        model(_ids(1, 12), position_ids=position_ids, past_key_values=hf.new_cache(model))


@pytest.mark.parametrize("kind", KINDS)
def test_custom_4d_masks_are_exact_or_refused(kind):
    model = hf.patch(_tiny(kind), WINDOWS, sink_tokens=SINKS)
    ids = _ids(1, 16)
    documents = (torch.arange(16) >= 6).long()[None]
    visible = (documents[:, :, None] == documents[:, None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    with torch.no_grad():
        out = model(ids, attention_mask=visible[:, None], use_cache=False).logits
        additive = torch.zeros(1, 1, 16, 16).masked_fill(~visible[:, None], torch.finfo(torch.float32).min)
        out_additive = model(ids, attention_mask=additive, use_cache=False).logits
        bias = additive.clone()
        bias[..., 0] = 0.5
        with pytest.raises(ValueError, match="additive 4-D masks of 0"):
            model(ids, attention_mask=bias, use_cache=False)
        prefix_lm = visible.clone()
        prefix_lm[:, :4, :4] = True  # a query sees later keys of its prefix
        with pytest.raises(ValueError, match="causal 4-D masks only"):
            model(ids, attention_mask=prefix_lm[:, None], use_cache=False)
    ref = reference_logits(model, ids, WINDOWS, SINKS, documents=documents)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(out_additive, out)


# ---- memory ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_full_windows_cost_what_a_dynamic_cache_costs(kind):
    model = hf.patch(_tiny(kind), torch.full((2, 4), 2**20), sink_tokens=0)
    ids = _ids(1, 20)
    with torch.no_grad():
        cache = hf.new_cache(model)
        model(ids, past_key_values=cache)
        dynamic = transformers.DynamicCache(config=model.config)
        hf.unpatch(model)
        model(ids, past_key_values=dynamic)
    assert hf.cache_memory_bytes(cache) == hf.cache_memory_bytes(dynamic) == 2 * 2 * 2 * 20 * 8 * 4


def test_rings_grow_with_the_tokens_and_stop_at_the_window():
    model = hf.patch(_tiny("llama"), torch.full((2, 4), 6), sink_tokens=1)
    cache = hf.new_cache(model)
    sizes = []
    with torch.no_grad():
        for chunk in _ids(1, 12).split(2, dim=1):
            model(chunk, past_key_values=cache)
            sizes.append(hf.cache_memory_bytes(cache) // (2 * 2 * 2 * 8 * 4))  # slots per KV head
    assert sizes == [1 + 2, 1 + 4, 1 + 6, 1 + 6, 1 + 6, 1 + 6]


def test_no_mask_cache_outlives_the_model():
    from aah.hf.bridge import attention, masks, patch, spec

    for module in (attention, masks, patch, spec):
        assert not any(hasattr(getattr(module, name), "cache_info") for name in dir(module))


# ---- unpatch, pickling, copies ----------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_a_window_cache_after_unpatch_raises_a_clear_error(kind):
    model = hf.patch(_tiny(kind), WINDOWS, sink_tokens=SINKS)
    cache = hf.new_cache(model)
    with torch.no_grad():
        model(_ids(1, 6), past_key_values=cache)
        hf.unpatch(model)
        keys, values = cache.layers[0].update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
        assert isinstance(keys, torch.Tensor) and keys.shape == (1, 2, 1, 8)
        with pytest.raises(RuntimeError, match="only the 'aah' attention of a model patched"):
            model(_ids(1, 1), past_key_values=cache)


@pytest.mark.parametrize("kind", KINDS)
def test_patched_models_pickle_and_deep_copy(kind):
    model = hf.patch(_tiny(kind), WINDOWS, sink_tokens=SINKS)
    prompt = _ids(1, 12)
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert torch.equal(hf.patched_windows(loaded), WINDOWS)
        # Decoder layers moved into their compiled-step class (Llama, Mistral) come back in it.
        assert [type(layer) for layer in loaded.model.layers] == [type(layer) for layer in model.model.layers]
        assert torch.equal(loaded.generate(prompt, max_new_tokens=6, do_sample=False), expected)
        twin = copy.deepcopy(model)
        other = torch.tensor([[7, 7, 2, 2], [3, 3, 5, 5]])
        hf.patch(twin, other, sink_tokens=1)
        out = twin.generate(prompt, max_new_tokens=6, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    ref = reference_logits(twin, out.sequences, other, 1)[:, 11:17]
    torch.testing.assert_close(torch.stack(out.logits, 1), ref, atol=2e-4, rtol=1e-4)
    hf.unpatch(twin)
    assert type(twin) is type(_tiny(kind))
    assert {type(layer) for layer in twin.model.layers} == {type(_tiny(kind).model.layers[0])}


def test_save_pretrained_of_a_patched_model_names_the_model_class(tmp_path):
    model = hf.patch(_tiny("qwen3"), WINDOWS, sink_tokens=SINKS)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


# ---- windows files ------------------------------------------------------------------------------

def _meta(model, **extra):
    meta = {"model": model_signature(model), "seq_len": 64, "policy": "uniform", "budget": 0.5, "sink_tokens": 3,
            "acr": 0.1, "causal_coverage": 0.1}
    meta.update(extra)
    return meta


def test_windows_files_are_checked_where_they_enter(tmp_path):
    model = _tiny("llama")
    good = save_windows(tmp_path / "w.safetensors", WINDOWS, _meta(model))
    windows, meta = hf.load_windows(good, model)
    assert torch.equal(windows, WINDOWS)
    hf.patch(model, good)  # the file's windows and sink tokens
    assert all(spec.sink_tokens == 3 for spec in layer_specs(model))
    hf.patch(model, good, sink_tokens=0)
    assert all(spec.sink_tokens == 0 for spec in layer_specs(model))
    with pytest.raises(ValueError, match="calibrated for"):
        hf.check_windows_for(_tiny("llama", layers=3), windows, meta, "w")

    raw = bytearray(good.read_bytes())
    index = raw.rindex(int(WINDOWS[1, 3]).to_bytes(8, "little"))
    raw[index + 5] = 0xE8  # one flipped byte: a window of about 1e12
    (tmp_path / "flipped.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"windows must lie in \[1, 16777216\]"):
        hf.load_windows(tmp_path / "flipped.safetensors")
    save_windows(tmp_path / "neg.safetensors", WINDOWS, _meta(model, sink_tokens=-2))
    with pytest.raises(ValueError, match="sink_tokens must be an integer in"):
        hf.load_windows(tmp_path / "neg.safetensors")
    from safetensors.torch import save_file

    save_file({"windows": WINDOWS.float()}, str(tmp_path / "float.safetensors"),
              metadata={k: json.dumps(v) for k, v in _meta(model).items()})
    with pytest.raises(ValueError, match="integer tensor"):
        hf.load_windows(tmp_path / "float.safetensors")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, byte_bpe):
    folder = tmp_path_factory.mktemp("contract") / "model"
    _tiny("llama").save_pretrained(folder)
    byte_bpe(["to be or not to be that is the question"] * 20, VOCAB).save_pretrained(folder)
    return folder


def _one_line_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_hf_commands_turn_bad_weights_and_windows_into_one_line(model_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in "abcdefgh":
        (corpus / f"{name}.txt").write_text("to be or not to be that is the question " * 40)
    model = _tiny("llama")
    flipped = save_windows(tmp_path / "w.safetensors", WINDOWS, _meta(model))
    raw = bytearray(flipped.read_bytes())
    raw[raw.rindex(int(WINDOWS[1, 3]).to_bytes(8, "little")) + 5] = 0xE8
    flipped.write_bytes(bytes(raw))
    base = ["--corpus", str(corpus), "--seq-len", "32"]
    assert "windows must lie in" in _one_line_error(["hf", "eval", str(model_dir), "--windows-file", str(flipped), *base],
                                                    capsys)
    negative = save_windows(tmp_path / "n.safetensors", WINDOWS, _meta(model, sink_tokens=-1))
    assert "sink_tokens must be" in _one_line_error(
        ["hf", "eval", str(model_dir), "--windows-file", str(negative), *base], capsys)
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in model_dir.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    good = save_windows(tmp_path / "g.safetensors", WINDOWS, _meta(model))
    assert "weights cannot be loaded" in _one_line_error(
        ["hf", "eval", str(broken), "--windows-file", str(good), *base, "--new-tokens", "4"], capsys)
    assert "weights cannot be loaded" in _one_line_error(
        ["hf", "calibrate", str(broken), *base, "--policy", "uniform", "--budget", "0.5", "--batches", "1",
         "--out", str(tmp_path / "o.safetensors")], capsys)
