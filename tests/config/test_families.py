"""The config families under configs/: one file per regime, each loading to its regime's settings."""

from __future__ import annotations

import pytest

from aah import regimes
from aah.config import controller_config, load_config, model_config

from .conftest import CONFIGS, FAMILIES, REGIME_FILES


@pytest.mark.parametrize("family", FAMILIES)
def test_family_has_exactly_one_file_per_regime(family):
    files = {p.stem for p in (CONFIGS / family).glob("*.yaml")}
    assert files == set(regimes.names()) | {"base"}


@pytest.mark.parametrize("family,name", REGIME_FILES)
def test_regime_file_loads(family, name):
    cfg = load_config(CONFIGS / family / f"{name}.yaml")
    assert cfg.aah.regime == name
    ctrl = controller_config(cfg)
    if name == "full_attention":
        assert ctrl is None
    else:
        expected = regimes.get(name)
        assert ctrl.control_interval == expected.control_interval  # the regime's, never overridden
        for field in ("grouping", "hierarchy", "topology", "scoring", "parent_constraint"):
            assert getattr(ctrl, field) == getattr(expected, field), field
    assert cfg.aah.control_interval is None
    # a regime file only names its regime: everything else comes from base.yaml
    base = load_config(CONFIGS / family / "base.yaml", [f"aah.regime={name}"])
    assert cfg == base


def test_cpu_family_values():
    cfg = load_config(CONFIGS / "cpu" / "shallow_control_interval_10.yaml")
    m = model_config(cfg, 256)
    assert (m.n_layers, m.d_model, m.n_heads, m.max_seq_len) == (4, 256, 8, 1024)
    assert (m.activation, m.positional, m.norm, m.tie_embeddings) == ("gelu", "rope", "layernorm", True)
    assert (cfg.data.corpus, cfg.data.tokenizer, cfg.data.seq_len) == ("shakespeare", "byte", 1024)
    ctrl = controller_config(cfg)
    assert ctrl.windows == (128, 256, 512, 1024)
    assert (ctrl.control_warmup, ctrl.control_interval) == (20, 10)
    assert controller_config(load_config(CONFIGS / "cpu" / "shallow_freeze.yaml")).control_interval == 5
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == (1e-3, 20)
    t = cfg.train
    assert (t.max_steps, t.batch_size, t.checkpoint_every) == (300, 4, 100)
    assert (cfg.eval.every, cfg.eval.batches) == (50, 8)


def test_paper_family_values():
    cfg = load_config(CONFIGS / "paper" / "full_adaptive.yaml")
    m = model_config(cfg, 50257)
    assert (m.n_layers, m.d_model, m.n_heads, m.ff_dim, m.max_seq_len) == (16, 1536, 12, 6144, 4096)
    assert (m.activation, m.bias, m.positional, m.norm) == ("gelu", True, "learned", "layernorm")
    assert (m.dropout, m.tie_embeddings, m.vocab_size) == (0.1, True, 50257)
    ctrl = controller_config(cfg)
    assert ctrl.windows == (512, 1024, 2048, 4096)
    assert (ctrl.control_warmup, ctrl.control_interval) == (100, 5)
    o = cfg.optim
    assert (o.lr, o.weight_decay, o.warmup_steps, o.grad_clip, o.min_lr_ratio) == (3e-4, 0.1, 100, 0.0, 0.0)
    t = cfg.train
    assert (t.max_steps, t.batch_size, t.checkpoint_steps, t.precision) == (10000, 1, (1000, 5000, 10000), "auto")
    assert cfg.data.seq_len == 4096 and cfg.eval.every == 1000
