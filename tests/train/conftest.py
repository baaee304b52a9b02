"""A finished tiny run shared by the checkpoint tests, and a fresh copy of it for each test to damage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aah.config import load_config
from aah.train import train

from ..conftest import text_corpus

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. "


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """A finished 12-step run with dropout and checkpoints at steps 4, 8 and 12 (copied before damage)."""
    root = tmp_path_factory.mktemp("ckpt")
    corpus = text_corpus(root / "corpus", TEXT * 14, 4)
    overrides = [
        "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.dropout=0.1",
        f"data.corpus={corpus}", "data.seq_len=32", f"data.cache_dir={root / 'cache'}", "data.val_fraction=0.3",
        "train.max_steps=12", "train.batch_size=4", "train.checkpoint_every=4", "train.device=cpu",
        "aah.windows=[8,16,32]", "aah.control_warmup=2", "aah.control_interval=2",
        "eval.every=0", "eval.batches=2", "log.every=2", "log.tensorboard=false", "log.progress=false",
    ]
    run = root / "run"
    train(load_config(None, overrides), run)
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy
