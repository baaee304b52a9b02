"""Checkpoint integrity for files larger than any prefix a hash could stop at.

The manifest's sha256 must cover every byte: one damaged byte near the end of a 3 MiB file is
found, though the file's first MiB (one read chunk) is exactly what was saved.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from aah.train.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    newest_good_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

MIB = 1 << 20


@pytest.fixture
def run(tmp_path):
    """A run with checkpoints at steps 1 and 2, each with about 3 MiB of weights and of train state."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 768, bias=False)  # 786,432 float32 weights: 3 MiB
    state = {"step": 0, "moments": torch.randn(768, 1024)}  # another 3 MiB
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, state | {"step": step})
    return tmp_path


@pytest.mark.parametrize("name", ["model.safetensors", "train_state.safetensors"])
def test_one_byte_damaged_near_the_end_of_a_large_file_is_found(run, name):
    folder = checkpoint_dir(run, 2)
    path = folder / name
    saved = path.read_bytes()
    assert len(saved) > 3 * MIB - 4096  # far beyond the first MiB
    manifest = json.loads((folder / "info.json").read_text())["files"][name]
    assert manifest == {"bytes": len(saved), "sha256": hashlib.sha256(saved).hexdigest()}
    assert verify_checkpoint(folder) is True

    damaged = bytearray(saved)
    spot = len(damaged) - 3  # inside the last tensor's bytes
    damaged[spot] ^= 0x10
    path.write_bytes(bytes(damaged))
    assert damaged[:MIB] == saved[:MIB] and len(damaged) == len(saved)  # a prefix hash (or the size) would pass it
    assert hashlib.sha256(damaged[:MIB]).hexdigest() == hashlib.sha256(saved[:MIB]).hexdigest()

    with pytest.raises(CheckpointError, match=f"{name} does not match its sha256"):
        verify_checkpoint(folder)
    warnings: list[str] = []
    step, found, skipped = newest_good_checkpoint(run, warn=warnings.append)
    assert (step, found) == (1, checkpoint_dir(run, 1))  # the damaged one is skipped for the one before
    assert [s["step"] for s in skipped] == [2] and len(warnings) == 1 and name in warnings[0]
