"""Tests of the report package on synthetic run folders: statistics, tables, figures, CLI."""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from aah.report import cli as report_cli
from aah.report import load_runs, main_table_text, write_report
from aah.report.figures import bucket_matrix
from aah.report.runs import display_name, find_run_dirs
from aah.report.stats import (
    acr_from_fractions,
    bucket_fractions,
    mean,
    mean_fractions,
    paired_difference,
    sample_std,
    t_quantile_975,
)
from aah.report.tables import inference_table, screening_table, training_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CANDIDATES = [128, 256, 512, 1024]


# --- synthetic run folders -------------------------------------------------------------------
def make_run(root: Path, regime: str, seed: int, final_loss: float, *, eval_loss: float | None = None,
             windows: list[list[int]] | None = None, status: str = "complete", steps: int = 100,
             acr: float | None = 0.5, tokens_per_s: float = 1000.0, commit: str = "abc1234def5678",
             extra_lines: str = "") -> Path:
    """Write a run folder; validation loss decreases linearly to ``final_loss`` at ``steps``."""
    run = root / f"{regime}-s{seed}"
    run.mkdir(parents=True)
    full = regime == "full_attention"
    config = {"aah": {"regime": regime}, "train": {"seed": seed, "steps": steps},
              "data": {"seq_len": 1024}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    meta = {"regime": regime, "seed": seed, "backend": "dense", "device": "cpu", "torch": "2.13.0",
            "version": "0.1.0", "git_commit": commit, "start_time": "2026-01-01T00:00:00",
            "end_time": None, "status": status, "candidate_windows": CANDIDATES, "seq_len": 1024}
    (run / "meta.json").write_text(json.dumps(meta))
    lines = []
    for step in range(10, steps + 1, 10):
        train = {"kind": "train", "step": step, "loss": 5.0 - step / steps, "lr": 1e-3,
                 "grad_norm": 1.0, "tokens_per_s": tokens_per_s, "peak_mem_mb": 100.0 + step,
                 "windows_changed": 0, "time_s": step / 10}
        if not full:  # full-attention runs leave the AAH fields out
            train |= {"acr": acr, "causal_coverage": acr + 0.1, "acr_per_layer": [acr, acr],
                      "bucket_fractions": {"128": 0.25, "256": 0.25, "512": 0.25, "1024": 0.25},
                      "levels_used": 1.0 + step / steps}
        lines.append(json.dumps(train))
        if step % 20 == 0:
            val = final_loss + (steps - step) / steps
            lines.append(json.dumps({"kind": "eval", "step": step, "val_loss": val,
                                     "val_ppl": math.exp(val)}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + extra_lines)
    if eval_loss is not None:
        grid = windows or [[1024] * 4, [1024] * 4]
        ev = {"val_loss": eval_loss, "val_ppl": math.exp(eval_loss), "acr": 1.0 if full else 0.4,
              "causal_coverage": 1.0 if full else 0.45, "executed_coverage": 0.9,
              "bucket_fractions": bucket_fractions(grid, CANDIDATES), "windows": grid,
              "candidate_windows": CANDIDATES, "inference_tokens_per_s": 5000.0,
              "backend": "sdpa", "device": "cpu", "checkpoint_step": steps, "corpus": "synthetic",
              "seq_len": 1024}
        (run / "eval.json").write_text(json.dumps(ev))
    return run


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    """Full attention and shallow freeze on seeds 0-2, full adaptive on 0-2, grouping off on 1 and 3."""
    root = tmp_path / "runs"
    sf_windows = [[128, 128, 256, 1024], [512, 512, 1024, 1024]]
    for seed, loss in enumerate([3.0, 3.1, 3.2]):
        make_run(root, "full_attention", seed, loss, eval_loss=loss - 0.1, acr=None)
    for seed, loss in enumerate([2.9, 2.9, 2.9]):  # differences -0.1, -0.2, -0.3
        make_run(root, "shallow_freeze", seed, loss, eval_loss=loss - 0.1, windows=sf_windows)
    for seed, diff in enumerate([-0.05, -0.06, -0.04]):  # differences with sd 0.01
        make_run(root, "full_adaptive", seed, 3.0 + seed / 10 + diff, eval_loss=2.9 + seed / 10 + diff)
    make_run(root, "grouping_off", 1, 3.15)  # only seed 1 pairs with full attention; no eval.json
    make_run(root, "grouping_off", 3, 3.50)
    return root


def read_csv(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as fh:
        return {row["regime"]: row for row in csv.DictReader(fh)}


# --- statistics ------------------------------------------------------------------------------
def test_t_quantiles_match_published_values():
    assert t_quantile_975(1) == pytest.approx(12.706, abs=1e-3)
    assert t_quantile_975(2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile_975(10) == pytest.approx(2.228, abs=1e-3)
    assert t_quantile_975(30) == pytest.approx(2.042, abs=1e-3)
    # Beyond the table: the Cornish-Fisher expansion.
    assert t_quantile_975(31) == pytest.approx(2.0395, abs=1e-4)
    assert t_quantile_975(60) == pytest.approx(2.0003, abs=1e-4)
    assert t_quantile_975(120) == pytest.approx(1.9799, abs=1e-4)
    assert t_quantile_975(10**6) == pytest.approx(1.95996, abs=1e-4)
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_mean_and_sample_std():
    assert mean([1.0, 2.0, 6.0]) == pytest.approx(3.0)
    assert sample_std([1.0, 2.0, 6.0]) == pytest.approx(math.sqrt(7.0))  # (4+1+9)/2
    assert mean([]) is None
    assert sample_std([5.0]) is None


def test_paired_difference_hand_computed_interval():
    regime = {0: 1.1, 1: 1.2, 2: 1.3}
    full = {0: 1.0, 1: 1.0, 2: 1.0}
    diff = paired_difference(regime, full)
    assert diff.n == 3
    assert diff.mean == pytest.approx(0.2)
    assert diff.std == pytest.approx(0.1)
    assert diff.half_width == pytest.approx(4.302653 * 0.1 / math.sqrt(3))
    assert diff.half_width == pytest.approx(0.2484, abs=1e-4)
    assert diff.ci == pytest.approx((0.2 - 0.24841, 0.2 + 0.24841), abs=1e-4)
    assert diff.significant is False


def test_paired_difference_uses_only_common_seeds():
    regime = {0: 5.0, 1: 2.0, 2: 3.0, 7: 100.0}
    full = {1: 1.0, 2: 1.5, 3: -50.0}
    diff = paired_difference(regime, full)
    assert diff.seeds == (1, 2)
    assert diff.differences == pytest.approx((1.0, 1.5))
    assert diff.mean == pytest.approx(1.25)
    assert diff.half_width == pytest.approx(12.706205 * math.sqrt(0.125) / math.sqrt(2))
    assert paired_difference({0: 1.0}, {1: 1.0}) is None


def test_paired_difference_single_seed_and_significance():
    one = paired_difference({4: 2.5}, {4: 2.0, 5: 9.0})
    assert one.n == 1 and one.mean == pytest.approx(0.5)
    assert one.ci is None and one.significant is None
    sig = paired_difference({0: 0.95, 1: 1.04, 2: 1.16}, {0: 1.0, 1: 1.1, 2: 1.2})
    assert sig.mean == pytest.approx(-0.05)
    assert sig.ci[1] < 0 and sig.significant is True


def test_bucket_fractions_on_hand_grid():
    grid = [[128, 128, 256, 1024], [512, 300, 1024, 1024]]
    fr = bucket_fractions(grid, [1024, 128, 256, 512])
    assert list(fr) == ["128", "256", "512", "1024", "other"]
    assert fr == pytest.approx({"128": 0.25, "256": 0.125, "512": 0.125, "1024": 0.375,
                                "other": 0.125})
    exact = bucket_fractions([[128, 256], [256, 256]], [128, 256, 512])
    assert exact == pytest.approx({"128": 0.25, "256": 0.75, "512": 0.0})  # no "other" key
    assert acr_from_fractions(exact, 512) == pytest.approx(0.25 * 0.25 + 0.75 * 0.5)
    assert acr_from_fractions(fr, 1024) is None
    assert mean_fractions([{"128": 1.0}, {"256": 1.0}]) == {"128": 0.5, "256": 0.5}
    with pytest.raises(ValueError):
        bucket_fractions([], [128])


def test_display_names():
    assert display_name("full_attention") == "Full attention"
    assert display_name("deep_practical_reuse") == "Deep practical reuse"
    assert display_name("fixed_window") == "Fixed window"
    assert display_name("shallow_control_interval_10") == "Shallow control interval 10"


# --- tables --------------------------------------------------------------------------------------
def test_training_table_rows_and_numbers(suite: Path):
    runs, notes = load_runs([suite])
    table = training_table(runs)
    rows = {row[0]: row for row in table.rows}
    assert list(rows) == ["Full attention", "Grouping off", "Full adaptive", "Shallow freeze"]
    assert rows["Full attention"][1] == "3"
    assert rows["Full attention"][2] == "3.1000 ± 0.1000"
    assert rows["Full attention"][3] == "reference"
    assert rows["Full attention"][4] == "1.0000"  # ACR of full attention by definition
    assert rows["Shallow freeze"][2] == "2.9000 ± 0.0000"
    assert rows["Shallow freeze"][3] == "-0.2000 [-0.4484, +0.0484]"  # not significant
    assert rows["Full adaptive"][3] == "-0.0500 [-0.0748, -0.0252]*"
    assert rows["Grouping off"][3] == "+0.0500 (CI n/a, n=1)"  # seed 1 only: 3.15 - 3.10
    assert rows["Shallow freeze"][4] == "0.5000"
    assert rows["Shallow freeze"][6] == "1000"
    assert rows["Shallow freeze"][7] == "200.0"  # largest peak_mem_mb logged
    assert notes == []


def test_inference_table_marks_missing_eval(suite: Path):
    runs, _ = load_runs([suite])
    rows = {row[0]: row for row in inference_table(runs).rows}
    assert rows["Grouping off"][1] == "0/2"
    assert rows["Grouping off"][2:] == ["missing"] * 7
    assert rows["Shallow freeze"][2] == "2.8000 ± 0.0000"
    assert rows["Shallow freeze"][3] == f"{math.exp(2.8):.2f}"
    assert rows["Shallow freeze"][6] == "0.9000"
    assert rows["Shallow freeze"][8] == "-0.2000 [-0.4484, +0.0484]"
    assert rows["Full attention"][4] == "1.0000"


def test_screening_table_only_with_screening_rows(suite: Path, tmp_path: Path):
    runs, _ = load_runs([suite])
    assert screening_table(runs) is None
    extra = tmp_path / "screen"
    for seed in range(3):
        make_run(extra, "fixed_window", seed, 3.0 + seed / 10 - 0.1)
        make_run(extra, "shuffle_post_select", seed, 3.0 + seed / 10 + 0.1)
    runs, _ = load_runs([suite, extra])
    table = screening_table(runs)
    names = [row[0] for row in table.rows]
    assert names == ["Pure baseline", "Shallow freeze", "Fixed window", "Shallow shuffle-post-select"]
    rows = {row[0]: row for row in table.rows}
    assert rows["Fixed window"][3] == "-0.1000 [-0.1000, -0.1000]*"
    assert rows["Shallow shuffle-post-select"][3].startswith("+0.1000")


def test_duplicate_runs_keep_the_complete_one(tmp_path: Path):
    make_run(tmp_path / "a", "full_attention", 0, 3.0)
    make_run(tmp_path / "b", "full_attention", 0, 9.0, status="failed")
    runs, notes = load_runs([tmp_path])
    assert len(runs) == 1 and runs[0].final_val_loss() == pytest.approx(3.0)
    assert len(notes) == 1 and "repeats Full attention seed 0" in notes[0]


def test_bucket_matrix_averages_seeds_and_keeps_other(tmp_path: Path):
    make_run(tmp_path, "full_attention", 0, 3.0, eval_loss=3.0)
    make_run(tmp_path, "full_adaptive", 0, 3.0, eval_loss=3.0, windows=[[128, 128], [128, 100]])
    make_run(tmp_path, "full_adaptive", 1, 3.0, eval_loss=3.0, windows=[[1024, 1024], [1024, 1024]])
    runs, _ = load_runs([tmp_path])
    regimes, keys, matrix, sources = bucket_matrix({"full_attention": runs[:1], "full_adaptive": runs[1:]})
    assert regimes == ["full_adaptive"]  # full attention is left out, as in the paper
    assert keys == ["128", "256", "512", "1024", "other"]
    assert matrix[0].tolist() == pytest.approx([0.375, 0.0, 0.0, 0.5, 0.125])
    assert sources == {"full_adaptive": "eval.json"}


# --- the written report ----------------------------------------------------------------------
def test_write_report_files_and_content(suite: Path, tmp_path: Path):
    out = tmp_path / "out"
    path = write_report([suite], out)
    assert path == out / "report.md"
    text = path.read_text()
    assert "Training backend: dense (11 runs)" in text
    assert "Evaluation backend: sdpa (9 runs)" in text
    assert "Commit: abc1234def56 (11 runs)" in text
    assert "routing diagnostic" in text and "measurements" in text
    assert "| Shallow freeze | 3 | 2.9000 ± 0.0000 | -0.2000 [-0.4484, +0.0484] |" in text
    assert "`grouping_off-s1`" in text and "missing" in text
    assert "Screening" not in text

    training = read_csv(out / "training.csv")
    assert float(training["full_adaptive"]["delta_mean"]) == pytest.approx(-0.05)
    assert float(training["full_adaptive"]["delta_ci_high"]) == pytest.approx(-0.05 + 0.024841, abs=1e-5)
    assert training["full_adaptive"]["delta_significant"] == "1"
    assert training["grouping_off"]["delta_ci_low"] == ""
    assert training["grouping_off"]["delta_n_seeds"] == "1"
    inference = read_csv(out / "inference.csv")
    assert inference["grouping_off"]["val_loss_mean"] == ""
    buckets = read_csv(out / "window_buckets.csv")
    assert "full_attention" not in buckets
    assert float(buckets["shallow_freeze"]["128"]) == pytest.approx(0.25)
    assert float(buckets["shallow_freeze"]["1024"]) == pytest.approx(0.375)
    assert buckets["grouping_off"]["source"] == "last training step"

    pngs = ["val_loss.png", "acr.png", "levels_used.png", "window_buckets.png",
            "windows_full_attention.png", "windows_shallow_freeze.png", "windows_full_adaptive.png"]
    for name in pngs:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert f"]({name})" in text
    assert not (out / "windows_grouping_off.png").exists()
    assert "recorded no per-head windows" in text


def test_png_decodes(suite: Path, tmp_path: Path):
    from matplotlib.image import imread

    write_report([suite], tmp_path / "out")
    image = imread(tmp_path / "out" / "window_buckets.png")
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50


def test_report_without_any_eval_and_with_a_running_run(tmp_path: Path):
    make_run(tmp_path, "full_attention", 0, 3.0, acr=None)
    make_run(tmp_path, "full_adaptive", 0, 2.9, status="running",
             extra_lines='{"kind": "train", "step": 110, "lo')  # half-written last line
    text = write_report([tmp_path], tmp_path / "rep", include_unfinished=True).read_text()
    assert "no run has been evaluated yet" in text
    assert "| Full adaptive | 0/1 | missing |" in text
    assert "`full_adaptive-s0` (running)" in text
    assert "1 unreadable line(s)" in text
    assert "-0.1000 (CI n/a, n=1)" in text


def test_unfinished_runs_are_listed_but_left_out_of_the_means(tmp_path: Path, capsys):
    for seed in (0, 1):
        make_run(tmp_path, "full_attention", seed, 3.0, acr=None)
        make_run(tmp_path, "full_adaptive", seed, 2.8)
    make_run(tmp_path / "late", "full_adaptive", 2, 9.0, status="running", steps=50)
    text = write_report([tmp_path], tmp_path / "rep").read_text()
    rows = read_csv(tmp_path / "rep" / "training.csv")
    assert float(rows["full_adaptive"]["val_loss_mean"]) == pytest.approx(2.8)  # not pulled up by 9.0
    assert rows["full_adaptive"]["n_seeds"] == "2"
    assert "Left out of the tables and figures until they complete" in text
    assert "`full_adaptive-s2` (running)" in text
    assert "| `full_adaptive-s2` | Full adaptive | 2 | running | 50 |" in text  # still in the run list
    kept = write_report([tmp_path], tmp_path / "all", include_unfinished=True)
    assert read_csv(tmp_path / "all" / "training.csv")["full_adaptive"]["n_seeds"] == "3"
    assert "Left out of the tables" not in kept.read_text()
    assert main_table_text([tmp_path]) != main_table_text([tmp_path], include_unfinished=True)
    args = _parse(["report", str(tmp_path), "--out", str(tmp_path / "cli")])
    assert args.func(args) == 0
    assert "4 of 5 run(s) in the tables" in capsys.readouterr().out


def test_main_table_text_and_no_runs(suite: Path, tmp_path: Path):
    text = main_table_text([suite])
    assert text.count("\n| ") == 5  # header row + four regimes
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no run folders"):
        main_table_text([empty])
    with pytest.raises(FileNotFoundError):
        find_run_dirs([tmp_path / "nope"])


# --- the command line --------------------------------------------------------------------------
def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="aah")
    report_cli.add_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_finds_run_folders_and_prints_table(suite: Path, tmp_path: Path, capsys):
    single = suite / "shallow_freeze-s0"
    assert find_run_dirs([single, suite]) [0] == single
    args = _parse(["report", str(suite), "--out", str(tmp_path / "cli")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "| Shallow freeze | 3 |" in out
    assert "11 run(s); report written to" in out
    assert (tmp_path / "cli" / "report.md").is_file()


def test_cli_clear_error_without_run_folders(tmp_path: Path, capsys):
    from aah.cli import main

    assert main(["report", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no run folders found" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_training_table_speed_vs_full_is_paired_by_seed(tmp_path: Path):
    root = tmp_path / "speed"
    for seed in range(3):
        make_run(root, "full_attention", seed, 3.0, acr=None, tokens_per_s=1000.0 + 100 * seed)
    for seed, tps in enumerate([1100.0, 1320.0, 1380.0]):  # ratios 1.10, 1.20, 1.15
        make_run(root, "full_adaptive", seed, 3.0, tokens_per_s=tps)
    make_run(root, "shallow_freeze", 2, 3.0, tokens_per_s=1080.0)  # seed 2 only: 1080 / 1200
    runs, _ = load_runs([root])
    table = training_table(runs)
    rows = {row[0]: row for row in table.rows}
    # mean 0.15, sd 0.05, t(0.975, 2) = 4.303: half width 4.303 * 0.05 / sqrt(3) = 0.1242.
    assert rows["Full adaptive"][8] == "1.15x [1.03, 1.27]*"
    assert rows["Shallow freeze"][8] == "0.90x (CI n/a, n=1)"
    assert rows["Full attention"][8] == "reference"
    csv_row = dict(zip(table.csv_columns, table.csv_rows[[r[0] for r in table.rows].index("Full adaptive")]))
    assert csv_row["speed_vs_full"] == pytest.approx(1.15)
    assert csv_row["speed_ci_low"] == pytest.approx(1.15 - 4.302653 * 0.05 / 3 ** 0.5, abs=1e-5)
