"""Random and corrupted inputs to the command line and the file loaders: each is a typed error or
exit status 2 with one line, never a traceback and never a silent success."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from aah.cli import build_parser, main

SEED = 20261207


def _corrupt(data: bytes, rng: random.Random) -> bytes:
    """``data`` truncated, with bytes flipped, garbage inserted, or replaced by noise."""
    kind = rng.choice(("truncate", "flip", "insert", "noise", "empty"))
    if kind == "truncate":
        return data[: rng.randrange(len(data))]
    if kind == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(out))
            out[i] = (out[i] + rng.randint(1, 255)) % 256
        return bytes(out)
    if kind == "insert":
        i = rng.randrange(len(data))
        return data[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + data[i:]
    if kind == "noise":
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 400)))
    return b""


def test_corrupted_windows_files_are_refused_or_read_unchanged(tmp_path):
    """A windows file loads as written or raises ValueError naming it: a damaged file is never
    read as other windows or other metadata."""
    from aah.hf.bridge.windows_file import load_windows, save_windows

    windows = torch.tensor([[8, 8, 16, 16], [4, 4, 64, 64]])
    meta = {"model": {"model_type": "llama", "num_layers": 2, "num_query_heads": 4, "num_kv_heads": 2, "head_dim": 8},
            "seq_len": 64, "policy": "uniform", "budget": 0.5, "sink_tokens": 4, "acr": 0.4, "causal_coverage": 0.5}
    good = save_windows(tmp_path / "good.safetensors", windows, meta).read_bytes()
    rng = random.Random(SEED)
    refused = 0
    for trial in range(1000):
        path = tmp_path / f"bad{trial}.safetensors"
        path.write_bytes(_corrupt(good, rng))
        try:
            loaded, loaded_meta = load_windows(path)
        except ValueError as exc:
            assert str(path) in str(exc) and "\n" not in str(exc)
            refused += 1
        else:
            assert torch.equal(loaded, windows) and loaded_meta == meta, path.read_bytes()
    assert refused > 850  # nearly every corruption touches what the file says


def _options(command: list[str]) -> list[str]:
    """The option strings of an ``aah`` sub-command's parser."""
    parser = build_parser()
    for word in command:
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[word]
    return [s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")]


def _broken_inputs(root: Path, rng: random.Random) -> dict[str, Path]:
    """A damaged file or folder for each positional the fuzzed commands read."""
    noise = bytes(rng.randrange(256) for _ in range(200))
    config = root / "config.yaml"
    config.write_bytes(b"train:\n  max_steps: [\n" + noise)
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_bytes(noise)
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_bytes(b'{"model_type": "llama", ' + noise)
    return {"config": config, "run": run, "model": model, "suite": config}


COMMANDS = {  # the sub-command and the kind of damaged positional it gets
    ("train",): "config",
    ("eval",): "run",
    ("generate",): "run",
    ("experiment",): "suite",
    ("hf", "calibrate"): "model",
    ("hf", "eval"): "model",
    ("hf", "retrieval"): "model",
    ("bench", "vllm"): "model",
}
VALUES = ["0", "-1", "1", "7", "2.5", "nan", "inf", "-inf", "", "x", "4,8", "4,,8", "-", "1e309", "\u00e9", ".", "/"]


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(COMMANDS), ids=" ".join)
def test_random_command_lines_end_in_one_line_and_exit_2(command, tmp_path, capsys):
    rng = random.Random(f"{SEED}{command}")
    inputs = _broken_inputs(tmp_path, rng)
    options = _options(list(command))
    for _ in range(25):
        argv = [*command, str(inputs[COMMANDS[command]])]
        for option in rng.sample(options, k=min(len(options), rng.randint(0, 4))):
            argv += [option, rng.choice(VALUES + [str(tmp_path), str(tmp_path / "missing" / "x")])]
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert "Traceback" not in err, (argv, err)
        last = err.strip().splitlines()[-1]
        assert last.startswith(("aah", "usage:")) or "error:" in last, (argv, err)


def test_corrupted_records_are_refused_naming_the_file(tmp_path):
    """A record (a run kept by ``aah experiment --records``) with any file damaged is refused by its
    manifest, naming the file; never read as a run with other numbers."""
    from aah.experiment import RecordError
    from aah.report.runs import load_run

    from .report.test_records import _record

    rng = random.Random(SEED + 1)
    for trial in range(60):
        folder = _record(tmp_path / f"r{trial}")
        damaged = folder / rng.choice(("config.yaml", "meta.json", "metrics.jsonl", "eval.json", "manifest.json"))
        before = damaged.read_bytes()
        after = _corrupt(before, rng)
        if after == before:
            continue
        damaged.write_bytes(after)
        with pytest.raises(RecordError) as refused:
            load_run(folder)
        assert damaged.name in str(refused.value) and "\n" not in str(refused.value)


def test_corrupted_answer_journals_are_refused_or_lose_only_damaged_answers(tmp_path):
    """A damaged answers journal is refused (its model line) or re-decodes the damaged answers:
    every answer it still gives is one that was written."""
    from aah.hf.evaluation.retrieval import AnswerJournal, JournalError
    from aah.hf.evaluation.tasks import Sample

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    samples = [Sample(task="passkey", length=64, depth=0.5, trial=t, input_ids=(1, 2, t), answers=("7",),
                      max_new_tokens=4, needle_depth=0.5) for t in range(12)]
    first = AnswerJournal(tmp_path / "good.jsonl", "m" * 16, "w" * 16)
    first.bind(model)
    written = {}
    for sample in samples:
        first.add("aah", sample, f"answer {sample.trial} is {sample.trial * 7919}")
        written[first.key("aah", sample)] = f"answer {sample.trial} is {sample.trial * 7919}"
    good = (tmp_path / "good.jsonl").read_bytes()
    rng = random.Random(SEED + 2)
    for trial in range(200):
        path = tmp_path / f"j{trial}.jsonl"
        path.write_bytes(_corrupt(good, rng))
        try:
            journal = AnswerJournal(path, "m" * 16, "w" * 16)
            journal.bind(model)
        except JournalError as exc:
            assert str(path) in str(exc) and "\n" not in str(exc)
            continue
        assert all(written.get(key) == text for key, text in journal.done.items()), path.read_bytes()
