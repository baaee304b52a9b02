"""Named regimes, configuration errors, and the small GPT around the AAH attention module."""

from __future__ import annotations

import math

import pytest
import torch

from aah import GPT, AAHAttention, GPTConfig, regimes
from aah.controller import ControllerConfig, HeadController

VOCAB, LAYERS, D_MODEL, HEADS, T = 64, 2, 32, 4, 32


def small_config(**overrides) -> GPTConfig:
    base = dict(vocab_size=VOCAB, n_layers=LAYERS, d_model=D_MODEL, n_heads=HEADS, max_seq_len=T)
    base.update(overrides)
    return GPTConfig(**base)


def tokens(seed: int, batch: int = 2, length: int = T) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def train(model: GPT, steps: int, lr: float = 0.05) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        model.set_step(step)
        idx = tokens(step)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------- regimes


@pytest.mark.parametrize("name", regimes.names())
def test_every_regime_trains_a_small_gpt_with_finite_loss_and_gradients(name):
    torch.manual_seed(0)
    model = GPT(small_config(), regimes.get(name, control_warmup=1, control_interval=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        model.set_step(step)
        idx = tokens(step)
        logits, loss = model(idx[:, :-1], idx[:, 1:])
        assert logits.shape == (2, T - 1, VOCAB)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        for pname, p in model.named_parameters():
            assert p.grad is not None, pname
            assert torch.isfinite(p.grad).all(), pname
        opt.step()
    ctrls = model.controllers()
    if name == "full_attention":
        assert ctrls == []
    else:
        assert len(ctrls) == LAYERS
        expected_updates = 0 if name == "control_off" else 3  # steps 1, 2, 3
        assert [int(c.num_updates) for c in ctrls] == [expected_updates] * LAYERS
    windows = model.aah_windows()
    assert windows.shape == (LAYERS, HEADS)
    assert set(windows.flatten().tolist()) <= {4, 8, 16, 32}


def test_principal_regimes_come_first_and_every_regime_is_described():
    names = regimes.names()
    assert names[:5] == [
        "full_attention",
        "grouping_off",
        "full_adaptive",
        "shallow_freeze",
        "deep_practical_reuse",
    ]
    assert len(names) == len(set(names))
    for name in names:
        record = regimes.describe(name)
        assert record.name == name and record.description and record.paper_row


def test_regimes_share_the_paper_protocol_values():
    for name in regimes.names():
        cfg = regimes.get(name)
        if not cfg.enabled:
            continue
        assert cfg.control_warmup == 100
        assert cfg.control_interval == (10 if name == "shallow_control_interval_10" else 5)
        assert cfg.feature_ema == (0.0 if name == "no_feature_ema" else 0.9)
        assert cfg.resolution_ema == 0.15
    adaptive = regimes.get("full_adaptive")
    assert (adaptive.hierarchy, adaptive.topology, adaptive.scoring) == (
        (2, 2, 2, 2),
        "adaptive",
        "joint",
    )
    assert (adaptive.level0_threshold, adaptive.upper_threshold, adaptive.norm_penalty) == (
        0.72,
        0.76,
        16.0,
    )
    assert regimes.get("shallow_freeze").hierarchy == (2,)
    assert regimes.get("deep_practical_reuse").topology == "reuse_level0"
    assert regimes.get("full_attention").enabled is False


def test_unknown_regime_error_lists_the_known_names():
    with pytest.raises(ValueError) as err:
        regimes.get("fully_adaptive")
    message = str(err.value)
    assert "fully_adaptive" in message
    for name in regimes.names():
        assert name in message
    with pytest.raises(ValueError, match="known regimes"):
        regimes.describe("nope")


def test_unknown_override_names_the_setting_and_the_known_ones():
    with pytest.raises(ValueError, match=r"control_intervall.*known:.*control_interval"):
        regimes.get("full_adaptive", control_intervall=3)


@pytest.mark.parametrize(
    "field, value",
    [
        ("control_interval", 0),
        ("control_warmup", -1),
        ("windows", (8, 4)),
        ("windows", (4, 4, 8)),
        ("windows", ()),
        ("windows", (0, 4)),
        ("scoring", "learned"),
        ("topology", "sometimes"),
        ("grouping", "pca"),
        ("upper_levels", "copy"),
        ("diagnostics_context", "window"),
        ("feature_ema", 1.0),
        ("resolution_ema", -0.1),
        ("hierarchy", (1,)),
        ("hierarchy", ()),
        ("max_depth", 0),
        ("min_window", 0),
        ("fixed_window_index", -1),
        ("diagnostic_queries", 0),
        ("norm_eps", 0.0),
    ],
)
def test_controller_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^controller\.{field}: "):
        ControllerConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"^controller\.{field}: "):
        regimes.get("full_adaptive", **{field: value})


def test_controller_rejects_windows_it_cannot_execute():
    with pytest.raises(ValueError, match="controller.windows"):
        HeadController(4, ControllerConfig(windows=(8, 64)), max_seq_len=32)
    with pytest.raises(ValueError, match="controller.fixed_window_index"):
        HeadController(4, ControllerConfig(scoring="fixed", fixed_window_index=4), max_seq_len=32)


def test_default_candidates_are_the_paper_ladder_of_the_max_length():
    ctrl = HeadController(4, ControllerConfig(), max_seq_len=4096)
    assert ctrl.candidates == (512, 1024, 2048, 4096)
    assert ctrl.min_window == 512
    assert ctrl.resolution_index.tolist() == [3] * 4


# ---------------------------------------------------------------------- attention = standard MHA


def reference_mha(x, attn: AAHAttention, rotate=None):
    """Causal MHA written out with the module's own projection weights, in float64."""
    b, t, _ = x.shape
    h, h_kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    w = attn.qkv.weight.double()
    bias = attn.qkv.bias.double() if attn.qkv.bias is not None else 0.0
    proj = x.double() @ w.T + bias
    q = proj[..., : h * d].view(b, t, h, d).transpose(1, 2)
    k = proj[..., h * d : (h + h_kv) * d].view(b, t, h_kv, d).transpose(1, 2)
    v = proj[..., (h + h_kv) * d :].view(b, t, h_kv, d).transpose(1, 2)
    if rotate is not None:
        q, k = rotate(q), rotate(k)
    k = k.repeat_interleave(h // h_kv, dim=1)
    v = v.repeat_interleave(h // h_kv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    y = y.transpose(1, 2).reshape(b, t, h * d)
    out_bias = attn.out.bias.double() if attn.out.bias is not None else 0.0
    return y @ attn.out.weight.double().T + out_bias


def rotary_reference(x, base=10000.0):
    """Rotate-half rotary: pair (i, i + D/2) turned by t * base^(-2i/D)."""
    t, d = x.shape[2], x.shape[3]
    half = d // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    theta = torch.arange(t, dtype=torch.float64)[:, None] * freqs[None, :]
    cos, sin = theta.cos(), theta.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def test_attention_without_controller_is_standard_causal_mha():
    torch.manual_seed(0)
    attn = AAHAttention(D_MODEL, HEADS, max_seq_len=16, rope=False, bias=True)
    x = torch.randn(2, 11, D_MODEL)
    assert attn.aah_state is None
    out = attn(x)
    torch.testing.assert_close(out.double(), reference_mha(x, attn), atol=1e-5, rtol=1e-5)
    assert attn.last_windows == (11,) * HEADS


def test_rotary_attention_matches_an_independent_rotary_reference():
    torch.manual_seed(1)
    attn = AAHAttention(D_MODEL, HEADS, max_seq_len=16)
    x = torch.randn(2, 16, D_MODEL)
    torch.testing.assert_close(
        attn(x).double(), reference_mha(x, attn, rotary_reference), atol=1e-5, rtol=1e-5
    )


def test_grouped_query_attention_without_controller_matches_the_reference():
    torch.manual_seed(2)
    attn = AAHAttention(D_MODEL, HEADS, 2, max_seq_len=16, rope=False)
    assert attn.qkv.out_features == (HEADS + 2 * 2) * (D_MODEL // HEADS)
    x = torch.randn(2, 9, D_MODEL)
    torch.testing.assert_close(attn(x).double(), reference_mha(x, attn), atol=1e-5, rtol=1e-5)


def test_full_attention_regime_is_attention_without_a_controller():
    attn = AAHAttention(D_MODEL, HEADS, max_seq_len=16, controller=regimes.get("full_attention"))
    assert attn.aah_state is None
    model = GPT(small_config(), regimes.get("full_attention"))
    assert model.controllers() == []
    assert model.aah_windows().tolist() == [[T] * HEADS] * LAYERS


def test_controlled_attention_at_full_windows_equals_standard_attention():
    torch.manual_seed(3)
    plain = AAHAttention(D_MODEL, HEADS, max_seq_len=T, rope=False)
    controlled = AAHAttention(
        D_MODEL, HEADS, max_seq_len=T, rope=False, controller=regimes.get("full_adaptive")
    )
    controlled.load_state_dict(plain.state_dict(), strict=False)
    controlled.set_step(0)  # inside the 100-step warmup: full windows
    x = torch.randn(2, T, D_MODEL)
    out = controlled(x)
    assert controlled.last_windows == (T,) * HEADS
    torch.testing.assert_close(out.double(), reference_mha(x, plain), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- model


def test_backbone_weights_are_identical_between_full_attention_and_full_adaptive():
    torch.manual_seed(7)
    full = GPT(small_config(), regimes.get("full_attention"))
    rng_full = torch.random.get_rng_state()
    torch.manual_seed(7)
    aah = GPT(small_config(), regimes.get("full_adaptive"))
    assert torch.equal(torch.random.get_rng_state(), rng_full)
    a, b = dict(full.named_parameters()), dict(aah.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_scorer_buffers_differ_by_layer_and_repeat_across_builds():
    cfg = regimes.get("full_adaptive")
    torch.manual_seed(0)
    first = GPT(small_config(), cfg)
    torch.manual_seed(1)  # the backbone seed does not enter the scorers
    second = GPT(small_config(), cfg)
    names = [n for n, _ in first.controllers()[0].named_buffers() if "scorer" in n]
    assert len(names) == 8
    for name in names:
        layer0 = dict(first.controllers()[0].named_buffers())[name]
        layer1 = dict(first.controllers()[1].named_buffers())[name]
        assert not torch.equal(layer0, layer1), name
        for c1, c2 in zip(first.controllers(), second.controllers()):
            assert torch.equal(dict(c1.named_buffers())[name], dict(c2.named_buffers())[name]), name
    reseeded = GPT(small_config(), cfg.replace(seed=1))
    assert not torch.equal(
        reseeded.controllers()[0].base_scorer.weight0, first.controllers()[0].base_scorer.weight0
    )


def _fresh_run(seed: int):
    torch.manual_seed(seed)
    model = GPT(small_config(), regimes.get("full_adaptive", control_warmup=1, control_interval=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    windows = []
    for step in range(4):
        model.set_step(step)
        idx = tokens(step)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        windows.append(model.aah_windows())
    model.eval()
    with torch.no_grad():
        logits, _ = model(tokens(99))
    return torch.stack(windows), logits


def test_same_seed_gives_identical_windows_and_outputs():
    w1, out1 = _fresh_run(5)
    w2, out2 = _fresh_run(5)
    assert torch.equal(w1, w2)
    assert torch.equal(out1, out2)
    _, out3 = _fresh_run(6)
    assert not torch.equal(out1, out3)


def test_aah_windows_and_coverage_follow_the_executed_windows():
    model = GPT(small_config(), regimes.get("fixed_window", control_warmup=0, control_interval=1))
    assert model.aah_windows().tolist() == [[T] * HEADS] * LAYERS
    full = model.coverage()
    assert full["acr"] == 1.0 and full["causal_coverage"] == 1.0
    train(model, 1)
    windows = model.aah_windows()
    assert windows.shape == (LAYERS, HEADS) and windows.dtype == torch.long
    assert windows.tolist() == [[8] * HEADS] * LAYERS
    cov = model.coverage()
    # W = 8 at T = 32: ACR 8/32; causal pairs 1+...+8 + 24 * 8 = 228 of 32 * 33 / 2 = 528
    assert cov["acr"] == pytest.approx(0.25)
    assert cov["causal_coverage"] == pytest.approx(228 / 528)
    assert cov["acr_per_layer"] == pytest.approx([0.25] * LAYERS)
    assert cov["causal_coverage_per_layer"] == pytest.approx([228 / 528] * LAYERS)
    # at T = 16: ACR 8/16; pairs 36 + 8 * 8 = 100 of 136
    short = model.coverage(16)
    assert model.aah_windows(16).tolist() == [[8] * HEADS] * LAYERS
    assert short["acr"] == pytest.approx(0.5)
    assert short["causal_coverage"] == pytest.approx(100 / 136)
    # at T = 6 every window is capped at the length: full coverage
    assert model.aah_windows(6).tolist() == [[6] * HEADS] * LAYERS
    assert model.coverage(6)["acr"] == 1.0


def test_learned_positional_embeddings_train_and_carry_position():
    torch.manual_seed(0)
    model = GPT(
        small_config(positional="learned"),
        regimes.get("full_adaptive", control_warmup=1, control_interval=1),
    )
    assert model.pos_embed is not None
    assert all(a.rotary is None for a in model.attention_layers())
    losses = train(model, 3)
    assert all(math.isfinite(x) for x in losses)
    model.set_step(10)
    idx = tokens(1, length=20)
    _, loss = model(idx[:, :-1], idx[:, 1:])
    model.zero_grad()
    loss.backward()
    grad = model.pos_embed.weight.grad
    assert grad[:19].abs().sum() > 0
    assert grad[19:].abs().sum() == 0
    # the same tokens at other positions give other outputs
    model.eval()
    with torch.no_grad():
        same = torch.full((1, 4), 5)
        logits, _ = model(same)
    assert not torch.allclose(logits[0, 1], logits[0, 3])


def test_grouped_query_gpt_runs_and_controllers_see_shared_kv_heads():
    torch.manual_seed(0)
    model = GPT(
        small_config(n_kv_heads=2),
        regimes.get("full_adaptive", control_warmup=1, control_interval=1),
    )
    head_dim = D_MODEL // HEADS
    for attn in model.attention_layers():
        assert attn.num_kv_heads == 2
        assert attn.qkv.out_features == (HEADS + 2 * 2) * head_dim
    losses = train(model, 3)
    assert all(math.isfinite(x) for x in losses)
    for ctrl in model.controllers():
        assert int(ctrl.num_updates) == 2
        feats = ctrl.feature_ema
        # K/V statistics (columns 2..5): heads 0, 1 share KV head 0; heads 2, 3 share KV head 1
        torch.testing.assert_close(feats[0, 2:6], feats[1, 2:6])
        torch.testing.assert_close(feats[2, 2:6], feats[3, 2:6])
        assert not torch.allclose(feats[0, 2:6], feats[2, 2:6])
        assert not torch.allclose(feats[0, 0:2], feats[1, 0:2])  # queries stay per head


def test_model_rejects_sequences_longer_than_its_max_length():
    model = GPT(small_config(max_seq_len=8))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(tokens(0, length=9))
