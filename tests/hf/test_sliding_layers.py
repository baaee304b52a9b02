"""Budgeted calibration of models whose layers have their own sliding window (Qwen3, Mistral):
what each window loses and costs is measured as the patched layer runs it, within the layer's
window and without sinks (aah.hf.bridge.spec.LayerWindows.build)."""

from __future__ import annotations

import itertools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aah import hf  # noqa: E402
from aah.controller.budget import budget_capacity, choose_windows  # noqa: E402
from aah.controller.lost_mass import lost_mass, within_context  # noqa: E402
from aah.hf.calibration.policies import (  # noqa: E402
    budgeted_windows,
    calibrate,
    measure_lost_mass,
    uniform_window_for_budget,
)
from aah.hf.calibration.window_kl import measure_window_kl, window_output_change  # noqa: E402
from aah.hf.evaluation.compare import Setting, uniform_setting  # noqa: E402
from aah.windows import causal_coverage, causal_pairs  # noqa: E402

from ..conftest import reference_attention  # noqa: E402
from .test_patch import VOCAB, _tiny  # noqa: E402

T = 64
CANDS = (8, 16, 32, 64)
SLIDING = 12


def _batches(count: int) -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(s)) for s in range(count)]


def _qwen3_with_a_sliding_layer():
    return _tiny("qwen3", layer_types=["full_attention", "sliding_attention"], sliding_window=SLIDING,
                 use_sliding_window=True, max_window_layers=1)


def test_window_output_change_within_the_layer_window_equals_the_reference():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 40, 8, generator=g)
    k, v = torch.randn(2, 1, 2, 40, 8, generator=g)
    positions = torch.tensor([0, 9, 25, 39])
    windows = (4, 10, 16, 40)
    got = window_output_change(q, k, v, positions, windows, scale=0.4, context=10)
    layer = reference_attention(q, k, v, [10] * 4, scale=0.4)[:, :, positions]
    for c, w in enumerate(windows):
        capped = reference_attention(q, k, v, [min(w, 10)] * 4, scale=0.4)[:, :, positions]
        torch.testing.assert_close(got[:, :, :, c].double(), capped - layer, atol=1e-5, rtol=1e-5)
    assert float(got[:, :, :, 1:].abs().max()) == 0.0  # windows >= the layer's cut nothing it sees
    assert float(got[:, :, :, 0].abs().max()) > 0.0


def test_lost_mass_within_the_layer_window_is_renormalised_and_zero_beyond_it():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 1, 3, 48, 8, generator=g)
    got = lost_mass(q, k, (4, 12, 24, 48), num_queries=8, start=0, scale=0.5, context=12)
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * 0.5
    i, j = torch.arange(48)[:, None], torch.arange(48)[None, :]
    probs = scores.masked_fill(~((j <= i) & (i - j < 12)), float("-inf")).softmax(-1)
    rows = torch.linspace(0, 47, 8).round().long()
    want = [(probs[:, :, rows] * (i[rows] - j >= w)).sum(-1).mean((0, 2)) for w in (4, 12, 24, 48)]
    torch.testing.assert_close(got.double(), torch.stack(want, -1), atol=1e-5, rtol=1e-5)
    assert float(got[:, 1:].abs().max()) == 0.0
    with pytest.raises(ValueError, match="context must be a positive window"):
        within_context(probs, rows, 0)


def test_choose_windows_takes_one_cost_row_per_item():
    lost = torch.tensor([[3.0, 0.0], [3.0, 0.0]])
    # Item 1's long window costs what its short one does: it takes it at no cost.
    assert choose_windows(lost, [[1, 4], [1, 1]], 0.5, 2) == [0, 1]  # capacity 3 pairs
    with pytest.raises(ValueError, match="costs must have 2 entries"):
        choose_windows(lost, [[1, 4, 5]] * 2, 0.5, 1)


def _executed_pairs(windows, layer_windows, sinks):
    return sum(
        causal_pairs(min(w, lw) if lw else w, T, sink_tokens=0 if lw else sinks)
        for row, lw in zip(windows, layer_windows) for w in row
    )


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_budgeted_windows_cost_a_sliding_layer_as_it_runs_and_are_optimal(scope):
    g = torch.Generator().manual_seed(4)
    lost = torch.rand(2, 2, len(CANDS), generator=g).sort(-1, descending=True).values
    lost[..., -1] = 0.0
    layer_windows, sinks, budget = [None, 20], 2, 0.4
    got = budgeted_windows(lost, CANDS, budget, T, sink_tokens=sinks, num_kv_heads=2, granularity="head",
                           scope=scope, layer_windows=layer_windows)
    rows = [[0, 1]] if scope == "model" else [[0], [1]]
    for layers in rows:
        capacity = budget_capacity(budget, 2 * len(layers), T)
        assert _executed_pairs(got[layers].tolist(), [layer_windows[i] for i in layers], sinks) <= capacity
        best = min(
            sum(float(lost[l, h, c]) for (l, h), c in zip(itertools.product(layers, range(2)), choice))
            for choice in itertools.product(range(len(CANDS)), repeat=2 * len(layers))
            if _executed_pairs([[CANDS[c] for c in choice[i * 2:(i + 1) * 2]] for i in range(len(layers))],
                               [layer_windows[i] for i in layers], sinks) <= capacity
        )
        chosen = sum(float(lost[l, h, CANDS.index(int(got[l, h]))]) for l in layers for h in range(2))
        assert chosen == pytest.approx(best)
    with pytest.raises(ValueError, match="layer_windows must name 2 layers"):
        budgeted_windows(lost, CANDS, budget, T, sink_tokens=sinks, layer_windows=[None])


