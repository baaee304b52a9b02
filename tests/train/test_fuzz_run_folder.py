"""Corrupted run folders: ``aah eval``, ``aah generate`` and ``aah train --resume`` end in one line
naming the damaged file and exit 2, never a traceback and never a silent success."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from aah.cli import main

from ..test_fuzz import _corrupt

READS = {  # the checkpoint files each command reads; every change to them must be refused
    "eval": ("model.safetensors",),
    "generate": ("model.safetensors",),
    "resume": ("model.safetensors", "train_state.json", "train_state.safetensors"),
}
#: The manifest: damage to the hashes it holds is refused; damage elsewhere in it (a field no
#: check reads) may pass, since every file the command reads still verifies.
MANIFEST = "info.json"


def _argv(command: str, run: Path) -> list[str]:
    return {"eval": ["eval", str(run)], "generate": ["generate", str(run), "--prompt", "It is", "--new-tokens", "2"],
            "resume": ["train", "--resume", str(run)]}[command]


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(READS))
def test_damaged_checkpoint_files_end_in_one_line(command, trained, tmp_path, capsys):
    """The same file damaged in every checkpoint of the shared run, so none is left to fall back to."""
    rng = random.Random(f"run-folder-{command}")
    for trial in range(6):
        run = tmp_path / f"run{trial}"
        shutil.copytree(trained, run)
        name = rng.choice(READS[command] + (MANIFEST,))
        for checkpoint in (run / "checkpoints").iterdir():
            damaged = checkpoint / name
            damaged.write_bytes(_corrupt(damaged.read_bytes(), rng))
        capsys.readouterr()
        code = main(_argv(command, run))
        err = capsys.readouterr().err
        assert "Traceback" not in err, (damaged.name, err)
        if code == 0 and name == MANIFEST:
            continue
        assert code == 2, (damaged.name, code, err)
        last = err.strip().splitlines()[-1]
        assert last.startswith("aah ") and damaged.name in err, (damaged.name, err)
