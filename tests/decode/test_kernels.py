"""The compiled decode step's linear layers, packed attention step and whole-block step (aah.decode.ring_decode).

References: float64 matrix products and activations written here, the
RotaryEmbedding of aah.attention with ring_decode (tested against its own
reference in test_ring_decode.py), and the model's module path.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from aah import GPT, ControllerConfig, GPTConfig
from aah.attention import AAHAttention, RotaryEmbedding
from aah.decode.cache import LayerKVCache

ACTIVATIONS64 = {"none": lambda y: y, "gelu": lambda y: F.gelu(y), "relu": F.relu}


# ---------------------------------------------------------------------- linear_rows
@pytest.mark.parametrize("activation", ["none", "gelu", "relu"])
@pytest.mark.parametrize("in_features", [256, 37])  # 37: the loop remainders past the 32- and 8-wide blocks
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)])
def test_linear_rows_matches_float64(compiled, activation, in_features, rows, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(70, in_features, generator=gen, dtype=torch.float64) / math.sqrt(in_features)).to(dtype)
    bias = torch.randn(70, generator=gen, dtype=torch.float64).to(dtype)
    for b in (None, bias):
        got = compiled.linear_rows(x, weight, b, activation)
        assert got.dtype == dtype and got.shape == (rows, 70)
        want = x.double() @ weight.double().T + (0 if b is None else b.double())
        torch.testing.assert_close(got.double(), ACTIVATIONS64[activation](want), atol=tol, rtol=tol)


def test_linear_rows_rejects_bad_input(compiled):
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="share a dtype"):
        compiled.linear_rows(x.double(), w)
    with pytest.raises(RuntimeError, match=r"x must be \(N, I\) and weight \(O, I\)"):
        compiled.linear_rows(x, torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="bias must be"):
        compiled.linear_rows(x, w, torch.randn(5))
    with pytest.raises(RuntimeError, match="activation must be none, gelu or relu"):
        compiled.linear_rows(x, w, None, "tanh")


def test_linear_takes_the_kernel_only_for_few_rows_without_gradient(compiled, monkeypatch):
    layer = torch.nn.Linear(16, 12)
    calls = []
    kernel = compiled.load().linear_rows
    counting = type("M", (), {"linear_rows": staticmethod(lambda *a: calls.append(1) or kernel(*a))})
    monkeypatch.setattr(compiled, "load", lambda: counting)
    x = torch.randn(2, 1, 16)
    with torch.no_grad():
        want = F.gelu(layer(x))
        got = compiled.linear(layer, x, "gelu")
        assert len(calls) == 1 and got.shape == (2, 1, 12)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        many = torch.randn(compiled.LINEAR_ROWS_MAX + 1, 16)
        torch.testing.assert_close(compiled.linear(layer, many), layer(many))  # too many rows: the module
        assert len(calls) == 1
    y = compiled.linear(layer, x, "relu")  # a gradient is wanted: the module, differentiable
    assert y.requires_grad and len(calls) == 1
    torch.testing.assert_close(y, F.relu(layer(x)))
    seen = []
    handle = layer.register_forward_hook(lambda *_: seen.append(1))
    with torch.no_grad():
        compiled.linear(layer, x)
    handle.remove()
    assert seen == [1] and len(calls) == 1  # a hook on the layer runs: the module path
    class Doubled(torch.nn.Linear):  # a subclass computing something else keeps its own forward
        def forward(self, x):
            return 2 * super().forward(x)

    doubled = Doubled(16, 12)
    with torch.no_grad():
        torch.testing.assert_close(compiled.linear(doubled, x), 2 * F.linear(x, doubled.weight, doubled.bias))
    assert len(calls) == 1
    with pytest.raises(ValueError, match="activation must be one of none, gelu, relu"):
        compiled.linear(layer, torch.randn(20, 16), "tanh")


# ---------------------------------------------------------------------- packed attention step
@pytest.mark.parametrize("rotary", [True, False])
def test_packed_step_rotates_writes_and_attends(compiled, rotary):
    heads, kv_heads, dim, length = 4, 2, 16, 9
    windows, capacities = [2, 8, 8, 3], [8, 8]
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 16, dim, generator=gen)
    values = torch.randn(2, 16, dim, generator=gen)
    unread = torch.full((1, 16), -1.0e30)
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim, generator=gen)
    rope = RotaryEmbedding(dim, 32)
    cos, sin = rope.tables() if rotary else (None, None)  # the kernel reads row length - 1
    starts, caps, wins = torch.tensor([0, 8]), torch.tensor(capacities), torch.tensor(windows)
    before_k, before_v = keys.clone(), values.clone()
    rings = compiled.Rings(keys, values, unread, starts, caps, wins)
    out = compiled.ring_decode_packed(qkv, cos, sin, rings, length, dim**-0.5)
    assert out.shape == (2, heads * dim)

    split = qkv.view(2, heads + 2 * kv_heads, 1, dim).transpose(1, 2)  # (B, 1, heads, D)
    q, k, v = split[:, 0, :heads], split[:, 0, heads : heads + kv_heads], split[:, 0, heads + kv_heads :]
    if rotary:  # the module's rotation at position length - 1
        q = rope(q[:, :, None], length - 1)[:, :, 0]
        k = rope(k[:, :, None], length - 1)[:, :, 0]
    slot = (length - 1) % 8
    want_k, want_v = before_k.clone(), before_v.clone()
    for g in range(kv_heads):
        want_k[:, 8 * g + slot], want_v[:, 8 * g + slot] = k[:, g], v[:, g]
    torch.testing.assert_close(keys, want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(values, want_v, rtol=0, atol=0)
    assert unread[0, [slot, 8 + slot]].tolist() == [0.0, 0.0]
    assert (unread != 0).sum() == 14
    want = compiled.ring_decode(q.contiguous(), want_k, want_v, starts, caps, wins, length, dim**-0.5)
    torch.testing.assert_close(out, want.reshape(2, heads * dim), rtol=1e-5, atol=1e-6)


def test_packed_step_rejects_bad_input(compiled):
    keys, values, unread = torch.zeros(1, 8, 4), torch.zeros(1, 8, 4), torch.zeros(1, 8)
    args = (compiled.Rings(keys, values, unread, torch.tensor([0]), torch.tensor([8]), torch.tensor([8, 8])), 3, 0.5)
    with pytest.raises(RuntimeError, match=r"qkv must be \(B, \(H \+ 2 H_kv\) D\)"):
        compiled.ring_decode_packed(torch.zeros(1, 15), None, None, *args)
    with pytest.raises(RuntimeError, match="cos and sin must be rotary tables"):
        compiled.ring_decode_packed(torch.zeros(1, 16), torch.zeros(3), torch.zeros(3), *args)
    with pytest.raises(RuntimeError, match="holding position length - 1"):  # 2 positions, length 3
        compiled.ring_decode_packed(torch.zeros(1, 16), torch.zeros(2, 4), torch.zeros(2, 4), *args)


def test_attention_module_decodes_through_the_compiled_attention_route(compiled, monkeypatch):
    """AAHAttention alone with a LayerKVCache: one ring_decode call per one-token step, equal to the
    masked route and to the forward without a cache."""
    torch.manual_seed(0)
    attn = AAHAttention(32, 4, 2, max_seq_len=32, controller=ControllerConfig(windows=(2, 4, 8), scoring="none"))
    attn.aah_state.pin_windows((2, 8, 4, 2))
    attn.eval()
    x = torch.randn(2, 12, 32)
    calls = []
    kernel_call = compiled.ring_decode
    monkeypatch.setattr(compiled, "ring_decode", lambda *a, **k: calls.append(1) or kernel_call(*a, **k))
    outs, routes = {}, {}
    for kernel in ("1", "0"):
        monkeypatch.setenv("AAH_RING_KERNEL", kernel)
        cache = LayerKVCache(attn.current_windows(32), 2, 8, batch_size=2, max_len=32)
        with torch.no_grad():
            parts = [attn(x[:, :5], cache=cache)] + [attn(x[:, i : i + 1], cache=cache) for i in range(5, 12)]
        outs[kernel], routes[kernel] = torch.cat(parts, dim=1), cache.route
    assert len(calls) == 7  # the decode steps with the kernel on
    assert routes == {"1": "compiled attention", "0": "masked"}
    torch.testing.assert_close(outs["1"], outs["0"], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(outs["1"], attn(x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- whole-block step
VARIANTS = {
    "layernorm_gelu_rope": dict(norm="layernorm", activation="gelu", positional="rope", bias=False),
    "layernorm_relu_learned_bias": dict(norm="layernorm", activation="relu", positional="learned", bias=True),
    "rmsnorm_swiglu_rope_bias": dict(norm="rmsnorm", activation="swiglu", positional="rope", bias=True),
    "rmsnorm_gelu_learned": dict(norm="rmsnorm", activation="gelu", positional="learned", bias=False),
}


def _variant_model(variant: str, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=40, **VARIANTS[variant])
    model = GPT(cfg, ControllerConfig(windows=(2, 4, 8, 40), scoring="none"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() >= 2 else p.uniform_(0.5, 1.5)  # biases and norm weights away from 0, 1
    for ctrl, w in zip(model.controllers(), [(2, 8, 40, 4), (4, 2, 2, 8)], strict=True):
        ctrl.pin_windows(w)
    return model.to(dtype).eval()


@pytest.fixture
def block_calls(compiled, monkeypatch) -> list[int]:
    """One entry per call of the compiled block step (aah.decode.ring_decode.decode_block)."""
    calls: list[int] = []
    block_step = compiled.decode_block
    monkeypatch.setattr(compiled, "decode_block", lambda *a, **k: calls.append(1) or block_step(*a, **k))
    return calls


def decode_both_ways(model: GPT, idx: torch.Tensor, prefix: int, monkeypatch) -> dict[str, torch.Tensor]:
    """Logits of the decode steps after a ``prefix``-token prefill, with the kernel on ("1") and off ("0")."""
    logits = {}
    for kernel in ("1", "0"):
        monkeypatch.setenv("AAH_RING_KERNEL", kernel)
        cache = model.new_cache(idx.shape[0])
        with torch.no_grad():
            model(idx[:, :prefix], cache=cache)
            steps = [model(idx[:, i : i + 1], cache=cache)[0] for i in range(prefix, idx.shape[1])]
        logits[kernel] = torch.cat(steps, dim=1)
    return logits


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_block_step_equals_the_module_path_and_the_full_forward(block_calls, monkeypatch, variant):
    model = _variant_model(variant)
    idx = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(1))
    logits = decode_both_ways(model, idx, 7, monkeypatch)
    assert len(block_calls) == 23 * 2  # every decode step of both blocks, with the kernel only
    torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-5, atol=5e-5)
    with torch.no_grad():
        torch.testing.assert_close(logits["1"], model(idx)[0][:, 7:], rtol=1e-5, atol=5e-5)


def test_bfloat16_block_step_is_as_accurate_as_the_module_path(block_calls, monkeypatch):
    """Against the float32 model with the same (bf16-rounded) weights, both bf16 paths err alike."""
    model = _variant_model("rmsnorm_swiglu_rope_bias", torch.bfloat16)
    reference = _variant_model("rmsnorm_swiglu_rope_bias", torch.bfloat16).float()
    idx = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(idx)[0][:, 5:]
    logits = decode_both_ways(model, idx, 5, monkeypatch)
    assert len(block_calls) == 15 * 2  # the bf16 steps ran the block kernel
    assert logits["1"].dtype == torch.bfloat16
    errors = {kernel: (got.float() - want).abs().mean().item() for kernel, got in logits.items()}
    assert errors["1"] < 1.5 * errors["0"], errors


def test_a_forward_hook_keeps_the_module_path(block_calls):
    model = _variant_model("layernorm_gelu_rope")
    seen = []
    model.blocks[1].mlp.register_forward_hook(lambda *_: seen.append(1))
    cache = model.new_cache(1)
    idx = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(idx[:, :4], cache=cache)
        model(idx[:, 4:5], cache=cache)
    assert len(block_calls) == 1  # block 0 in one call; block 1 runs its modules, so its hook sees the step
    assert seen == [1, 1]


def test_block_step_reads_long_windows_at_head_dim_32(block_calls, monkeypatch):
    """Head dim 32 (the unrolled kernel) and windows past one span of 256 entries, against the module path."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, n_layers=2, d_model=64, n_heads=2, n_kv_heads=1, max_seq_len=640, backend="dense")
    model = GPT(cfg, ControllerConfig(windows=(40, 300, 640), scoring="none"))
    for ctrl, w in zip(model.controllers(), [(300, 640), (640, 40)], strict=True):
        ctrl.pin_windows(w)
    model.eval()
    idx = torch.randint(0, 50, (2, 580), generator=torch.Generator().manual_seed(4))
    logits = decode_both_ways(model, idx, 560, monkeypatch)
    assert len(block_calls) == 20 * 2
    torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-5, atol=5e-5)
    with torch.no_grad():
        torch.testing.assert_close(logits["1"], model(idx)[0][:, 560:], rtol=1e-5, atol=5e-5)


