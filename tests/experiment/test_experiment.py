"""Suites: planning, skipping complete runs, resuming interrupted ones, and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from aah.config import ConfigError
from aah.errors import CLIError
from aah.experiment import load_suite, plan_runs, run_state, run_suite
from aah.experiment.cli import run_experiment

REPO = Path(__file__).resolve().parents[2]


def test_every_shipped_suite_plans_valid_runs(tmp_path):
    for path in sorted((REPO / "configs" / "suites").glob("*/*.yaml")):
        suite = load_suite(path)
        specs = plan_runs(suite, tmp_path)
        assert len(specs) == len(suite.regimes) * len(suite.seeds), path
    quick = load_suite(REPO / "configs/suites/cpu/quick.yaml")
    assert quick.regimes == ("full_attention", "grouping_off", "full_adaptive", "shallow_freeze",
                             "deep_practical_reuse")


def test_unknown_regime_in_a_suite_is_rejected(tmp_path, tiny_suite):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"config_dir": str(tiny_suite.parent / "configs"), "regimes": ["nope"]}))
    with pytest.raises(ConfigError, match="unknown regime 'nope'"):
        load_suite(bad)


def test_suite_runs_skips_complete_runs_and_reports_seed_statistics(tiny_suite, tmp_path, capsys):
    out = tmp_path / "out"
    code = run_experiment(str(tiny_suite), str(out), None, 1)
    assert code == 0
    specs = plan_runs(load_suite(tiny_suite), out)
    assert all(run_state(s.run_dir) == "done" for s in specs)
    report = (out / "report" / "report.md").read_text()
    assert "Full attention" in report and "Shallow freeze" in report
    printed = capsys.readouterr().out
    assert "Shallow freeze" in printed and "report:" in printed
    stamps = {s.run_dir: (s.run_dir / "eval.json").stat().st_mtime_ns for s in specs}
    _, failures = run_suite(load_suite(tiny_suite), out)
    assert not failures
    assert all((d / "eval.json").stat().st_mtime_ns == t for d, t in stamps.items()), "complete runs re-ran"
    meta = json.loads((specs[0].run_dir / "meta.json").read_text())
    assert meta["seed"] == specs[0].seed


def test_interrupted_run_is_resumed_not_restarted(tiny_suite, tmp_path):
    out = tmp_path / "out"
    suite = load_suite(tiny_suite)
    run_suite(suite, out, seeds=(0,))
    spec = plan_runs(suite, out, seeds=(0,))[1]
    meta_path = spec.run_dir / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["status"] = "interrupted"
    meta_path.write_text(json.dumps(meta))
    (spec.run_dir / "eval.json").unlink()
    assert run_state(spec.run_dir) == "resume"
    run_suite(suite, out, seeds=(0,))
    assert run_state(spec.run_dir) == "done"
    assert json.loads(meta_path.read_text())["resumed_from"] == 4


def test_changed_overrides_do_not_reuse_old_runs(tiny_suite, tmp_path):
    out = tmp_path / "out"
    suite = load_suite(tiny_suite)
    run_suite(suite, out, seeds=(0,))
    before = {s.run_dir: (s.run_dir / "eval.json").stat().st_mtime_ns for s in plan_runs(suite, out, seeds=(0,))}
    _, failures = run_suite(suite, out, seeds=(0,), extra_overrides=("optim.lr=0.01",))
    assert len(failures) == 2
    assert all("different config" in detail and "optim.lr" in detail for _, _, detail in failures)
    assert all((d / "eval.json").stat().st_mtime_ns == t for d, t in before.items())


def test_rows_run_only_the_named_rows_and_the_report_covers_every_finished_run(tiny_suite, tmp_path, capsys):
    out = tmp_path / "out"
    suite = load_suite(tiny_suite)
    run_suite(suite, out, seeds=(0,), rows=("shallow_freeze",))
    states = {s.name: run_state(s.run_dir) for s in plan_runs(suite, out)}
    assert states == {"full_attention/seed0": "fresh", "shallow_freeze/seed0": "done",
                      "full_attention/seed1": "fresh", "shallow_freeze/seed1": "fresh"}
    assert run_experiment(str(tiny_suite), str(out), [0], 1, rows=["full_attention"]) == 0
    states = {s.name: run_state(s.run_dir) for s in plan_runs(suite, out)}
    assert [name for name, state in states.items() if state == "done"] == ["full_attention/seed0",
                                                                           "shallow_freeze/seed0"]
    report = (out / "report" / "report.md").read_text()
    assert "2 run(s) of 2 regime(s)" in report  # shallow_freeze's run is the first call's
    with pytest.raises(CLIError, match=r"--rows: unknown row\(s\) \['nope'\]; the suite's rows: full_attention, shallow_freeze"):
        run_experiment(str(tiny_suite), str(out), None, 1, rows=["nope"])


def _fake_calls(monkeypatch, behaviour):
    """Replace the run subprocesses of a suite by ``behaviour(cmd) -> exit status``; returns the calls."""
    import aah.experiment.suite as suite_module

    calls = []

    def call(cmd, **kwargs):
        calls.append(cmd[3:5] if cmd[3] == "train" and cmd[4] == "--resume" else cmd[3:4])
        return behaviour(cmd)

    monkeypatch.setattr(suite_module.subprocess, "call", call)
    return calls


def test_a_run_stopped_by_a_signal_stops_the_suite(tiny_suite, tmp_path, monkeypatch, capsys):
    calls = _fake_calls(monkeypatch, lambda cmd: 130)  # the first run is interrupted
    code = run_experiment(str(tiny_suite), str(tmp_path / "out"), None, 1)
    assert code == 130
    assert calls == [["train"]]  # no other run started, and the stopped one is not evaluated
    err = capsys.readouterr().err
    assert "stopped; 4 runs left" in err and "not started: the suite was stopped" in err
    assert "run the same command again to resume" in err and "failed" not in err


def test_sigterm_to_the_suite_starts_no_new_run_and_restores_the_handlers(tiny_suite, tmp_path, monkeypatch):
    import os
    import signal
    import time

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def train_then_signal(cmd):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the first run trains
        time.sleep(0.5)  # the run goes on a while: the main thread handles the signal meanwhile
        return 0

    calls = _fake_calls(monkeypatch, train_then_signal)
    specs, failures = run_suite(load_suite(tiny_suite), tmp_path / "out")
    assert calls == [["train"]]  # its evaluation and the other runs were left
    assert [f[1] for f in failures] == [130] * 4
    assert failures[0][2].startswith("trained, not evaluated")
    assert {f[2] for f in failures[1:]} == {"not started: the suite was stopped"}
    assert {sig: signal.getsignal(sig) for sig in before} == before


def _no_runs(monkeypatch):
    """Any run subprocess the suite starts fails the test (the calls are returned too)."""
    return _fake_calls(monkeypatch, lambda cmd: pytest.fail(f"a run was started: {cmd[3:5]}"))


def test_records_keep_finished_runs_and_a_fresh_output_folder_takes_them(tiny_suite, tmp_path, monkeypatch, capsys):
    from aah.experiment import RECORD_FILES

    records = tmp_path / "records"
    assert run_experiment(str(tiny_suite), str(tmp_path / "first"), None, 1, records=str(records)) == 0
    kept = sorted(p.relative_to(records).as_posix() for p in records.rglob("*") if p.is_file())
    assert kept == sorted(f"{row}/seed{seed}/{name}" for row in ("full_attention", "shallow_freeze")
                          for seed in (0, 1) for name in (*RECORD_FILES, "manifest.json"))  # no checkpoints
    capsys.readouterr()

    _no_runs(monkeypatch)  # a fresh folder (another machine, a clean clone) trains nothing again
    out = tmp_path / "second"
    assert run_experiment(str(tiny_suite), str(out), None, 1, records=str(records)) == 0
    specs = plan_runs(load_suite(tiny_suite), out)
    assert all(run_state(s.run_dir) == "done" for s in specs)
    for s in specs:
        assert (s.run_dir / "eval.json").read_bytes() == (records / s.regime / f"seed{s.seed}" / "eval.json").read_bytes()
    assert "4 run(s) of 2 regime(s)" in (out / "report" / "report.md").read_text()
    assert capsys.readouterr().err.count("restored ") == 4


def test_runs_finished_before_records_were_asked_for_are_recorded(tiny_suite, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    suite = load_suite(tiny_suite)
    run_suite(suite, out, seeds=(0,))
    _no_runs(monkeypatch)
    records = tmp_path / "records"
    _, failures = run_suite(suite, out, seeds=(0,), records=records)
    assert not failures
    assert sorted(p.parent.name for p in records.glob("*/seed0")) == ["full_attention", "shallow_freeze"]
    assert "recorded full_attention/seed0" in capsys.readouterr().err


def test_finished_runs_and_records_name_their_suite_row(tiny_suite, tmp_path, monkeypatch):
    """meta.json's ``suite_row`` (what the report groups a variant by), on runs and records alike,
    also on those finished before the suite wrote it."""
    out = tmp_path / "out"
    suite = load_suite(tiny_suite)
    run_suite(suite, out, seeds=(0,))
    for row in ("full_attention", "shallow_freeze"):
        meta = json.loads((out / row / "seed0" / "meta.json").read_text())
        assert meta["suite_row"] == row and meta["status"] == "complete"
        del meta["suite_row"]
        (out / row / "seed0" / "meta.json").write_text(json.dumps(meta))
    _no_runs(monkeypatch)
    records = tmp_path / "records"
    run_suite(suite, out, seeds=(0,), records=records)
    for folder in (out, records):
        assert json.loads((folder / "shallow_freeze" / "seed0" / "meta.json").read_text())["suite_row"] == "shallow_freeze"


def test_a_record_replaces_a_partial_run_of_the_same_config(tiny_suite, tmp_path, monkeypatch):
    suite = load_suite(tiny_suite)
    records = tmp_path / "records"
    run_suite(suite, tmp_path / "first", seeds=(0,), records=records)
    out = tmp_path / "out"
    spec = plan_runs(suite, out, seeds=(0,))[0]
    run_suite(suite, out, seeds=(0,), rows=(spec.regime,))
    meta = json.loads((spec.run_dir / "meta.json").read_text())
    meta["status"] = "interrupted"
    (spec.run_dir / "meta.json").write_text(json.dumps(meta))
    (spec.run_dir / "eval.json").unlink()
    assert run_state(spec.run_dir) == "resume"
    _no_runs(monkeypatch)
    _, failures = run_suite(suite, out, seeds=(0,), records=records)
    assert not failures and run_state(spec.run_dir) == "done"
    assert not (spec.run_dir / "checkpoints").exists()  # the record's files, not the partial run's


def test_a_record_of_another_config_is_an_error_and_nothing_is_copied(tiny_suite, tmp_path, monkeypatch):
    suite = load_suite(tiny_suite)
    records = tmp_path / "records"
    run_suite(suite, tmp_path / "first", seeds=(0,), records=records)
    before = {p: p.read_bytes() for p in records.rglob("*") if p.is_file()}
    _no_runs(monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"seed0 was trained with a different config \(optim\.lr differ\); "
                                          r"remove it or choose another --records"):
        run_suite(suite, out, seeds=(0,), extra_overrides=("optim.lr=0.01",), records=records)
    assert not out.exists()
    assert {p: p.read_bytes() for p in records.rglob("*") if p.is_file()} == before
    with pytest.raises(CLIError, match="different config"):
        run_experiment(str(tiny_suite), str(out), [0], 1, overrides=["optim.lr=0.01"], records=str(records))


def test_an_output_run_of_another_config_is_left_alone_when_a_record_exists(tiny_suite, tmp_path):
    suite = load_suite(tiny_suite)
    records = tmp_path / "records"
    run_suite(suite, tmp_path / "first", seeds=(0,), records=records)
    out = tmp_path / "out"
    run_suite(suite, out, seeds=(0,), extra_overrides=("optim.lr=0.01",))
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("eval.json")}
    _, failures = run_suite(suite, out, seeds=(0,), records=records)
    assert len(failures) == 2 and all("choose another --out" in detail for _, _, detail in failures)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("eval.json")} == stamps


def test_records_must_be_a_folder(tiny_suite, tmp_path):
    not_a_folder = tmp_path / "records"
    not_a_folder.write_text("x")
    with pytest.raises(CLIError, match=r"--records: .*records is a file, not a folder"):
        run_experiment(str(tiny_suite), str(tmp_path / "out"), None, 1, records=str(not_a_folder))


def test_runs_share_the_cores_this_process_may_use(monkeypatch):
    # Under ``taskset -c 0`` a suite has one core, whatever the machine has.
    from aah.experiment import suite as suite_mod

    monkeypatch.setattr(suite_mod.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(suite_mod.os, "cpu_count", lambda: 64)
    assert suite_mod.usable_cores() == 1
    monkeypatch.setattr(suite_mod.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert suite_mod.usable_cores() == 3
