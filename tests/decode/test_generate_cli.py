"""``aah generate RUN_DIR``: streamed text from a run's checkpoint, and one-line errors (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aah.cli import main
from aah.config import load_config, save_config
from aah.data.tokenizers import ByteTokenizer
from aah.decode.generate import generate
from aah.train.checkpoint import (
    MODEL_FILE,
    STATE_JSON,
    STATE_TENSORS,
    checkpoint_dir,
    load_weights,
    save_checkpoint,
)
from aah.train.setup import model_from_config

SEQ_LEN = 32


def _overrides(regime: str) -> list[str]:
    return [
        f"aah.regime={regime}", "aah.windows=[4,8,16,32]",
        "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2",
        f"data.seq_len={SEQ_LEN}", "data.corpus=unused", "train.device=cpu",
    ]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder as ``aah train`` leaves it: config.yaml and two checkpoints (steps 3 and 6)."""
    root = tmp_path_factory.mktemp("run")
    cfg = load_config(None, _overrides("full_adaptive"))
    save_config(cfg, root / "config.yaml")
    model = model_from_config(cfg, 256)
    for step, windows in ((3, (32, 32, 32, 32)), (6, (4, 8, 16, 32))):
        for ctrl in model.controllers():
            ctrl.pin_windows(windows)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        save_checkpoint(root, step, model, {"step": step})
    return root


def _generate(run: Path, *args: str) -> list[str]:
    return ["generate", str(run), *args]


def _expected(run: Path, step: int, prompt: str, n: int) -> str:
    cfg = load_config(run / "config.yaml")
    model = model_from_config(cfg, 256)
    load_weights(checkpoint_dir(run, step), model)
    ids = torch.tensor(ByteTokenizer().encode(prompt))
    return ByteTokenizer().decode(generate(model, ids, n, use_cache=False).tolist())


def test_greedy_text_equals_generation_without_cache(run_dir: Path, capsys) -> None:
    rc = main(_generate(run_dir, "--prompt", "To be, or", "--new-tokens", "12", "--temperature", "0"))
    assert rc == 0
    out, err = capsys.readouterr()
    assert out == _expected(run_dir, 6, "To be, or", 12) + "\n"  # newest checkpoint, prompt echoed
    assert out.startswith("To be, or")
    last = err.strip().splitlines()[-1]
    assert "12 new tokens from checkpoint step 6" in last and "tokens/s" in last and "KV cache" in last
    assert "decode step: compiled" in last or "decode step: pytorch (" in last


def test_checkpoint_prompt_file_and_seeded_sampling(run_dir: Path, tmp_path: Path, capsys) -> None:
    rc = main(_generate(run_dir, "--prompt", "ab", "--new-tokens", "5", "--temperature", "0", "--checkpoint", "3"))
    assert rc == 0
    out, err = capsys.readouterr()
    assert out == _expected(run_dir, 3, "ab", 5) + "\n"
    assert "checkpoint step 3" in err
    # The step-3 windows are full (32): the KV cache is a full cache of the 6 fed positions.
    assert "(1.000 of a full cache" in err
    prompt = tmp_path / "p.txt"
    prompt.write_text("héllo", encoding="utf-8")
    runs = []
    for seed in ("1", "1", "2"):
        args = ["--prompt-file", str(prompt), "--new-tokens", "20", "--seed", seed, "--top-k", "50", "--top-p", "0.9"]
        assert main(_generate(run_dir, *args)) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] != runs[2]
    assert runs[0].startswith("héllo")


def test_streaming_holds_back_a_split_character() -> None:
    import io

    from aah.decode.cli import _TextStream

    buf = io.StringIO()
    stream = _TextStream(ByteTokenizer(), list(b"a"), buf)
    stream.push()
    writes = []
    for byte in "é!".encode():
        stream.push(byte)
        writes.append(buf.getvalue())
    assert writes == ["a", "aé", "aé!"]  # nothing printed for the first half of é


def _error(argv: list[str], capsys) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aah generate: "), err
    assert "Traceback" not in err
    return lines[0]