def test_gradients_and_float64_keep_the_module_path(block_calls):
    calls = block_calls
    idx = torch.randint(0, 50, (1, 8), generator=torch.Generator().manual_seed(5))
    model = _variant_model("layernorm_gelu_rope")
    cache = model.new_cache(1)
    with torch.no_grad():
        model(idx[:, :7], cache=cache)
    logits, _ = model(idx[:, 7:], cache=cache)  # gradients on: the modules, so the weights get them
    logits.sum().backward()
    assert calls == [] and model.blocks[0].mlp.up.weight.grad is not None
    model64 = _variant_model("rmsnorm_swiglu_rope_bias", torch.float64)
    cache = model64.new_cache(1, dtype=torch.float64)
    with torch.no_grad():
        model64(idx[:, :7], cache=cache)
        step, _ = model64(idx[:, 7:], cache=cache)
        full, _ = model64(idx)
    assert calls == []  # float64 keeps the module path, at float64 accuracy
    torch.testing.assert_close(step[:, 0], full[:, -1], rtol=1e-10, atol=1e-10)


def test_ring_decode_rejects_rings_outside_the_storage(compiled):
    keys, values, q = torch.zeros(1, 8, 4), torch.zeros(1, 8, 4), torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="every window must be >= 1"):
        compiled.ring_decode(q, keys, values, torch.tensor([0]), torch.tensor([8]), torch.tensor([8, 0]), 3, 0.5)
    with pytest.raises(RuntimeError, match="must lie within the slots"):
        compiled.ring_decode(q, keys, values, torch.tensor([4]), torch.tensor([8]), torch.tensor([8, 8]), 3, 0.5)
    with pytest.raises(RuntimeError, match="capacity >= 1"):
        compiled.ring_decode(q, keys, values, torch.tensor([0]), torch.tensor([0]), torch.tensor([8, 8]), 3, 0.5)
