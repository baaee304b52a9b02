"""Shared fixtures of the suite tests: a tiny suite of two regimes on a small local corpus."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ..conftest import text_corpus


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("suite")
    corpus = text_corpus(root / "corpus", "to be or not to be, that is the question. " * 30, 5)
    base = {
        "model": {"n_layers": 1, "d_model": 32, "n_heads": 4},
        "data": {"corpus": str(corpus), "seq_len": 32, "cache_dir": str(root / "cache"), "val_fraction": 0.3},
        "aah": {"windows": [8, 16, 32], "control_warmup": 1, "control_interval": 1},
        "train": {"max_steps": 4, "batch_size": 2, "device": "cpu"},
        "eval": {"every": 2, "batches": 1},
        "log": {"every": 1, "tensorboard": False, "progress": False},
    }
    configs = root / "configs"
    configs.mkdir()
    (configs / "base.yaml").write_text(yaml.safe_dump(base))
    for regime in ("full_attention", "shallow_freeze"):
        (configs / f"{regime}.yaml").write_text(yaml.safe_dump({"base": "base.yaml", "aah": {"regime": regime}}))
    suite = root / "tiny.yaml"
    suite.write_text(yaml.safe_dump({
        "name": "tiny", "config_dir": "configs", "regimes": ["full_attention", "shallow_freeze"], "seeds": [0, 1],
    }))
    return suite