@pytest.mark.parametrize("measure", ["lost_mass", "kl"])
def test_calibrating_a_qwen3_sliding_layer_measures_within_it_and_spends_the_executed_coverage(measure):
    model = _qwen3_with_a_sliding_layer()
    batches = _batches(2)
    if measure == "kl":
        table = measure_window_kl(model, batches, CANDS, sink_tokens=4, num_queries=16)
    else:
        table = measure_lost_mass(model, batches, CANDS, sink_tokens=4)
    assert float(table[1, :, 1:].abs().max()) == 0.0  # 16, 32, 64 cut nothing the layer sees
    assert float(table[1, :, 0].min()) > 0.0 and float(table[0, :, :-1].min()) > 0.0
    windows = calibrate(model, batches, policy="budgeted", budget=0.45, sink_tokens=4, scope="model",
                        measure=measure)
    hf.patch(model, windows, sink_tokens=4)
    try:
        executed = hf.patched_windows(model, effective=True)
    finally:
        hf.unpatch(model)
    # The budget is met by what runs: layer 1 capped at 12 without sinks, layer 0 with its 4 sinks.
    pairs = sum(causal_pairs(int(w), T, sink_tokens=4) for w in executed[0])
    pairs += sum(causal_pairs(int(w), T) for w in executed[1])
    assert pairs <= budget_capacity(0.45, 8, T)
    # Layer 1 costs at most coverage(12) whatever it gets, so layer 0 may exceed 0.45 on its own.
    assert causal_coverage(executed[0], T, sink_tokens=4) > 0.45


def _executed(windows_rows, layer_windows, sinks):
    """Causal coverage of windows as the layers run them (capped, no sinks in a sliding layer)."""
    heads = sum(len(row) for row in windows_rows)
    return _executed_pairs(windows_rows, layer_windows, sinks) / (heads * T * (T + 1) // 2)


def test_executed_coverage_counts_what_each_layer_runs():
    model = _qwen3_with_a_sliding_layer()
    windows = torch.tensor([[8, 16, 32, 64], [8, 16, 32, 64]])
    hf.patch(model, windows, sink_tokens=4)
    try:
        ratio, coverage = hf.executed_coverage(model, T)
    finally:
        hf.unpatch(model)
    assert coverage == pytest.approx(_executed(windows.tolist(), [None, SLIDING], 4))
    # ACR: min(W + S, T) / T in layer 0; min(W, 12) / T, no sinks, in layer 1.
    want = (sum(min(w + 4, T) for w in (8, 16, 32, 64)) + sum(min(w, SLIDING) for w in (8, 16, 32, 64))) / (8 * T)
    assert ratio == pytest.approx(want)
    assert coverage < causal_coverage(windows, T, sink_tokens=4)  # what the requested windows would cost


def test_uniform_policy_and_the_eval_baseline_match_the_executed_coverage():
    model = _qwen3_with_a_sliding_layer()
    layer_windows = [None, SLIDING]
    window = calibrate(model, _batches(1), policy="uniform", budget=0.45, sink_tokens=4)
    w = int(window[0, 0])
    assert torch.equal(window, torch.full((2, 4), w))
    # The largest window whose executed coverage is within the budget, found by brute force.
    fits = [v for v in range(1, T + 1) if _executed([[v] * 4] * 2, layer_windows, 4) <= 0.45]
    assert w == max(fits) and w > uniform_window_for_budget(0.45, T, sink_tokens=4)
    aah = Setting("aah", torch.tensor([[8, 8, 64, 64], [8, 8, 8, 8]]), 4)
    uniform = uniform_setting(model, aah, T)
    target = _executed(aah.windows.tolist(), layer_windows, 4)
    u = int(uniform.windows[0, 0])
    assert _executed([[u] * 4] * 2, layer_windows, 4) <= target < _executed([[u + 1] * 4] * 2, layer_windows, 4)

