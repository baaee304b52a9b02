"""Corrupted run folders: ``aah eval``, ``aah generate`` and ``aah train --resume`` end in one line
and exit 2 (or, where they may fall back, say which file they passed over), never a traceback and
never a silent success on damaged files."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from aah.cli import main
from aah.config import load_config
from aah.train import train

from ..test_fuzz import _corrupt

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. "
READS = {  # the checkpoint files each command reads
    "eval": ("model.safetensors", "info.json"),
    "generate": ("model.safetensors", "info.json"),
    "resume": ("model.safetensors", "info.json", "train_state.json", "train_state.safetensors"),
}


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory) -> Path:
    """A 4-step run with one checkpoint, so a damaged one leaves nothing to fall back to."""
    root = tmp_path_factory.mktemp("fuzz_run")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(TEXT * 14 + f" part {i}\n")
    overrides = [
        "model.n_layers=1", "model.d_model=32", "model.n_heads=4", f"data.corpus={corpus}", "data.seq_len=32",
        f"data.cache_dir={root / 'cache'}", "data.val_fraction=0.3", "train.max_steps=4", "train.batch_size=4",
        "train.checkpoint_every=4", "train.device=cpu", "eval.every=0", "eval.batches=2", "log.every=2",
        "log.tensorboard=false", "log.progress=false",
    ]
    train(load_config(None, overrides), root / "run")
    return root / "run"


def _argv(command: str, run: Path) -> list[str]:
    return {"eval": ["eval", str(run)], "generate": ["generate", str(run), "--prompt", "It is", "--new-tokens", "2"],
            "resume": ["train", "--resume", str(run)]}[command]


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(READS))
def test_damaged_checkpoint_files_end_in_one_line(command, one_checkpoint, tmp_path, capsys):
    rng = random.Random(f"run-folder-{command}")
    for trial in range(6):
        run = tmp_path / f"run{trial}"
        shutil.copytree(one_checkpoint, run)
        (checkpoint,) = (run / "checkpoints").iterdir()
        damaged = checkpoint / rng.choice(READS[command])
        before = damaged.read_bytes()
        after = _corrupt(before, rng)
        if after == before:
            continue
        damaged.write_bytes(after)
        capsys.readouterr()
        code = main(_argv(command, run))
        err = capsys.readouterr().err
        assert "Traceback" not in err, (damaged.name, err)
        assert code == 2, (damaged.name, code, err)
        last = err.strip().splitlines()[-1]
        assert last.startswith("aah ") and damaged.name in err, (damaged.name, err)
