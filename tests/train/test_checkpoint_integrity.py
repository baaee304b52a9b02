"""Checkpoints verify themselves: a sha256 manifest, fallback to the newest good checkpoint,
and one clear line (exit 2) when none is good."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from aah.cli import main
from aah.evaluate import evaluate_run
from aah.train.checkpoint import (
    CheckpointError,
    checkpoint_at,
    checkpoint_dir,
    newest_good_checkpoint,
    verify_checkpoint,
)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0x01  # inside the tensor data, far from any header
    path.write_bytes(bytes(data))


def remove(path: Path) -> None:
    path.unlink()


DAMAGE = {
    "truncated weights": ("model.safetensors", truncate, "truncated"),
    "flipped byte in weights": ("model.safetensors", flip_byte, "sha256"),
    "flipped byte in train state": ("train_state.safetensors", flip_byte, "sha256"),
    "missing weights": ("model.safetensors", remove, "missing"),
    "missing train state": ("train_state.json", remove, "missing"),
    "missing info": ("info.json", remove, "info.json is missing"),
}


def last_loss(run: Path) -> float:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["kind"] == "train"][-1]["loss"]


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], err


def test_manifest_records_size_and_sha256_of_every_file(trained):
    folder = checkpoint_dir(trained, 12)
    info = json.loads((folder / "info.json").read_text())
    assert info["step"] == 12
    assert set(info["files"]) == {"model.safetensors", "train_state.safetensors", "train_state.json"}
    for name, entry in info["files"].items():
        data = (folder / name).read_bytes()
        assert entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert verify_checkpoint(folder) is True
    assert not list((trained / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_each_kind_of_damage_is_detected_and_named(run, damage):
    name, spoil, reason = DAMAGE[damage]
    folder = checkpoint_dir(run, 12)
    spoil(folder / name)
    with pytest.raises(CheckpointError, match=reason):
        verify_checkpoint(folder)
    warnings: list[str] = []
    step, found, skipped = newest_good_checkpoint(run, warn=warnings.append)
    assert (step, found) == (8, checkpoint_dir(run, 8))
    assert [s["step"] for s in skipped] == [12] and reason in skipped[0]["reason"]
    assert len(warnings) == 1 and "step 12" in warnings[0] and reason in warnings[0]


@pytest.mark.parametrize("damage", ["truncated weights", "flipped byte in weights", "missing weights"])
def test_eval_falls_back_to_the_newest_good_checkpoint_and_says_so(run, damage, capsys):
    name, spoil, reason = DAMAGE[damage]
    good = evaluate_run(run, checkpoint=8, device="cpu", write=False)
    spoil(checkpoint_dir(run, 12) / name)
    assert main(["eval", str(run), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "skipping checkpoint step 12" in err and reason in err
    result = json.loads((run / "eval.json").read_text())
    assert result["checkpoint_step"] == 8
    assert result["val_loss"] == good["val_loss"]
    assert [s["step"] for s in result["skipped_checkpoints"]] == [12]
    assert reason in result["skipped_checkpoints"][0]["reason"]


def test_resume_falls_back_and_still_ends_exactly_where_the_run_did(run, trained, capsys):
    # Dropout is on: the fallback resume must replay steps 9-12 with the same masks.
    truncate(checkpoint_dir(run, 12) / "model.safetensors")
    assert main(["train", "--resume", str(run)]) == 0
    err = capsys.readouterr().err
    assert "skipping checkpoint step 12" in err and "resuming" in err and "from step 8" in err
    assert last_loss(run) == last_loss(trained)
    meta = json.loads((run / "meta.json").read_text())
    assert meta["resumed_from"] == 8 and [s["step"] for s in meta["skipped_checkpoints"]] == [12]
    assert verify_checkpoint(checkpoint_dir(run, 12)) is True  # rewritten whole


def test_no_good_checkpoint_is_one_line_and_exit_2_for_resume_and_eval(run, capsys):
    for step in (4, 8, 12):
        flip_byte(checkpoint_dir(run, step) / "model.safetensors")
    assert_one_line_error(main(["train", "--resume", str(run)]), _last_line(capsys), "verifies", "step 4")
    assert_one_line_error(main(["eval", str(run), "--device", "cpu"]), _last_line(capsys), "verifies", "step 12")
    assert not (run / "eval.json").exists()


def _last_line(capsys) -> str:
    """stderr without the per-checkpoint 'skipping' warnings that precede the error."""
    err = capsys.readouterr().err
    return "\n".join(line for line in err.splitlines() if not line.startswith("skipping checkpoint"))


def test_named_checkpoint_that_is_bad_or_unknown_is_an_error_not_a_fallback(run, capsys):
    truncate(checkpoint_dir(run, 8) / "model.safetensors")
    assert_one_line_error(main(["eval", str(run), "--checkpoint", "8", "--device", "cpu"]),
                          capsys.readouterr().err, "step 8", "is bad", "model.safetensors", "truncated")
    assert_one_line_error(main(["eval", str(run), "--checkpoint", "99", "--device", "cpu"]),
                          capsys.readouterr().err, "no checkpoint at step 99", "[4, 8, 12]")
    with pytest.raises(CheckpointError, match="is bad"):
        checkpoint_at(run, 8)
    assert main(["eval", str(run), "--checkpoint", "4", "--device", "cpu"]) == 0
    assert json.loads((run / "eval.json").read_text())["checkpoint_step"] == 4


def test_checkpoint_without_manifest_loads_with_a_warning_and_is_still_length_checked(run, capsys):
    """Checkpoints written before manifests existed: loaded unverified, but a cut file is caught."""
    for step in (8, 12):
        info_path = checkpoint_dir(run, step) / "info.json"
        info = json.loads(info_path.read_text())
        info_path.write_text(json.dumps({"step": info["step"], "time": info["time"]}))
    assert verify_checkpoint(checkpoint_dir(run, 12)) is False
    assert main(["eval", str(run), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "step 12 has no manifest" in err and "unverified" in err
    assert json.loads((run / "eval.json").read_text())["checkpoint_step"] == 12

    truncate(checkpoint_dir(run, 12) / "model.safetensors")
    step, _, skipped = newest_good_checkpoint(run, warn=None)
    assert step == 8 and "truncated" in skipped[0]["reason"]
