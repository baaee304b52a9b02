"""The estimated KL of each head's window (aah.hf.calibration.window_kl) and its use by the budgeted
policy (measure="kl")."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aah.cli import main  # noqa: E402
from aah.controller.features import sample_query_positions  # noqa: E402
from aah.hf.bridge.windows_file import load_windows  # noqa: E402
from aah.hf.calibration.policies import budgeted_windows, calibrate  # noqa: E402
from aah.hf.calibration.window_kl import measure_window_kl, window_output_change  # noqa: E402
from aah.windows import causal_coverage  # noqa: E402

from ..conftest import reference_attention  # noqa: E402
from .test_calibrate import VOCAB, _batches, _error, _llama, tiny_model_dir  # noqa: E402,F401

CANDS = (8, 16, 32, 64)


@pytest.mark.parametrize("heads,kv_heads,sinks", [(4, 4, 0), (4, 2, 3), (6, 2, 0)])
def test_window_output_change_equals_the_float64_reference(heads, kv_heads, sinks):
    g = torch.Generator().manual_seed(1)
    t, d = 40, 8
    q = torch.randn(2, heads, t, d, generator=g)
    k = torch.randn(2, kv_heads, t, d, generator=g)
    v = torch.randn(2, kv_heads, t, d, generator=g)
    positions = torch.tensor([0, 5, 17, 39])
    windows = (1, 6, 16, 40)
    got = window_output_change(q, k, v, positions, windows, scale=0.3, sink_tokens=sinks)
    assert got.shape == (2, heads, 4, 4, d)
    full = reference_attention(q, k, v, [t] * heads, scale=0.3)[:, :, positions]
    for c, w in enumerate(windows):
        windowed = reference_attention(q, k, v, [w] * heads, scale=0.3, sink_tokens=sinks)[:, :, positions]
        torch.testing.assert_close(got[:, :, :, c].double(), windowed - full, atol=1e-5, rtol=1e-5)
    assert float(got[:, :, :, -1].abs().max()) == 0.0  # the full window changes nothing
    assert float(got[:, :, 0].abs().max()) == 0.0  # position 0 sees only itself at every window


def test_sampled_positions_are_even_and_end_at_the_last():
    assert sample_query_positions(64, 4, 0).tolist() == [0, 21, 42, 63]
    assert sample_query_positions(8, 100, 0).tolist() == list(range(8))
    assert sample_query_positions(10, 1, 0).tolist() == [9]


def _reference_terms(model, batch, labels, windows, sinks):
    """(L, H, T, K): dlog p(labels) / d(head output) . (windowed - full output) at every position,
    by an independent route: the gradient at the input of each o_proj, and the float64
    reference attention."""
    from aah.hf.bridge.patch import recording
    from aah.hf.bridge.spec import attention_modules

    inputs, qkv, handles = {}, {}, []
    for layer, block in enumerate(model.model.layers):
        def keep_input(_m, args, layer=layer):
            args[0].retain_grad()
            inputs[layer] = args[0]

        handles.append(block.self_attn.o_proj.register_forward_pre_hook(keep_input))
    modules = attention_modules(model)
    recorders = []
    for layer in range(len(modules)):
        def record(q, k, v, layer=layer):
            qkv[layer] = (q.detach(), k.detach(), v.detach())

        recorders.append(record)
    t = batch.shape[-1]
    with recording(model, modules, recorders, t):
        logits = model(batch, use_cache=False).logits[0, :-1]
        torch.nn.functional.cross_entropy(logits, labels[0], reduction="sum").backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    heads = model.config.num_attention_heads
    out = torch.zeros(len(modules), heads, t, len(windows), dtype=torch.float64)
    for layer, (q, k, v) in qkv.items():
        b, _, _, d = q.shape
        grad = inputs[layer].grad.double().reshape(b, t, heads, d).transpose(1, 2)
        scale = modules[layer].scaling
        full = reference_attention(q, k, v, [t] * heads, scale=scale)
        for c, w in enumerate(windows):
            change = reference_attention(q, k, v, [w] * heads, scale=scale, sink_tokens=sinks) - full
            out[layer, :, :, c] = torch.einsum("bhtd,bhtd->ht", grad, change)
    return out


@pytest.mark.parametrize("sinks", [0, 4])
def test_window_kl_is_half_the_squared_gradient_times_output_change(sinks):
    """1/2 sum_t (g_t . d_t)^2 / N, with T / S standing for each sampled position."""
    model = _llama()
    batch = _batches(1)[0]
    labels = torch.randint(0, VOCAB, (1, 63), generator=torch.Generator().manual_seed(5))
    terms = _reference_terms(model, batch, labels, CANDS, sinks)
    got = measure_window_kl(model, [batch], CANDS, sink_tokens=sinks, num_queries=64, labels=[labels])
    torch.testing.assert_close(got.double(), 0.5 * terms.square().sum(2) / 63, atol=1e-9, rtol=1e-4)
    assert float(got[..., -1].abs().max()) == 0.0 and float(got.min()) >= 0.0
    assert float(got.max()) > 1e-6  # the model does depend on what the windows cut off
    sampled = measure_window_kl(model, [batch], CANDS, sink_tokens=sinks, num_queries=5, labels=[labels])
    positions = sample_query_positions(64, 5, 0)
    expected = 0.5 * terms[:, :, positions].square().sum(2) * (64 / 5) / 63
    torch.testing.assert_close(sampled.double(), expected, atol=1e-9, rtol=1e-4)


def test_window_kl_samples_labels_from_the_model_reproducibly():
    model = _llama()
    batches = _batches(2)
    first = measure_window_kl(model, batches, CANDS, sink_tokens=2, seed=3)
    assert torch.equal(first, measure_window_kl(model, batches, CANDS, sink_tokens=2, seed=3))
    assert not torch.equal(first, measure_window_kl(model, batches, CANDS, sink_tokens=2, seed=4))
    # Averaged per predicted token over the batches.
    labels = [torch.randint(0, VOCAB, (1, 63), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    both = measure_window_kl(model, batches, CANDS, sink_tokens=2, labels=labels)
    single = [measure_window_kl(model, [b], CANDS, sink_tokens=2, labels=[y]) for b, y in zip(batches, labels)]
    torch.testing.assert_close(both, (single[0] + single[1]) / 2)


def test_window_kl_of_an_ignored_head_is_zero_and_weights_stay_untouched():
    model = _llama()
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[:, 8:16] = 0.0  # head 1 of layer 1 is ignored
    flags = [p.requires_grad for p in model.parameters()]
    got = measure_window_kl(model, _batches(1), CANDS, sink_tokens=0, num_queries=16)
    assert float(got[1, 1].abs().max()) == 0.0 and float(got[1, 0].max()) > 0.0
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert model.config._attn_implementation != "aah"  # left unpatched


def test_budgeted_with_the_kl_measure_is_the_knapsack_over_the_estimate():
    model = _llama()
    batches = _batches(2)
    table = measure_window_kl(model, batches, CANDS, sink_tokens=4, seed=1)
    for scope in ("layer", "model"):
        got = calibrate(model, batches, policy="budgeted", budget=0.45, sink_tokens=4, measure="kl", scope=scope,
                        seed=1)
        expected = budgeted_windows(table, CANDS, 0.45, 64, sink_tokens=4, num_kv_heads=2, scope=scope)
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="measure must be one of lost_mass, kl, kl_retrieval; got 'loss'"):
        calibrate(model, batches, policy="budgeted", budget=0.45, measure="loss")


def test_calibrate_command_takes_the_kl_measure(tiny_model_dir, tmp_path, capsys):  # noqa: F811 (the fixture)
    model_dir, corpus = tiny_model_dir
    out = tmp_path / "kl.safetensors"
    base = ["hf", "calibrate", str(model_dir), "--corpus", str(corpus), "--seq-len", "64", "--policy", "budgeted",
            "--budget", "0.5", "--batches", "1"]
    assert main([*base, "--measure", "kl", "--scope", "model", "--out", str(out)]) == 0
    windows, meta = load_windows(out)
    assert meta["measure"] == "kl" and meta["scope"] == "model"
    assert causal_coverage(windows, 64, sink_tokens=4) <= 0.5
    capsys.readouterr()
    assert "--measure must be one of lost_mass, kl, kl_retrieval; got 'mass'" in _error([*base, "--measure", "mass", "--out", "x"],
                                                                          capsys)


def test_the_package_exports_the_calibration_functions():
    import aah.hf
    from aah.hf.bridge import windows_file
    from aah.hf.calibration import policies as calibration
    from aah.hf.calibration import window_kl as loss_estimate

    assert aah.hf.calibrate is calibration.calibrate and callable(aah.hf.calibrate)
    assert aah.hf.measure_window_kl is loss_estimate.measure_window_kl
    assert aah.hf.save_windows is windows_file.save_windows and aah.hf.load_windows is windows_file.load_windows
