"""Records of finished runs: their checksum manifest, what a damaged record does, and file permissions.

The runs here are written by hand (what ``aah train`` and ``aah eval`` leave, no checkpoints),
so nothing trains: a run the suite starts again is a fake that writes the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest

from aah.config import load_config, save_config
from aah.data._files import atomic_path
from aah.errors import CLIError
from aah.experiment import RECORD_FILES, load_suite, plan_runs, run_state, run_suite, verify_record
from aah.experiment.cli import run_experiment
from aah.experiment.records import copy_record


def _finished_run(spec) -> None:
    """The files a trained and evaluated run of ``spec`` leaves in its folder."""
    run = spec.run_dir
    run.mkdir(parents=True, exist_ok=True)
    save_config(load_config(spec.config, spec.overrides), run / "config.yaml")
    (run / "meta.json").write_text(json.dumps({"status": "complete", "regime": spec.regime, "seed": spec.seed}))
    lines = [{"kind": "train", "step": s, "loss": 6.0 - s / 10, "tokens_per_s": 100.0 * s} for s in (1, 2, 3, 4)]
    lines += [{"kind": "eval", "step": s, "val_loss": 5.9 - s / 10} for s in (2, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run / "eval.json").write_text(json.dumps({"val_loss": 5.5, "val_ppl": 244.7, "checkpoint_step": 4}))


def _fake_runs(monkeypatch, specs) -> list[str]:
    """Run subprocesses replaced: ``train`` writes a finished run, ``eval`` does nothing. Returns the
    names of the runs trained."""
    import aah.experiment.suite as suite_module

    by_dir = {str(s.run_dir): s for s in specs}
    trained = []

    def call(cmd, **kwargs):
        if cmd[3] == "train":
            spec = by_dir[cmd[-1]]
            trained.append(spec.name)
            _finished_run(spec)
        return 0

    monkeypatch.setattr(suite_module.subprocess, "call", call)
    return trained


@pytest.fixture
def recorded(tiny_suite, tmp_path, monkeypatch):
    """Seed 0 of the tiny suite finished in ``first`` and kept as records: (suite, records folder)."""
    suite = load_suite(tiny_suite)
    for spec in plan_runs(suite, tmp_path / "first", seeds=(0,)):
        _finished_run(spec)
    records = tmp_path / "records"
    _, failures = run_suite(suite, tmp_path / "first", seeds=(0,), records=records)
    assert not failures
    return suite, records


def test_a_record_holds_a_manifest_of_its_files(recorded):
    _, records = recorded
    for row in ("full_attention", "shallow_freeze"):
        folder = records / row / "seed0"
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["format"] == 1 and sorted(manifest["files"]) == sorted(RECORD_FILES)
        for name, entry in manifest["files"].items():
            data = (folder / name).read_bytes()
            assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        verify_record(folder, RECORD_FILES)


def _cut(path, keep):
    path.write_bytes(path.read_bytes()[:keep(path.stat().st_size)])


def _edit_val_loss(path):
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "val_loss": 0.1}))


DAMAGE = {
    "metrics.jsonl cut mid-line": ("metrics.jsonl", lambda p: _cut(p, lambda n: n - 10), "truncated?"),
    "eval.json truncated": ("eval.json", lambda p: _cut(p, lambda n: n // 2), "truncated?"),
    "eval.json edited": ("eval.json", _edit_val_loss, "does not match its sha256"),
    "meta.json truncated": ("meta.json", lambda p: _cut(p, lambda n: n // 2), "truncated?"),
    "config.yaml missing": ("config.yaml", lambda p: p.unlink(), "is missing"),
    "eval.json missing": ("eval.json", lambda p: p.unlink(), "is missing"),
    "no manifest (half-written)": ("manifest.json", lambda p: p.unlink(), "never completed"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_record_is_not_used_the_run_trains_again_and_is_recorded_anew(recorded, tmp_path, monkeypatch,
                                                                                capsys, damage):
    suite, records = recorded
    name, spoil, why = DAMAGE[damage]
    folder = records / "full_attention" / "seed0"
    spoil(folder / name)
    out = tmp_path / "second"
    specs = plan_runs(suite, out, seeds=(0,))
    trained = _fake_runs(monkeypatch, specs)
    capsys.readouterr()
    _, failures = run_suite(suite, out, seeds=(0,), records=records)
    err = capsys.readouterr().err
    assert not failures and trained == ["full_attention/seed0"]  # the damaged record only
    (warning,) = [line for line in err.splitlines() if line.startswith("warning:")]
    assert f"{folder / name} " in warning and why in warning and "trains again" in warning
    assert "restored shallow_freeze/seed0" in err and "restored full_attention" not in err
    verify_record(folder, RECORD_FILES)  # the run's new record replaced the damaged one
    assert all(run_state(s.run_dir) == "done" for s in specs)


def test_a_damaged_record_is_recorded_anew_from_a_finished_run(recorded, tmp_path, monkeypatch, capsys):
    suite, records = recorded
    folder = records / "shallow_freeze" / "seed0"
    _edit_val_loss(folder / "eval.json")
    trained = _fake_runs(monkeypatch, [])
    _, failures = run_suite(suite, tmp_path / "first", seeds=(0,), records=records)
    assert not failures and not trained
    err = capsys.readouterr().err
    assert f"{folder / 'eval.json'} does not match its sha256" in err and "recorded again from" in err
    assert "recorded shallow_freeze/seed0" in err
    verify_record(folder, RECORD_FILES)
    assert json.loads((folder / "eval.json").read_text())["val_loss"] == 5.5


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files of any mode")
def test_an_unreadable_record_file_is_a_warning_naming_it(recorded, tmp_path, monkeypatch, capsys):
    suite, records = recorded
    path = records / "full_attention" / "seed0" / "eval.json"
    path.chmod(0)
    try:
        out = tmp_path / "second"
        trained = _fake_runs(monkeypatch, plan_runs(suite, out, seeds=(0,)))
        run_suite(suite, out, seeds=(0,), records=records)
    finally:
        path.chmod(0o644)
    assert trained == ["full_attention/seed0"]
    assert f"{path} cannot be read" in capsys.readouterr().err


def test_an_unreadable_meta_json_in_the_output_folder_is_one_line(recorded, tiny_suite, tmp_path):
    _, records = recorded
    meta = tmp_path / "first" / "full_attention" / "seed0" / "meta.json"
    meta.write_text('{"status": "compl')
    with pytest.raises(CLIError, match=rf"{meta} cannot be read \(.*\); remove .*seed0 to run it again"):
        run_experiment(str(tiny_suite), str(tmp_path / "first"), [0], 1, records=str(records))


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_files_written_atomically_and_records_take_the_umask(tmp_path, umask, mode):
    source = tmp_path / "run"
    source.mkdir()
    for name in RECORD_FILES:
        (source / name).write_text("{}\n")
        (source / name).chmod(0o600)  # as a run folder may hold them
    previous = os.umask(umask)
    try:
        with atomic_path(tmp_path / "file.json") as tmp:
            tmp.write_text("{}\n")
        copy_record(source, tmp_path / "record", manifest=True)
    finally:
        os.umask(previous)
    written = [tmp_path / "file.json", *(tmp_path / "record").iterdir()]
    assert len(written) == len(RECORD_FILES) + 2
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in written} == {p.name: mode for p in written}
