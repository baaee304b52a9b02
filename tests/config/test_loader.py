"""Reading configs: files, base inheritance, overrides, errors naming the file or override, round trips."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from aah.config import RunConfig, config_from_dict, config_to_dict, load_config, save_config

from .conftest import CONFIGS, REGIME_FILES, raises_naming, write

# --- overrides ------------------------------------------------------------------------------


def test_overrides_apply_with_types():
    cfg = load_config(
        CONFIGS / "cpu" / "full_adaptive.yaml",
        [
            "train.max_steps=50",
            "aah.windows=[64,128]",
            "data.seq_len=256",
            "aah.regime=shallow_freeze",
            "optim.lr=1e-2",
            "optim.weight_decay=0",
            "train.compile=true",
            "data.cache_dir=null",
            "train.checkpoint_steps=[20, 10]",
            "data.val_corpus=bible",
        ],
    )
    assert cfg.train.max_steps == 50 and type(cfg.train.max_steps) is int
    assert cfg.aah.windows == (64, 128)
    assert cfg.data.seq_len == 256 and cfg.max_seq_len == 256
    assert cfg.aah.regime == "shallow_freeze"
    assert cfg.optim.lr == 0.01
    assert cfg.optim.weight_decay == 0.0 and type(cfg.optim.weight_decay) is float
    assert cfg.train.compile is True
    assert cfg.train.checkpoint_steps == (10, 20)
    assert cfg.data.val_corpus == "bible"
    # later overrides win, and the file's other values stay
    cfg = load_config(CONFIGS / "cpu" / "full_adaptive.yaml", ["train.seed=1", "train.seed=7"])
    assert cfg.train.seed == 7 and cfg.train.batch_size == 4


def test_scientific_notation_in_files_is_a_float(tmp_path):
    cfg = load_config(write(tmp_path / "c.yaml", "optim:\n  lr: 1e-3\n  eps: 1E-6\n"))
    assert cfg.optim.lr == 1e-3 and cfg.optim.eps == 1e-6


@pytest.mark.parametrize(
    "override,parts",
    [
        ("train.max_steps", ["train.max_steps", "section.key=value"]),
        ("max_steps=5", ["max_steps=5", "section.key=value"]),
        ("train.nope=1", ["train.nope=1", "train.nope", "unknown key", "max_steps"]),
        ("nope.x=1", ["nope.x=1", "unknown section", "train"]),
        ("aah.seed=3", ["aah.seed=3", "train.seed", "control_interval"]),
        ("aah.enabled=false", ["aah.enabled", "full_attention"]),
        ("train.max_steps=[1", ["train.max_steps=[1", "YAML"]),
    ],
)
def test_override_errors_name_the_override(override, parts):
    with raises_naming(*parts):
        load_config(None, [override])


# --- files ----------------------------------------------------------------------------------


def test_errors_in_a_file_name_key_and_file(tmp_path):
    path = write(tmp_path / "bad.yaml", "train:\n  max_steps: abc\n")
    with raises_naming("train.max_steps: expected int, got 'abc'", "bad.yaml"):
        load_config(path)
    path = write(tmp_path / "unknown_key.yaml", "train:\n  max_step: 5\n")
    with raises_naming("train.max_step", "unknown key", "unknown_key.yaml", "max_steps"):
        load_config(path)
    path = write(tmp_path / "unknown_section.yaml", "training:\n  max_steps: 5\n")
    with raises_naming("training", "unknown section", "model, aah, data, optim, train, eval, log"):
        load_config(path)
    path = write(tmp_path / "not_mapping.yaml", "train: 5\n")
    with raises_naming("train", "mapping"):
        load_config(path)


def test_file_errors_name_the_file(tmp_path):
    with raises_naming("missing.yaml", "not found"):
        load_config(tmp_path / "missing.yaml")
    with raises_naming("broken.yaml", "invalid YAML"):
        load_config(write(tmp_path / "broken.yaml", "train: [1, 2\n"))
    with raises_naming("list.yaml", "mapping"):
        load_config(write(tmp_path / "list.yaml", "- 1\n- 2\n"))
    (tmp_path / "folder.yaml").mkdir()
    with raises_naming("folder.yaml", "cannot be read"):
        load_config(tmp_path / "folder.yaml")
    with raises_naming("binary.yaml", "cannot be read"):
        binary = tmp_path / "binary.yaml"
        binary.write_bytes(b"\xff\xfe\x00bad")
        load_config(binary)


def test_empty_file_is_all_defaults(tmp_path):
    assert load_config(write(tmp_path / "empty.yaml", "")) == RunConfig()
    assert load_config(write(tmp_path / "headers.yaml", "train:\naah:\n")) == RunConfig()

# --- base inheritance -----------------------------------------------------------------------


def test_base_inheritance_deep_merges_recursively(tmp_path):
    write(tmp_path / "root.yaml", "train:\n  max_steps: 7\n  batch_size: 3\nmodel:\n  n_layers: 2\n")
    write(tmp_path / "sub" / "mid.yaml", "base: ../root.yaml\ntrain:\n  batch_size: 5\nlog:\n  every: 2\n")
    leaf = write(
        tmp_path / "sub" / "leaf.yaml",
        "base: mid.yaml\ntrain:\n  seed: 9\naah:\n  regime: shallow_freeze\n",
    )
    cfg = load_config(leaf)
    assert (cfg.train.max_steps, cfg.train.batch_size, cfg.train.seed) == (7, 5, 9)
    assert cfg.model.n_layers == 2 and cfg.log.every == 2
    assert cfg.aah.regime == "shallow_freeze"
    # overrides apply after the whole chain
    assert load_config(leaf, ["train.max_steps=11"]).train.max_steps == 11


def test_base_list_and_diamond(tmp_path):
    write(tmp_path / "a.yaml", "train:\n  max_steps: 1\n  seed: 1\n")
    write(tmp_path / "b.yaml", "base: a.yaml\ntrain:\n  max_steps: 2\n")
    write(tmp_path / "c.yaml", "base: a.yaml\ntrain:\n  batch_size: 3\n")
    top = write(tmp_path / "top.yaml", "base: [b.yaml, c.yaml]\n")
    cfg = load_config(top)
    # c (later) re-applies a's max_steps over b's: bases merge in order
    assert (cfg.train.max_steps, cfg.train.batch_size, cfg.train.seed) == (1, 3, 1)


def test_base_cycles_are_rejected(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with raises_naming("cycle", "a.yaml", "b.yaml"):
        load_config(tmp_path / "a.yaml")
    with raises_naming("cycle", "self.yaml"):
        load_config(write(tmp_path / "self.yaml", "base: self.yaml\n"))


def test_base_errors(tmp_path):
    with raises_naming("nowhere.yaml", "not found", "child.yaml"):
        load_config(write(tmp_path / "child.yaml", "base: nowhere.yaml\n"))
    with raises_naming("base", "file name"):
        load_config(write(tmp_path / "weird.yaml", "base: 5\n"))


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("family,name", REGIME_FILES)
def test_round_trip(tmp_path, family, name):
    cfg = load_config(CONFIGS / family / f"{name}.yaml", ["train.seed=3", "aah.min_window=64"])
    data = config_to_dict(cfg)
    assert yaml.safe_load(yaml.safe_dump(data)) == data  # nested plain types only
    assert config_from_dict(data) == cfg
    path = save_config(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(path) == cfg
    assert config_to_dict(load_config(path)) == data


def test_round_trip_of_awkward_strings(tmp_path):
    cfg = load_config(None, ["data.corpus='1e3'", "train.out_dir='null'", "data.cache_dir='true'"])
    assert (cfg.data.corpus, cfg.train.out_dir, cfg.data.cache_dir) == ("1e3", "null", "true")
    assert load_config(save_config(cfg, tmp_path / "c.yaml")) == cfg


def test_saved_text_is_stable(tmp_path):
    """Run folders are matched to their plan by the saved config: its text must not drift
    (section and key order, inline lists, number and null spelling)."""
    cfg = load_config(None, ["aah.windows=[64,128]", "train.checkpoint_steps=[5]"])
    expected = """\
    # aah run configuration
    model:
      vocab_size: null
      n_layers: 4
      d_model: 256
      n_heads: 8
      n_kv_heads: null
      d_ff: null
      max_seq_len: null
      norm: layernorm
      activation: gelu
      positional: rope
      rope_base: 10000.0
      tie_embeddings: true
      dropout: 0.0
      bias: false
      backend: auto
    aah:
      regime: full_adaptive
      windows: [64, 128]
    data:
      corpus: shakespeare
      tokenizer: byte
      seq_len: 1024
      val_fraction: 0.1
      bpe_vocab_size: 4096
      cache_dir: null
      val_corpus: null
      recall_fraction: 0.1
      recall_pairs: 8
      recall_value_len: 3
      recall_distance: uniform
      recall_seed: 0
      recall_keys: digits
    optim:
      lr: 0.0003
      weight_decay: 0.1
      beta1: 0.9
      beta2: 0.95
      eps: 1.0e-08
      warmup_steps: 100
      min_lr_ratio: 0.0
      decay_steps: null
      grad_clip: 1.0
    train:
      max_steps: 1000
      batch_size: 8
      grad_accum: 1
      seed: 0
      checkpoint_every: 0
      checkpoint_steps: [5]
      precision: auto
      compile: false
      device: auto
      out_dir: runs
      distributed: ddp
    eval:
      every: 100
      batches: 20
      batch_size: null
    log:
      every: 10
      tensorboard: true
      progress: true
"""
    assert save_config(cfg, tmp_path / "c.yaml").read_text(encoding="utf-8") == textwrap.dedent(expected)
