"""The one route decision (aah.decode.route.choose_route), and the reasons the GPT, the Hugging Face
bridge and kept keys report through it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aah import GPT, GPTConfig
from aah.decode import ring_decode
from aah.decode.block_step import block_weights
from aah.decode.rings import RingStore
from aah.decode.route import ATTENTION, BLOCK, MASKED, PREFILL, choose_route

compiled = pytest.mark.skipif(ring_decode.unavailable_reason() is not None,
                              reason=f"compiled decode step unavailable: {ring_decode.unavailable_reason()}")


def _store(sinks: int = 0, dtype=torch.float32) -> RingStore:
    store = RingStore((4, 8, 8, 16), 2, sinks=sinks)
    store.allocate(2, 8, 8, dtype, "cpu")
    return store


def test_the_first_call_is_the_prefill_whatever_else_holds():
    x = torch.zeros(2, 4, 3, 8, requires_grad=True)
    assert choose_route(_store(), x, start=0, tokens=3, padded=True) == choose_route(_store(), x, start=0)
    assert choose_route(_store(), x, start=0).name == PREFILL


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"tokens": 3}, "chunk of 3 tokens"),
    ({"padded": True}, "padding mask"),
    ({"first_real": torch.tensor([0, 2])}, "left padding"),
])
def test_what_the_compiled_steps_cannot_read_is_masked_with_its_reason(kwargs, reason):
    route = choose_route(_store(), torch.zeros(2, 4, 1, 8), start=5, **kwargs)
    assert route.name == MASKED and reason in route.reason


def test_a_dtype_other_than_the_rings_or_a_gradient_is_masked():
    assert "float64" in choose_route(_store(), torch.zeros(2, 4, 1, 8, dtype=torch.float64), start=5).reason
    route = choose_route(_store(), torch.zeros(2, 4, 1, 8, requires_grad=True), start=5)
    assert route.name == MASKED and "gradients" in route.reason


def test_without_the_extension_every_step_is_masked_and_says_so(monkeypatch):
    monkeypatch.setenv("AAH_RING_KERNEL", "0")
    route = choose_route(_store(), torch.zeros(2, 4, 1, 8), start=5, layer=lambda: "never asked")
    assert route.name == MASKED and "AAH_RING_KERNEL=0" in route.reason


@compiled
def test_a_layer_runs_whole_only_where_it_maps_and_the_sinks_are_written():
    x = torch.zeros(2, 1, 32)
    asked = []
    assert choose_route(_store(), x, start=5).name == ATTENTION  # the attention's own call
    route = choose_route(_store(), x, start=5, layer=lambda: asked.append(1) or "a projection is not plain")
    assert route == choose_route(_store(), x, start=5, layer=lambda: "a projection is not plain")
    assert route.name == ATTENTION and route.reason == "a projection is not plain" and asked == [1]
    block = choose_route(_store(), x, start=5, layer=lambda: "weights")
    assert block.name == ATTENTION
    mapped = choose_route(_store(), x, start=5, layer=lambda: ("mapped",))
    assert mapped.name == BLOCK and mapped.block == ("mapped",) and mapped.reason is None
    early = choose_route(_store(sinks=4), x, start=2, layer=lambda: ("mapped",))
    assert early.name == ATTENTION and "sink slots" in early.reason


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)).eval()


@compiled
def test_gpt_decoding_reports_the_route_and_why():
    model = _gpt()
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(2)
    with torch.no_grad():
        model(ids, cache=cache)
        assert cache.route == PREFILL
        model(ids[:, :1], cache=cache)
        assert cache.route == BLOCK and all(layer.store.route_reason is None for layer in cache.layers)
    model(ids[:, :1], cache=cache)  # with gradients: the modules run, the attention masked
    assert cache.route == MASKED and "gradients" in cache.layers[0].store.route_reason
    handle = model.blocks[0].mlp.register_forward_hook(lambda *args: None)
    with torch.no_grad():
        model(ids[:, :1], cache=cache)
    handle.remove()
    first = cache.layers[0]
    assert first.route == ATTENTION and "hooks" in first.store.route_reason
    assert cache.layers[1].route == BLOCK


def test_gpt_block_weights_say_why_they_cannot_be_mapped():
    model = _gpt()
    block = model.blocks[0]
    assert isinstance(block_weights(block, torch.float32), ring_decode.Block)
    assert "float32 or bfloat16" in block_weights(block, torch.float64)

    class Wrapped(nn.Linear):
        pass

    block.mlp.up.__class__ = Wrapped
    assert "not a plain nn.Linear" in block_weights(block, torch.float32)


@compiled
def test_bridge_routes_and_reasons_for_kept_keys_and_crop():
    """Kept keys run the whole layer compiled; crop recording takes the attention step, naming why."""
    transformers = pytest.importorskip("transformers")
    from aah import hf

    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    hf.patch(model, torch.tensor([[4, 4, 8, 8], [16, 16, 4, 4]]), sink_tokens=2)
    ids = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(2))

    def step(cache):
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            model(ids[:, :1], past_key_values=cache, use_cache=True)
        return cache.layers[0]

    plain = step(hf.new_cache(model))
    assert plain.route == BLOCK and plain.route_reason is None
    kept = step(hf.new_cache(model, kept_keys=hf.KeptKeys(4, 3)))
    assert kept.route == BLOCK and kept.route_reason is None  # the whole-layer step reads kept keys
    cropping = step(hf.new_cache(model, crop_limit=4))
    assert cropping.route == ATTENTION and "crop" in cropping.route_reason
