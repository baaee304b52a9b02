"""Run configuration: loading, inheritance, overrides, validation, round trips, config families."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from aah import regimes
from aah.config import (
    AAHConfig,
    ConfigError,
    ModelConfig,
    RunConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    controller_config,
    load_config,
    model_config,
    save_config,
)
from aah.controller import ControllerConfig
from aah.model import GPTConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FAMILIES = ("cpu", "paper")
REGIME_FILES = [
    pytest.param(family, name, id=f"{family}/{name}") for family in FAMILIES for name in regimes.names()
]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def raises_naming(*parts: str):
    """``pytest.raises(ConfigError)`` whose message must contain every one of ``parts``."""

    class _Check:
        def __enter__(self):
            self._ctx = pytest.raises(ConfigError)
            self.info = self._ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self._ctx.__exit__(*exc)
            message = str(self.info.value)
            for part in parts:
                assert part in message, f"{part!r} not in {message!r}"
            return suppressed

    return _Check()


# --- defaults -------------------------------------------------------------------------------


def test_defaults():
    cfg = load_config(None)
    assert cfg == RunConfig()
    assert cfg.aah.regime == "full_adaptive"
    assert cfg.aah.overrides() == {}
    assert cfg.model.vocab_size is None and cfg.model.max_seq_len is None
    assert (cfg.data.corpus, cfg.data.tokenizer, cfg.data.seq_len) == ("shakespeare", "byte", 1024)
    assert (cfg.data.val_fraction, cfg.data.bpe_vocab_size) == (0.1, 4096)
    assert cfg.data.cache_dir is None and cfg.data.val_corpus is None
    o = cfg.optim
    assert (o.lr, o.weight_decay, o.beta1, o.beta2, o.eps) == (3e-4, 0.1, 0.9, 0.95, 1e-8)
    assert (o.warmup_steps, o.min_lr_ratio, o.grad_clip) == (100, 0.0, 1.0)
    t = cfg.train
    assert (t.max_steps, t.batch_size, t.grad_accum, t.seed) == (1000, 8, 1, 0)
    assert (t.checkpoint_every, t.checkpoint_steps) == (0, ())
    assert (t.precision, t.compile, t.device, t.out_dir, t.distributed) == ("auto", False, "auto", "runs", "ddp")
    assert (cfg.eval.every, cfg.eval.batches, cfg.eval.batch_size) == (100, 20, None)
    assert (cfg.log.every, cfg.log.tensorboard, cfg.log.progress) == (10, True, True)
    assert cfg.max_seq_len == 1024 and cfg.eval_batch_size == 8


def test_sections_are_frozen():
    cfg = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.max_steps = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = TrainConfig()  # type: ignore[misc]


def test_model_section_mirrors_gpt_config():
    gpt = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    assert set(ours) == set(gpt)
    for name, default in ours.items():
        expected = None if name in ("vocab_size", "max_seq_len") else gpt[name]
        assert default == expected, name


def test_aah_section_mirrors_controller_config():
    ctrl_hints = typing.get_type_hints(ControllerConfig)
    aah_hints = typing.get_type_hints(AAHConfig)
    expected = set(ctrl_hints) - {"seed", "enabled"} | {"regime"}
    assert {f.name for f in dataclasses.fields(AAHConfig)} == expected
    for name in expected - {"regime"}:
        assert aah_hints[name] == ctrl_hints[name] | None, name


# --- the config families --------------------------------------------------------------------


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


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,parts",
    [
        (["train.max_steps=abc"], ["train.max_steps: expected int, got 'abc'"]),
        (["train.max_steps=true"], ["train.max_steps: expected int, got True"]),
        (["train.max_steps=2.5"], ["train.max_steps: expected int"]),
        (["optim.lr=fast"], ["optim.lr: expected float"]),
        (["log.tensorboard=1"], ["log.tensorboard: expected bool"]),
        (["aah.windows=[64, x]"], ["aah.windows: expected list of int or null"]),
        (["aah.windows=[256,128]"], ["aah.windows", "ascending"]),
        (["aah.windows=[128,128]"], ["aah.windows", "ascending"]),
        (["aah.windows=[]"], ["aah.windows", "non-empty"]),
        (["aah.windows=[128,2048]"], ["aah.windows", "1024", "data.seq_len"]),
        (["model.max_seq_len=2048", "aah.windows=[512,4096]"], ["aah.windows", "2048", "model.max_seq_len"]),
        (["aah.min_window=4096"], ["aah.min_window", "1024"]),
        (["aah.regime=nope"], ["aah.regime", "nope", "full_attention", "shallow_freeze"]),
        (["aah.control_interval=0"], ["aah.control_interval", ">= 1"]),
        (["aah.feature_ema=1.5"], ["aah.feature_ema"]),
        (["aah.scoring=magic"], ["aah.scoring", "joint"]),
        (["aah.scoring=fixed", "aah.fixed_window_index=4"], ["aah.fixed_window_index", "0..3"]),
        (["model.max_seq_len=512"], ["data.seq_len", "model.max_seq_len", "512"]),
        (["model.n_heads=7"], ["model.n_heads", "divide"]),
        (["model.norm=batchnorm"], ["model.norm", "layernorm"]),
        (["model.dropout=1.0"], ["model.dropout"]),
        (["train.precision=fp16"], ["train.precision", "fp32", "bf16", "auto"]),
        (["train.device=tpu"], ["train.device", "cpu", "cuda"]),
        (["train.distributed=zero"], ["train.distributed", "ddp", "fsdp"]),
        (["train.batch_size=0"], ["train.batch_size", ">= 1"]),
        (["train.grad_accum=0"], ["train.grad_accum", ">= 1"]),
        (["train.max_steps=0"], ["train.max_steps", ">= 1"]),
        (["train.checkpoint_steps=[0, 5]"], ["train.checkpoint_steps"]),
        (["optim.lr=-0.001"], ["optim.lr", ">= 0"]),
        (["optim.beta2=1.0"], ["optim.beta2"]),
        (["optim.min_lr_ratio=2"], ["optim.min_lr_ratio"]),
        (["optim.decay_steps=0"], ["optim.decay_steps", ">= 1"]),
        (["data.tokenizer=gpt2"], ["data.tokenizer", "byte", "bpe", "hf:"]),
        (["data.val_fraction=0"], ["data.val_fraction"]),
        (["eval.batches=0"], ["eval.batches"]),
        (["eval.every=-1"], ["eval.every"]),
        (["log.every=0"], ["log.every"]),
    ],
)
def test_validation_errors_name_the_key(overrides, parts):
    with raises_naming(*parts):
        load_config(None, overrides)


def test_valid_edge_values_pass():
    cfg = load_config(
        None,
        [
            "aah.regime=fixed_window",
            "aah.windows=[256, 1024]",
            "aah.fixed_window_index=1",
            "optim.lr=0",
            "optim.grad_clip=0",
            "eval.every=0",
            "data.tokenizer=hf:/some/tokenizer.json",
            "model.max_seq_len=2048",
        ],
    )
    assert cfg.max_seq_len == 2048 and cfg.data.seq_len == 1024
    assert controller_config(cfg).windows == (256, 1024)


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


def test_direct_construction_is_validated():
    with raises_naming("train.max_steps", ">= 1"):
        TrainConfig(max_steps=0)
    with raises_naming("train.batch_size: expected int, got '4'"):
        TrainConfig(batch_size="4")
    with raises_naming("aah.windows", "ascending"):
        AAHConfig(windows=(4, 2))
    with raises_naming("aah.windows", "1024"):
        RunConfig(aah=AAHConfig(windows=(512, 2048)))
    assert TrainConfig(checkpoint_steps=[3, 1]).checkpoint_steps == (1, 3)
    assert dataclasses.replace(RunConfig(), train=TrainConfig(max_steps=3)).train.max_steps == 3


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


# --- controller and model settings ----------------------------------------------------------


def test_controller_config():
    assert controller_config(load_config(None, ["aah.regime=full_attention"])) is None
    assert controller_config(load_config(None, ["aah.regime=full_attention", "aah.windows=[64,128]"])) is None
    cfg = load_config(
        None,
        [
            "aah.regime=shallow_freeze",
            "train.seed=42",
            "aah.windows=[128,256,512,1024]",
            "aah.control_warmup=20",
            "aah.control_interval=10",
        ],
    )
    ctrl = controller_config(cfg)
    assert isinstance(ctrl, ControllerConfig)
    assert ctrl.seed == 42
    assert ctrl.windows == (128, 256, 512, 1024)
    assert (ctrl.control_warmup, ctrl.control_interval) == (20, 10)
    assert ctrl == regimes.get("shallow_freeze").replace(
        seed=42, windows=(128, 256, 512, 1024), control_warmup=20, control_interval=10
    )
    # the regime preset itself is untouched
    assert regimes.get("shallow_freeze").seed == 0


def test_model_config():
    cfg = load_config(None, ["data.seq_len=512", "model.n_layers=2"])
    m = model_config(cfg, 300)
    assert isinstance(m, GPTConfig)
    assert (m.vocab_size, m.max_seq_len, m.n_layers) == (300, 512, 2)
    m = model_config(load_config(None, ["data.seq_len=512", "model.max_seq_len=2048"]), 256)
    assert m.max_seq_len == 2048
    padded = load_config(None, ["model.vocab_size=512"])
    assert model_config(padded, 300).vocab_size == 512
    with raises_naming("model.vocab_size", "300"):
        model_config(load_config(None, ["model.vocab_size=256"]), 300)
    with raises_naming("vocab_size"):
        model_config(cfg, 0)


def test_run_config_key_window_granularity() -> None:
    from aah.config import ConfigError, controller_config, load_config

    assert controller_config(load_config(None)).window_granularity == "head"
    cfg = load_config(None, ["aah.window_granularity=kv_group"])
    assert controller_config(cfg).window_granularity == "kv_group"
    with pytest.raises(ConfigError, match=r"aah\.window_granularity.*head, kv_group"):
        load_config(None, ["aah.window_granularity=layer"])
