"""The ``strips`` backend and ``backend="auto"`` against the float64 reference; auto's cache."""

from __future__ import annotations

import json

import pytest
import torch

import aah
from aah.backends import auto as auto_mod
from aah.backends import executed_coverage, resolve_backend
from aah.backends.strips import strip_attention, strip_block, strip_entries
from aah.windows import causal_pairs

from ..conftest import reference_attention
from .test_banded_and_flex import CASES, _check, _qkv, check_low_precision

# Windows not multiples of the block, T not a multiple of the block, T - W not a
# multiple of the block (padded last chunk), W = 1, W = T - 1, W >= T, GQA.
STRIP_CASES = CASES + [
    (1, 2, 2, 200, 8, [37, 150]),
    (2, 4, 1, 129, 8, [1, 128, 64, 65]),
    (1, 2, 2, 300, 32, [299, 100]),
]


@pytest.mark.parametrize("b, h, h_kv, t, d, windows", STRIP_CASES)
def test_strips_float64_matches_reference(ref_attention, b, h, h_kv, t, d, windows):
    q, k, v = _qkv(b, h, h_kv, t, d)
    out = aah.attend(q, k, v, windows, backend="strips")
    _check(out, q, k, v, windows, ref_attention, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("b, h, h_kv, t, d, windows", STRIP_CASES[:5])
def test_strips_float32_matches_reference(ref_attention, b, h, h_kv, t, d, windows):
    q, k, v = _qkv(b, h, h_kv, t, d, dtype=torch.float32)
    out = aah.attend(q, k, v, windows, backend="strips")
    assert out.dtype == torch.float32
    _check(out, q, k, v, windows, ref_attention, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block", [1, 3, 16, 40, 200])
def test_strips_any_block_is_exact(ref_attention, block):
    q, k, v = _qkv(2, 4, 2, 150, 8)
    out = strip_attention(q, k, v, 24, 8 ** -0.5, block=block)
    _check(out, q, k, v, [24] * 4, ref_attention, atol=1e-10, rtol=1e-10)


def test_strips_bfloat16_gradients_match_float64_reference(ref_attention):
    q, k, v = _qkv(2, 4, 2, 90, 16)
    check_low_precision(q, k, v, [6, 6, 33, 90], "strips", torch.bfloat16, ref_attention)


def test_strips_custom_scale(ref_attention):
    q, k, v = _qkv(1, 2, 1, 40, 8)
    out = aah.attend(q, k, v, [6, 40], backend="strips", scale=0.3)
    torch.testing.assert_close(out, ref_attention(q, k, v, [6, 40], scale=0.3))


def test_strips_refuses_cuda_with_a_reason():
    from aah.backends import get_backend

    reason = get_backend("strips").unavailable_reason(torch.device("cuda"))
    assert reason is not None and "CPU" in reason


@pytest.mark.parametrize("window, t", [(1, 37), (5, 37), (24, 150), (37, 200), (128, 1024), (99, 100), (300, 100)])
def test_strip_coverage_counts_the_kernel_calls_by_brute_force(window, t):
    # Rebuild what the two kernel calls compute as a boolean matrix over the
    # (padded) sequence: the causal prefix triangle and each chunk's strip.
    w = min(window, t)
    if w >= t:
        assert executed_coverage("strips", [window], t) == 1.0
        return
    b = strip_block(w, t)
    chunks = -(-(t - w) // b)
    size = w + chunks * b
    computed = torch.zeros(size, size + b, dtype=torch.int32)
    computed[:w, :w] += torch.ones(w, w, dtype=torch.int32).tril()
    for c in range(chunks):
        rows = slice(w + c * b, w + (c + 1) * b)
        computed[rows, 1 + c * b : 1 + c * b + w - 1 + b] += 1
    assert int(computed.max()) == 1, "an entry is computed twice"
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    band = (j <= i) & (j > i - w)
    assert bool(computed[:t, :t][band].all()), "a band entry is not computed"
    entries = int(computed.sum())
    assert entries == strip_entries(w, t)
    assert executed_coverage("strips", [window], t) == pytest.approx(entries / (t * (t + 1) / 2))
    assert entries >= causal_pairs(w, t)


def test_strip_block_choice():
    assert [strip_block(w, 4096) for w in (8, 128, 256, 512, 1024, 2048)] == [8, 32, 64, 128, 128, 128]
    assert [strip_block(w, 128) for w in (4, 16, 24, 32, 64)] == [4, 16, 24, 32, 32]
    assert strip_block(100, 110) == 10  # never more rows than the queries after the prefix


# ---------------------------------------------------------------- auto


@pytest.fixture
def fresh_auto(tmp_path, monkeypatch):
    monkeypatch.setenv("AAH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AAH_AUTO_CALIBRATE", raising=False)
    auto_mod._forget()
    yield tmp_path
    auto_mod._forget()


@pytest.fixture
def calibrations(monkeypatch):
    """The candidate lists ``auto`` times, one entry per timing it runs."""
    calls = []
    real = auto_mod._calibrate

    def counting(names, *args):
        calls.append(tuple(names))
        return real(names, *args)

    monkeypatch.setattr(auto_mod, "_calibrate", counting)
    return calls


def test_auto_resolves_to_itself_on_cpu_and_is_exact(ref_attention, fresh_auto):
    assert resolve_backend("auto", "cpu", needs_backward=True) == "auto"
    q, k, v = _qkv(2, 4, 2, 70, 8)
    out = aah.attend(q, k, v, [5, 5, 33, 70], backend="auto")
    _check(out, q, k, v, [5, 5, 33, 70], ref_attention, atol=1e-10, rtol=1e-10)


def test_auto_calibrates_once_per_shape_and_caches_on_disk(fresh_auto, calibrations):
    calls = calibrations
    q, k, v = _qkv(1, 4, 4, 64, 8, dtype=torch.float32)
    aah.attend(q, k, v, [8, 8, 16, 64], backend="auto")
    aah.attend(q, k, v, [8, 8, 16, 64], backend="auto")  # same shape: no new timing
    assert calls == [("strips", "banded")]
    aah.attend(q, k, v, [8, 16, 16, 64], backend="auto")  # same window set: same key
    assert len(calls) == 1
    with torch.no_grad():
        aah.attend(q, k, v, [8, 8, 16, 64], backend="auto")  # forward only: a new key
    assert len(calls) == 2
    choices = auto_mod.auto_choices()
    assert set(choices.values()) <= {"strips", "banded"} and len(choices) == 2
    key = "cpu|float32|B1|H4|KV4|T64|D8|W8,16,full|fwd+bwd"
    assert key in choices
    disk = json.loads((fresh_auto / "backend_choices.json").read_text())
    entry = next(e for name, e in disk.items() if name.endswith(key))
    assert entry["backend"] == choices[key]
    assert set(entry["median_ms"]) == {"strips", "banded"}
    assert min(entry["median_ms"], key=entry["median_ms"].get) == entry["backend"]
    # A new process (the in-memory choices dropped) reads the file instead of timing.
    auto_mod._forget()
    aah.attend(q, k, v, [8, 8, 16, 64], backend="auto")
    assert len(calls) == 2
    assert auto_mod.auto_label(["auto"]) == f"auto({choices[key]})"


def test_auto_length_buckets_are_eight_per_octave():
    assert [auto_mod.length_bucket(n) for n in (5, 16, 17, 64, 65, 4080, 4096, 4097, 8179, 8182)] == [
        5, 16, 18, 64, 72, 4096, 4096, 4608, 8192, 8192]


def test_auto_prompts_of_nearby_lengths_share_one_timing(fresh_auto, calibrations):
    calls = calibrations
    with torch.no_grad():
        for t, b in ((61, 1), (64, 1), (63, 1)):  # one bucket; the last window covers each length
            q, k, v = _qkv(b, 4, 2, t, 8, dtype=torch.float32)
            out = aah.attend(q, k, v, [8, 8, 16, 100], backend="auto")
            torch.testing.assert_close(out, aah.attend(q, k, v, [8, 8, 16, 100], backend="dense"))
        assert len(calls) == 1
        q, k, v = _qkv(2, 4, 2, 64, 8, dtype=torch.float32)  # batch 2: its own bucket
        aah.attend(q, k, v, [8, 8, 16, 100], backend="auto")
        assert len(calls) == 2
        q, k, v = _qkv(3, 4, 2, 64, 8, dtype=torch.float32)  # batch 3 rounds up to 4: new
        aah.attend(q, k, v, [8, 8, 16, 100], backend="auto")
        q, k, v = _qkv(4, 4, 2, 64, 8, dtype=torch.float32)  # batch 4 shares it
        aah.attend(q, k, v, [8, 8, 16, 100], backend="auto")
        assert len(calls) == 3
        q, k, v = _qkv(1, 4, 2, 80, 8, dtype=torch.float32)  # 80 -> 80: another bucket
        aah.attend(q, k, v, [8, 8, 16, 100], backend="auto")
        assert len(calls) == 4


def test_auto_does_not_reuse_a_choice_that_cannot_run_this_length(fresh_auto, monkeypatch):
    """A bucket holds lengths at which other backends are candidates: a window of 62 covers a
    sequence of 61 (``sdpa`` may run it) but not one of 63, so the two must not share ``sdpa``."""
    q61, k61, _ = _qkv(1, 2, 2, 61, 8, dtype=torch.float32)
    q, k, v = _qkv(1, 2, 2, 63, 8, dtype=torch.float32)
    assert auto_mod.shape_key(q61, k61, (62, 62), False) != auto_mod.shape_key(q, k, (62, 62), False)
    # Even a choice cached under this very key is taken only if it can run the request.
    monkeypatch.setattr(auto_mod, "_choices", {auto_mod.shape_key(q, k, (62, 62), False): "sdpa"})
    monkeypatch.setenv("AAH_AUTO_CALIBRATE", "0")
    with torch.no_grad():
        out = aah.attend(q, k, v, [62, 62], backend="auto")
    assert auto_mod.auto_choices()[auto_mod.shape_key(q, k, (62, 62), False)] == "strips"
    torch.testing.assert_close(out, aah.attend(q, k, v, [62, 62], backend="dense"))


def test_auto_uses_the_cached_choice_from_disk(fresh_auto, monkeypatch):
    q, k, v = _qkv(1, 2, 2, 32, 8, dtype=torch.float32)
    key = auto_mod._machine_key(auto_mod.shape_key(q, k, (4, 32), True))
    (fresh_auto / "backend_choices.json").write_text(json.dumps({key: {"backend": "banded"}}))
    monkeypatch.setattr(auto_mod, "_calibrate", lambda *a: pytest.fail("calibrated despite the cache"))
    aah.attend(q, k, v, [4, 32], backend="auto")
    assert list(auto_mod.auto_choices().values()) == ["banded"]
    assert executed_coverage("auto", [4, 32], 32) == executed_coverage("banded", [4, 32], 32)


def test_auto_without_calibration_takes_the_first_candidate(fresh_auto, monkeypatch):
    monkeypatch.setenv("AAH_AUTO_CALIBRATE", "0")
    q, k, v = _qkv(1, 2, 2, 32, 8, dtype=torch.float32)
    aah.attend(q, k, v, [4, 32], backend="auto")
    assert list(auto_mod.auto_choices().values()) == ["strips"]
    assert not (fresh_auto / "backend_choices.json").exists()


def test_auto_candidates_are_exact_backends_that_can_run():
    cpu = torch.device("cpu")
    assert auto_mod.candidates(cpu, torch.float32, (4, 32), 32, True) == ["strips", "banded"]
    assert auto_mod.candidates(cpu, torch.float32, (32, 40), 32, True) == ["strips", "banded", "sdpa"]


@pytest.mark.parametrize("windows, sinks, length", [
    ((4, 4, 64, 64, 9, 1), 0, 64),
    ((16, 16, 3, 3, 40, 40), 5, 61),  # a length that leaves a partial last chunk
    ((200, 7, 7, 7, 20, 20), 3, 90),  # a window past the length: plain causal heads
], ids=["no_sinks", "sinks_partial_chunk", "window_past_length"])
def test_strip_attention_lse_gives_the_reference_output_and_log_sum_exp(windows, sinks, length):
    """The forward-only entry point kept keys join through: its output and its log-sum-exp of the
    scaled scores each query reads, against float64 (GQA: three KV heads for six query heads)."""
    from aah.backends.strips import strip_attention_lse
    from aah.windows import visible

    torch.manual_seed(5)
    q, k, v = torch.randn(2, 6, length, 16), torch.randn(2, 3, length, 16), torch.randn(2, 3, length, 16)
    out, lse = strip_attention_lse(q, k, v, windows, 0.3, sink_tokens=sinks)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, windows, 0.3, sinks), atol=1e-5, rtol=1e-5)
    scores = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.3
    pos = torch.arange(length)
    allowed = visible(pos[:, None], pos[None, :], torch.tensor(windows)[:, None, None], sinks)
    expected = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), expected, atol=1e-5, rtol=1e-5)
