"""The typed sections: declared fields, defaults, validation naming the key, model and controller settings."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

import pytest

from aah import regimes
from aah.config import load_config, schemas
from aah.controller import ControllerConfig
from aah.model import GPTConfig

from .conftest import raises_naming

# --- defaults -------------------------------------------------------------------------------


def test_defaults():
    cfg = load_config(None)
    assert cfg == schemas.RunConfig()
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
        cfg.train = schemas.TrainConfig()  # type: ignore[misc]


def test_model_section_mirrors_gpt_config():
    gpt = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(schemas.ModelConfig)}
    assert set(ours) == set(gpt)
    for name, default in ours.items():
        expected = None if name in ("vocab_size", "max_seq_len") else gpt[name]
        assert default == expected, name


def test_aah_section_mirrors_controller_config():
    ctrl_hints = typing.get_type_hints(ControllerConfig)
    aah_hints = typing.get_type_hints(schemas.AAHConfig)
    expected = set(ctrl_hints) - {"seed", "enabled"} | {"regime"}
    assert {f.name for f in dataclasses.fields(schemas.AAHConfig)} == expected
    for name in expected - {"regime"}:
        assert aah_hints[name] == ctrl_hints[name] | None, name
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
    assert schemas.controller_config(cfg).windows == (256, 1024)
def test_direct_construction_is_validated():
    with raises_naming("train.max_steps", ">= 1"):
        schemas.TrainConfig(max_steps=0)
    with raises_naming("train.batch_size: expected int, got '4'"):
        schemas.TrainConfig(batch_size="4")
    with raises_naming("aah.windows", "ascending"):
        schemas.AAHConfig(windows=(4, 2))
    with raises_naming("aah.windows", "1024"):
        schemas.RunConfig(aah=schemas.AAHConfig(windows=(512, 2048)))
    assert schemas.TrainConfig(checkpoint_steps=[3, 1]).checkpoint_steps == (1, 3)
    assert dataclasses.replace(schemas.RunConfig(), train=schemas.TrainConfig(max_steps=3)).train.max_steps == 3
# --- controller and model settings ----------------------------------------------------------


def test_controller_config():
    assert schemas.controller_config(load_config(None, ["aah.regime=full_attention"])) is None
    assert schemas.controller_config(load_config(None, ["aah.regime=full_attention", "aah.windows=[64,128]"])) is None
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
    ctrl = schemas.controller_config(cfg)
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
    m = schemas.model_config(cfg, 300)
    assert isinstance(m, GPTConfig)
    assert (m.vocab_size, m.max_seq_len, m.n_layers) == (300, 512, 2)
    m = schemas.model_config(load_config(None, ["data.seq_len=512", "model.max_seq_len=2048"]), 256)
    assert m.max_seq_len == 2048
    padded = load_config(None, ["model.vocab_size=512"])
    assert schemas.model_config(padded, 300).vocab_size == 512
    with raises_naming("model.vocab_size", "300"):
        schemas.model_config(load_config(None, ["model.vocab_size=256"]), 300)
    with raises_naming("vocab_size"):
        schemas.model_config(cfg, 0)


def test_run_config_key_window_granularity() -> None:
    from aah.config import ConfigError, load_config

    assert schemas.controller_config(load_config(None)).window_granularity == "head"
    cfg = load_config(None, ["aah.window_granularity=kv_group"])
    assert schemas.controller_config(cfg).window_granularity == "kv_group"
    with pytest.raises(ConfigError, match=r"aah\.window_granularity.*head, kv_group"):
        load_config(None, ["aah.window_granularity=layer"])


# --- declared fields ------------------------------------------------------------------------

FIELDS = {
    schemas.ModelConfig: [
        "vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "norm",
        "activation", "positional", "rope_base", "tie_embeddings", "dropout", "bias", "backend",
    ],
    schemas.AAHConfig: [
        "regime", "windows", "min_window", "control_interval", "control_warmup", "feature_ema",
        "resolution_ema", "grouping", "hierarchy", "max_depth", "topology", "scoring", "parent_constraint",
        "upper_levels", "keep_collapsed_top", "standardize_features", "diagnostics_context",
        "level0_threshold", "upper_threshold", "norm_penalty", "norm_eps", "shuffle_post_select",
        "fixed_window_index", "diagnostic_queries", "base_hidden", "joint_hidden", "budget", "budget_scope",
        "uniform_exact", "lost_mass_ema", "window_granularity", "warmup_trigger", "far_cost_threshold",
        "far_cost_patience", "warmup_max_steps",
    ],
    schemas.DataConfig: [
        "corpus", "tokenizer", "seq_len", "val_fraction", "bpe_vocab_size", "cache_dir", "val_corpus",
        "recall_fraction", "recall_pairs", "recall_value_len", "recall_distance", "recall_seed", "recall_keys",
    ],
    schemas.OptimConfig: [
        "lr", "weight_decay", "beta1", "beta2", "eps", "warmup_steps", "min_lr_ratio", "decay_steps", "grad_clip",
    ],
    schemas.TrainConfig: [
        "max_steps", "batch_size", "grad_accum", "seed", "checkpoint_every", "checkpoint_steps", "precision",
        "compile", "device", "out_dir", "distributed",
    ],
    schemas.EvalConfig: ["every", "batches", "batch_size"],
    schemas.LogConfig: ["every", "tensorboard", "progress"],
    schemas.RunConfig: list(schemas.SECTIONS),
}


@pytest.mark.parametrize("cls", list(FIELDS), ids=lambda cls: cls.__name__)
def test_fields_are_declared_in_the_class_body(cls):
    """Every field is written out (name, annotation, default) where editors and type checkers see it,
    in the order a config is saved in."""
    assert [f.name for f in dataclasses.fields(cls)] == FIELDS[cls]
    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls.__name__)
    declared = [
        node.target.id for node in body.body
        if isinstance(node, ast.AnnAssign) and "ClassVar" not in ast.unparse(node.annotation)
    ]
    assert declared == FIELDS[cls]
    hints = typing.get_type_hints(cls)
    assert all(name in hints for name in FIELDS[cls])


@pytest.mark.parametrize(
    "cls,values,parts",
    [
        (schemas.ModelConfig, {"d_ff": 0}, ["model.d_ff: must be >= 1, got 0"]),
        (schemas.ModelConfig, {"n_heads": 7}, ["model.n_heads: must divide d_model (256), got 7"]),
        (schemas.ModelConfig, {"norm": "batchnorm"}, ["model.norm: must be one of layernorm, rmsnorm; got 'batchnorm'"]),
        (schemas.ModelConfig, {"backend": ""}, ["model.backend"]),
        (schemas.ModelConfig, {"vocab_size": 0}, ["model.vocab_size: must be >= 1, got 0"]),
        (schemas.ModelConfig, {"n_layers": 2.5}, ["model.n_layers: expected int, got 2.5"]),
        (schemas.AAHConfig, {"regime": "nope"}, ["aah.regime: unknown regime 'nope'; known regimes: full_attention"]),
        (schemas.AAHConfig, {"base_hidden": 0}, ["aah.base_hidden: must be >= 1, got 0"]),
        (schemas.AAHConfig, {"joint_hidden": 0}, ["aah.joint_hidden: must be >= 1, got 0"]),
        (schemas.AAHConfig, {"budget_scope": "x"}, ["aah.budget_scope: must be one of layer, model; got 'x'"]),
        (schemas.AAHConfig, {"lost_mass_ema": 1.0}, ["aah.lost_mass_ema: must be in [0, 1), got 1.0"]),
        (schemas.DataConfig, {"recall_keys": "x"}, ["data.recall_keys: must be one of digits, byte; got 'x'"]),
        (schemas.OptimConfig, {"eps": 0}, ["optim.eps: must be > 0, got 0.0"]),
        (schemas.TrainConfig, {"device": "tpu"}, ["train.device: must be one of auto, cpu, cuda; got 'tpu'"]),
        (schemas.EvalConfig, {"batch_size": 0}, ["eval.batch_size: must be >= 1, got 0"]),
        (schemas.LogConfig, {"progress": "yes"}, ["log.progress: expected bool, got 'yes'"]),
    ],
)
def test_bad_values_name_the_field(cls, values, parts):
    with raises_naming(*parts):
        cls(**values)


def test_model_and_controller_fields_are_checked_by_their_own_dataclass():
    """A model field is checked by GPTConfig, a controller field by ControllerConfig; the sections report
    those errors under their own key."""
    with pytest.raises(ValueError, match=r"^model\.d_ff: must be >= 1, got 0$"):
        GPTConfig(d_ff=0)
    with pytest.raises(ValueError, match=r"^model\.backend: must be a backend name or 'auto', got ''$"):
        GPTConfig(backend="")
    with pytest.raises(ValueError, match=r"^controller\.base_hidden: must be >= 1, got 0$"):
        ControllerConfig(base_hidden=0)
    with pytest.raises(ValueError, match=r"^controller\.budget_scope: must be one of layer, model"):
        ControllerConfig(budget_scope="x")