def test_every_bad_input_is_one_line_and_exit_2(run_dir: Path, tmp_path: Path, capsys) -> None:
    p = ["--prompt", "hi"]
    cases = [
        (_generate(run_dir, "--prompt", ""), "the prompt is empty"),
        (_generate(run_dir), "exactly one of --prompt"),
        (_generate(run_dir, "--prompt", "a", "--prompt-file", "x"), "exactly one of --prompt"),
        (_generate(run_dir, "--prompt-file", str(tmp_path / "missing.txt")), "no such file"),
        (_generate(run_dir, "--prompt", "x" * (SEQ_LEN + 1)), "longer than the model's length 32"),
        (_generate(run_dir, "--prompt", "x" * 30, "--new-tokens", "4"), "at most 3 new tokens"),
        (_generate(run_dir, *p, "--checkpoint", "5"), "no checkpoint at step 5"),
        (_generate(run_dir, *p, "--checkpoint", "-1"), "--checkpoint"),
        (_generate(tmp_path, *p), "not a run folder"),
        (_generate(tmp_path / "nowhere", *p), "is not a folder"),
        (_generate(run_dir, *p, "--new-tokens", "0"), "--new-tokens"),
        (_generate(run_dir, *p, "--temperature", "-1"), "--temperature"),
        (_generate(run_dir, *p, "--top-k", "0"), "--top-k"),
        (_generate(run_dir, *p, "--top-p", "1.5"), "--top-p"),
        (_generate(run_dir, *p, "--temperature", "inf"), "--temperature must be a finite number >= 0, got inf"),
        (_generate(run_dir, *p, "--temperature", "nan"), "--temperature must be a finite number"),
        (_generate(run_dir, *p, "--top-p", "nan"), "--top-p must be in (0, 1]"),
        (_generate(run_dir, "--prompt-file", str(tmp_path)), "is a directory, not a file"),
    ]
    bad_bytes = tmp_path / "latin1.txt"
    bad_bytes.write_bytes(b"caf\xe9")
    cases.append((_generate(run_dir, "--prompt-file", str(bad_bytes)), "UTF-8"))
    empty_file = tmp_path / "empty.txt"
    empty_file.write_text("")
    cases.append((_generate(run_dir, "--prompt-file", str(empty_file)), "the prompt is empty"))
    for argv, message in cases:
        assert message in _error(argv, capsys), argv
    assert main(_generate(run_dir, "--prompt", "x" * 30, "--new-tokens", "3")) == 0  # the limit itself fits
    capsys.readouterr()


def test_damaged_runs_are_one_line_errors(run_dir: Path, tmp_path: Path, capsys) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    (broken / "config.yaml").write_text("model:\n  n_heads: three\n")
    assert "config.yaml" in _error(_generate(broken, "--prompt", "hi"), capsys)
    empty = tmp_path / "empty_run"
    empty.mkdir()
    shutil.copy(run_dir / "config.yaml", empty / "config.yaml")
    assert "has no checkpoint" in _error(_generate(empty, "--prompt", "hi"), capsys)
    truncated = tmp_path / "truncated"
    shutil.copytree(run_dir, truncated)
    weights = checkpoint_dir(truncated, 6) / MODEL_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    line = _error(_generate(truncated, "--prompt", "hi", "--checkpoint", "6"), capsys)
    assert "step 6" in line


def _damaged_copy(run_dir: Path, tmp_path: Path, step: int) -> Path:
    """A copy of the run whose checkpoint at ``step`` has one flipped byte in its weights."""
    import shutil

    copy = tmp_path / f"damaged_{step}"
    shutil.copytree(run_dir, copy)
    weights = checkpoint_dir(copy, step) / MODEL_FILE
    data = bytearray(weights.read_bytes())
    data[len(data) * 3 // 4] ^= 0x01  # inside the tensor data: the file still parses
    weights.write_bytes(bytes(data))
    return copy


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_good_one(run_dir: Path, tmp_path: Path, capsys) -> None:
    damaged = _damaged_copy(run_dir, tmp_path, 6)
    rc = main(_generate(damaged, "--prompt", "To be", "--new-tokens", "6", "--temperature", "0"))
    out, err = capsys.readouterr()
    assert rc == 0
    assert out == _expected(run_dir, 3, "To be", 6) + "\n"  # the weights of step 3, not the damaged 6
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("skipping checkpoint step 6") and "sha256" in lines[0]
    assert "from checkpoint step 3" in lines[1]


def test_a_named_damaged_checkpoint_is_an_error_not_a_fallback(run_dir: Path, tmp_path: Path, capsys) -> None:
    damaged = _damaged_copy(run_dir, tmp_path, 6)
    line = _error(_generate(damaged, "--prompt", "hi", "--checkpoint", "6"), capsys)
    assert "checkpoint step 6" in line and "is bad" in line and "sha256" in line
    assert main(_generate(damaged, "--prompt", "hi", "--new-tokens", "2", "--checkpoint", "3")) == 0
    assert "skipping" not in capsys.readouterr().err


def test_no_checkpoint_that_verifies_is_an_error_after_the_warnings(run_dir: Path, tmp_path: Path, capsys) -> None:
    damaged = _damaged_copy(_damaged_copy(run_dir, tmp_path, 6), tmp_path, 3)
    assert main(_generate(damaged, "--prompt", "hi")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # As for aah eval: one warning per skipped checkpoint, then the one-line error.
    assert [line.split(" (")[0] for line in lines[:2]] == ["skipping checkpoint step 6", "skipping checkpoint step 3"]
    assert len(lines) == 3 and lines[2].startswith("aah generate: no checkpoint of") and "verifies" in lines[2]


def test_generation_never_reads_the_training_state(run_dir: Path, tmp_path: Path, capsys) -> None:
    import shutil

    run = tmp_path / "no_state"
    shutil.copytree(run_dir, run)
    (checkpoint_dir(run, 6) / STATE_JSON).unlink()
    (checkpoint_dir(run, 6) / STATE_TENSORS).write_bytes(b"not a tensor file")
    assert main(_generate(run, "--prompt", "To be", "--new-tokens", "6", "--temperature", "0")) == 0
    out, err = capsys.readouterr()
    assert out == _expected(run_dir, 6, "To be", 6) + "\n"
    assert "skipping" not in err
