"""Sink tokens in every backend against an independent float64 reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

import aah
from aah.backends import backend_takes_sinks, executed_coverage, get_backend
from aah.backends.auto import shape_key
from aah.backends.banded import block_size, planned_entries
from aah.backends.flex import FLEX_BLOCK, band_block_mask
from aah.backends.sinks import sink_span
from aah.backends.strips import strip_entries
from aah.windows import causal_coverage, visible

from ..conftest import reference_attention
from .test_banded_and_flex import _check as check_reference
from .test_banded_and_flex import _qkv

CUDA = torch.cuda.is_available()


def sink_reference(q, k, v, windows, sinks, scale=None):
    """The float64 reference of the test suite with ``sinks`` sink tokens."""
    return reference_attention(q, k, v, windows, scale=scale, sink_tokens=sinks)


def _check(out, q, k, v, windows, sinks, atol, rtol, backward=True):
    check_reference(out, q, k, v, windows, reference_attention, atol, rtol, backward=backward, sink_tokens=sinks)


# (batch, heads, kv heads, length, head dim, windows): MHA and GQA (uniform and uneven
# groups), window 1, small windows, W = T and W > T.
SHAPES = [
    (2, 4, 4, 37, 8, [1, 5, 37, 50]),
    (1, 4, 2, 130, 16, [7, 7, 20, 130]),
    (1, 4, 2, 77, 8, [5, 5, 5, 9]),
    (1, 6, 3, 300, 8, [1, 40, 64, 129, 300, 400]),
]
# S = 0, 1, 4, more than the small windows, and >= T.
SINKS = [0, 1, 4, 24, 400]
CPU_BACKENDS = ["dense", "banded", "strips", "auto"]


@pytest.mark.parametrize("sinks", SINKS)
@pytest.mark.parametrize("b, h, h_kv, t, d, windows", SHAPES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_float64_forward_and_backward_match_reference(backend, b, h, h_kv, t, d, windows, sinks):
    q, k, v = _qkv(b, h, h_kv, t, d)
    out = aah.attend(q, k, v, windows, backend=backend, sink_tokens=sinks)
    _check(out, q, k, v, windows, sinks, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", ["banded", "strips"])
@pytest.mark.parametrize("h_kv", [4, 2])
def test_float32_with_sinks_matches_reference(backend, h_kv):
    q, k, v = _qkv(2, 4, h_kv, 200, 16, dtype=torch.float32)
    out = aah.attend(q, k, v, [3, 50, 200, 17], backend=backend, sink_tokens=4)
    assert out.dtype == torch.float32
    _check(out, q, k, v, [3, 50, 200, 17], 4, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["banded", "strips"])
def test_bfloat16_with_sinks_is_close_to_reference(backend):
    windows, sinks = [4, 16, 64, 64], 4
    q, k, v = _qkv(1, 4, 2, 128, 16, dtype=torch.bfloat16)
    out = aah.attend(q, k, v, windows, backend=backend, sink_tokens=sinks)
    assert out.dtype == torch.bfloat16
    _check(out, q, k, v, windows, sinks, atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("backend", ["banded", "strips"])
def test_custom_scale_with_sinks(backend):
    q, k, v = _qkv(1, 2, 1, 60, 8)
    out = aah.attend(q, k, v, [6, 13], backend=backend, scale=0.37, sink_tokens=3)
    torch.testing.assert_close(out, sink_reference(q, k, v, [6, 13], 3, scale=0.37), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", ["dense", "banded", "strips", "sdpa", "auto"])
def test_zero_sinks_is_the_plain_call(backend, monkeypatch):
    """``sink_tokens=0`` reaches the backend exactly as a call without it (the same path)."""
    windows = [64, 64] if backend == "sdpa" else [3, 20]
    q, k, v = _qkv(1, 2, 2, 64, 8)
    plain = aah.attend(q, k, v, windows, backend=backend)
    seen = []
    impl = get_backend(backend)
    original = impl.attend
    monkeypatch.setattr(impl, "attend", lambda *a, **kw: seen.append(kw) or original(*a, **kw))
    zero = aah.attend(q, k, v, windows, backend=backend, sink_tokens=0)
    assert seen == [{}]
    assert torch.equal(plain, zero)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_sink_tokens_are_validated(bad):
    q, k, v = _qkv(1, 2, 2, 16, 8)
    with pytest.raises(ValueError, match="sink_tokens"):
        aah.attend(q, k, v, [4, 4], sink_tokens=bad)
    with pytest.raises(ValueError, match="sink_tokens"):
        executed_coverage("banded", [4, 4], 16, sink_tokens=bad)


def test_sdpa_takes_sinks_with_full_windows_and_still_rejects_local_ones():
    q, k, v = _qkv(1, 2, 1, 40, 8)
    out = aah.attend(q, k, v, [40, 99], backend="sdpa", sink_tokens=4)
    _check(out, q, k, v, [40, 99], 4, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="full causal attention only"):
        aah.attend(q, k, v, [5, 40], backend="sdpa", sink_tokens=4)
    assert executed_coverage("sdpa", [40, 40], 40, sink_tokens=4) == 1.0


def test_sink_span():
    assert sink_span(10, 100, 4) == 4
    assert sink_span(10, 100, 0) == 0
    assert sink_span(98, 100, 4) == 2  # only queries 98, 99 miss a sink: keys 0 and 1
    assert sink_span(100, 100, 4) == 0
    assert sink_span(1, 5, 50) == 4


# ---------------------------------------------------------------- coverage


@pytest.mark.parametrize("w, t, s", [(7, 100, 3), (64, 300, 4), (1, 50, 49), (50, 50, 4), (20, 30, 40)])
def test_banded_and_strips_coverage_add_the_sink_block(w, t, s):
    triangle = t * (t + 1) / 2
    extra = (t - w) * sink_span(w, t, s) if w < t else 0
    banded = executed_coverage("banded", [w], t, sink_tokens=s)
    assert banded == pytest.approx((planned_entries(min(w, t), t, block_size(min(w, t), t)) + extra) / triangle)
    strips = executed_coverage("strips", [w], t, sink_tokens=s)
    assert strips == pytest.approx(strip_entries(w, t, sink_tokens=s) / triangle)
    # Every allowed pair is computed; without sinks the figures are those of before.
    ideal = causal_coverage([w], t, sink_tokens=s)
    assert banded >= ideal - 1e-12 and strips >= ideal - 1e-12
    assert executed_coverage("banded", [w], t, sink_tokens=0) == executed_coverage("banded", [w], t)


def test_dense_coverage_ignores_sinks():
    assert executed_coverage("dense", [3, 9], 64, sink_tokens=4) == executed_coverage("dense", [3, 9], 64)


# ---------------------------------------------------------------- flex


@pytest.mark.parametrize(
    "t, windows, sinks",
    [(300, [1, 5, 300, 64, 129, 128, 127, 400], 4), (256, [128, 1, 256, 3], 130), (1000, [200, 513, 7, 1000], 1)],
)
def test_flex_block_mask_with_sinks_matches_create_block_mask(t, windows, sinks):
    from torch.nn.attention.flex_attention import create_block_mask

    ours = band_block_mask(tuple(windows), t, "cpu", sink_tokens=sinks)
    w = torch.tensor(windows)
    built = create_block_mask(
        lambda b, h, q, kv: visible(q, kv, w[h], sinks), None, len(windows), t, t, device="cpu"
    )
    assert torch.equal(ours.kv_num_blocks, built.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, built.full_kv_num_blocks)
    assert torch.equal(ours.to_dense(), built.to_dense())
    tiles = built.to_dense()[0].bool()
    sizes = torch.clamp(t - torch.arange(tiles.shape[-1]) * FLEX_BLOCK, max=FLEX_BLOCK)
    pairs = int((tiles * (sizes[:, None] * sizes[None, :])).sum())
    expected = pairs / (len(windows) * t * (t + 1) / 2)
    assert executed_coverage("flex", windows, t, sink_tokens=sinks) == pytest.approx(expected)


@pytest.mark.slow
def test_flex_cpu_forward_with_sinks_matches_reference():
    if get_backend("flex").unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(get_backend("flex").unavailable_reason(torch.device("cpu")))
    windows = [1, 5, 300, 64, 129, 128, 127, 400]
    q, k, v = _qkv(2, 8, 4, 300, 16, dtype=torch.float32)
    with torch.no_grad():
        for sinks in (0, 1, 4, 150, 300):
            out = aah.attend(q, k, v, windows, backend="flex", sink_tokens=sinks)
            _check(out, q, k, v, windows, sinks, atol=2e-5, rtol=1e-4, backward=False)


# ---------------------------------------------------------------- flash and auto


def _fake_flash_attn_func(q, k, v, softmax_scale, causal, window_size, return_attn_probs=False):
    """flash-attn's ``flash_attn_func`` contract written out densely, differentiable: (B, T, H, D)
    tensors, grouped-query KV heads, keys ``i - left <= j <= i`` (``left = -1``: all), and with
    ``return_attn_probs`` the log-sum-exp (B, H, T) of the scaled scores."""
    assert causal
    t, h = q.shape[1], q.shape[2]
    k, v = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * softmax_scale
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    left = window_size[0]
    allowed = (j <= i) & ((j >= i - left) if left >= 0 else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)
    return (out, torch.logsumexp(scores, -1), None) if return_attn_probs else out


@pytest.mark.parametrize("sinks", [0, 1, 4, 24, 400])
@pytest.mark.parametrize("b, h, h_kv, t, d, windows", SHAPES)
def test_flash_with_sinks_matches_reference_through_flash_attn_contract(monkeypatch, b, h, h_kv, t, d, windows, sinks):
    """The sink merge and the log-sum-exp gradient of the flash backend, forward and backward, with
    flash-attn replaced by a float64 implementation of its public contract (flash needs CUDA)."""
    import aah.backends.flash as flash_module

    monkeypatch.setattr(flash_module, "_flash_attn_func", lambda: _fake_flash_attn_func)
    monkeypatch.setattr(flash_module, "_FLASH_DTYPES", (torch.float64,))
    q, k, v = _qkv(b, h, h_kv, t, d)
    out = get_backend("flash").attend(q, k, v, tuple(windows), d**-0.5, sinks)
    _check(out, q, k, v, windows, sinks, atol=1e-10, rtol=1e-10)


def test_flash_takes_sinks():
    flash = get_backend("flash")
    assert flash.supports_sink_tokens and backend_takes_sinks("flash", [8, 64], 64, 4)
    assert executed_coverage("flash", [8, 64], 64, sink_tokens=4) == pytest.approx(
        causal_coverage([8, 64], 64, sink_tokens=4)
    )
    assert executed_coverage("flash", [64, 64], 64, sink_tokens=4) == pytest.approx(1.0)
    assert backend_takes_sinks("auto", [8, 64], 64, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("h_kv", [4, 2])
def test_flash_cuda_with_sinks_matches_reference(h_kv):
    reason = get_backend("flash").unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    windows, sinks = [1, 100, 300, 64], 4
    q, k, v = _qkv(2, 4, h_kv, 300, 64, dtype=torch.bfloat16, device="cuda")
    out = aah.attend(q, k, v, windows, backend="flash", sink_tokens=sinks)
    _check(out, q, k, v, windows, sinks, atol=3e-2, rtol=3e-2)


def test_auto_shape_key_names_sinks_only_when_there_are_some():
    q, k, _ = _qkv(1, 4, 2, 64, 8)
    plain = shape_key(q, k, (8, 64, 64, 8), True)
    assert shape_key(q, k, (8, 64, 64, 8), True, 0) == plain
    assert shape_key(q, k, (8, 64, 64, 8), True, 4) == plain.replace("|fwd+bwd", "|S4|fwd+bwd")


def test_auto_leaves_out_backends_without_sinks(monkeypatch):
    from aah.backends import auto

    monkeypatch.setitem(auto._CANDIDATES, "cpu", ("flash", "strips", "banded"))
    monkeypatch.setattr(type(get_backend("flash")), "unavailable_reason", lambda self, device: None)
    cpu = torch.device("cpu")
    assert auto.candidates(cpu, torch.bfloat16, (8, 64), 64, False) == ["flash", "strips", "banded"]
    assert auto.candidates(cpu, torch.bfloat16, (8, 64), 64, False, 4) == ["flash", "strips", "banded"]
    monkeypatch.setattr(type(get_backend("flash")), "supports_sink_tokens", False)  # a backend without sinks
    assert auto.candidates(cpu, torch.bfloat16, (8, 64), 64, False, 4) == ["strips", "banded"]
    assert auto.candidates(cpu, torch.bfloat16, (64, 64), 64, False, 4)[0] == "flash"


# ---------------------------------------------------------------- Hugging Face bridge


def test_hf_unpadded_prompt_with_sinks_runs_through_attend(monkeypatch):
    from aah.hf.bridge import attention as patching
    from aah.hf.bridge.spec import LayerWindows

    calls = []
    original = patching.attend
    monkeypatch.setattr(patching, "attend", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    spec = LayerWindows((3, 9, 9, 40), (3, 9, 9, 40), 2, "banded")
    q, k, v = _qkv(1, 4, 2, 40, 8)
    out = patching.attend_without_cache(q, k, v, None, None, spec)
    assert calls and calls[0]["sink_tokens"] == 2 and calls[0]["backend"] == "banded"
    _check(out, q, k, v, [3, 9, 9, 40], 2, atol=1e-10, rtol=1e-10)
    # A backend without sinks keeps the exact masked SDPA path.
    calls.clear()
    monkeypatch.setattr(type(get_backend("flash")), "supports_sink_tokens", False)
    flash_spec = LayerWindows((3, 9, 9, 40), (3, 9, 9, 40), 2, "flash")
    out = patching.attend_without_cache(q, k, v, None, None, flash_spec)
    assert not calls
    _check(out, q, k, v, [3, 9, 9, 40], 2, atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["banded", "flex", "dense"])
@pytest.mark.parametrize("h_kv", [4, 2])
def test_cuda_forward_and_backward_with_sinks(backend, h_kv):
    reason = get_backend(backend).unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    windows = [1, 100, 300, 64]
    q, k, v = _qkv(2, 4, h_kv, 300, 32, dtype=torch.float32, device="cuda")
    for sinks in (1, 4, 150, 300):
        out = aah.attend(q, k, v, windows, backend=backend, sink_tokens=sinks)
        _check(out, q, k, v, windows, sinks, atol=2e-4, rtol=1e-3)


# ---------------------------------------------------------------- benchmark


def test_bench_attention_with_sinks_counts_them(capsys):
    from aah.bench.attention import bench_attention
    from aah.cli import main

    result = bench_attention(
        seq_len=64, heads=4, backends=["banded", "strips"], sink_tokens=4, repeats=1, warmup=0, device="cpu"
    )
    assert result["config"]["sink_tokens"] == 4
    rows = {row["backend"]: row for row in result["results"]}
    wins = result["config"]["windows"]
    assert rows["banded"]["causal_coverage"] == pytest.approx(causal_coverage(wins, 64, sink_tokens=4))
    assert rows["strips"]["executed_coverage"] == pytest.approx(executed_coverage("strips", wins, 64, sink_tokens=4))
    assert rows["sdpa"]["causal_coverage"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="--sink-tokens"):
        bench_attention(seq_len=64, heads=4, backends=["banded"], sink_tokens=-1, device="cpu")
    assert main(["bench", "attention", "--seq-len", "64", "--heads", "4", "--backends", "banded",
                 "--repeats", "1", "--warmup", "0", "--device", "cpu", "--sink-tokens", "4"]) == 0
    assert "4 sink tokens" in capsys.readouterr().out
