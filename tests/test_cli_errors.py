"""Every ``aah`` sub-command turns expected failures into one line on stderr and exit status 2.

Each case runs in-process through :func:`aah.cli.main` and checks the status, that stderr is one
line naming the command and the problem, and that no traceback was printed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aah.cli import main
from aah.config import load_config, save_config
from aah.train.checkpoint import checkpoint_dir

TEXT = "Full fathom five thy father lies; of his bones are coral made. "


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(3):
        (root / f"doc{i}.txt").write_text(TEXT * 10 + f" {i}\n")
    return root


def tiny(corpus: Path, cache: Path) -> list[str]:
    return [
        "model.n_layers=1", "model.d_model=16", "model.n_heads=2",
        f"data.corpus={corpus}", "data.seq_len=16", f"data.cache_dir={cache}", "data.val_fraction=0.3",
        "train.max_steps=2", "train.batch_size=2", "train.device=cpu", "aah.windows=[4,8,16]",
        "log.tensorboard=false", "log.progress=false", "eval.every=0",
    ]


@pytest.fixture
def run_folder(corpus, tmp_path) -> Path:
    """A run folder that holds its config but no checkpoint yet."""
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, tiny(corpus, tmp_path / "cache")), run / "config.yaml")
    return run


def fails(capsys, argv: list[str], *needles: str) -> str:
    """Run ``aah ARGV``; it must exit 2 with one error line, the last on stderr, naming ``needles``.

    Progress notes and warnings (data tokenising, skipped checkpoints) may come before it.
    """
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith(f"aah {argv[0]}")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    for needle in needles:
        assert needle in errors[0], err
    return errors[0]


def empty_config(folder: Path) -> str:
    path = folder / "cfg.yaml"
    path.write_text("{}\n")
    return str(path)


# ------------------------------------------------------------------ aah train
def test_train_without_config(capsys):
    fails(capsys, ["train"], "CONFIG")


def test_train_missing_config_file(capsys, tmp_path):
    fails(capsys, ["train", str(tmp_path / "nope.yaml")], "nope.yaml", "not found")


def test_train_invalid_yaml(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    fails(capsys, ["train", str(bad)], "bad.yaml", "YAML")


def test_train_unknown_key_and_bad_value(capsys, tmp_path):
    cfg = empty_config(tmp_path)
    fails(capsys, ["train", cfg, "train.max_stepz=3"], "max_stepz")
    fails(capsys, ["train", cfg, "train.max_steps=many"], "train.max_steps")
    fails(capsys, ["train", cfg, "aah.regime=no_such_regime"], "no_such_regime")
    fails(capsys, ["train", cfg, "nodot"], "section.key=value")


def test_overrides_may_follow_options(capsys, tmp_path):
    """``aah train CONFIG --out DIR KEY=VALUE``: the override after an option is read as one (its
    bad key is what fails), and anything else after an option is still unrecognized."""
    cfg = empty_config(tmp_path)
    fails(capsys, ["train", cfg, "--out", str(tmp_path / "run"), "train.max_stepz=3"], "max_stepz")
    suite = str(Path(__file__).resolve().parents[1] / "configs" / "suites" / "cpu" / "quick.yaml")
    fails(capsys, ["experiment", suite, "--out", str(tmp_path / "runs"), "train.max_stepz=3"], "max_stepz")
    with pytest.raises(SystemExit) as exc:
        main(["train", cfg, "--out", str(tmp_path / "run"), "--bogus"])
    assert exc.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_train_missing_corpus_and_unknown_tokenizer(capsys, corpus, tmp_path):
    cfg = empty_config(tmp_path)
    over = tiny(corpus, tmp_path / "cache")
    fails(capsys, ["train", cfg, *over, f"data.corpus={tmp_path / 'missing'}", "--out", str(tmp_path / "a")], "missing")
    fails(capsys, ["train", cfg, *over, "data.tokenizer=klingon", "--out", str(tmp_path / "b")], "klingon")
    # Too little text for one batch: a data setting that cannot work.
    fails(capsys, ["train", cfg, *over, "train.batch_size=4096", "--out", str(tmp_path / "c")], "data:", "batch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_train_on_cuda_without_a_gpu(capsys, corpus, tmp_path):
    cfg = empty_config(tmp_path)
    fails(capsys, ["train", cfg, *tiny(corpus, tmp_path / "cache"), "train.device=cuda", "--out", str(tmp_path / "r")],
          "cuda")


def test_train_resume_errors(capsys, corpus, tmp_path, run_folder):
    cfg = empty_config(tmp_path)
    fails(capsys, ["train", "--resume", str(tmp_path / "nowhere")], "not a run folder")
    fails(capsys, ["train", cfg, "--resume", str(run_folder)], "--resume")
    fails(capsys, ["train", "--resume", str(run_folder)], "nothing to resume", "no checkpoint")


def test_train_out_folder_already_holding_checkpoints(capsys, corpus, tmp_path, run_folder):
    checkpoint_dir(run_folder, 4).mkdir(parents=True)
    cfg = empty_config(tmp_path)
    fails(capsys, ["train", cfg, *tiny(corpus, tmp_path / "cache"), "--out", str(run_folder)],
          "already holds checkpoints", "--resume")
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    fails(capsys, ["train", cfg, *tiny(corpus, tmp_path / "cache"), "--out", str(blocker)], "is a file")


def test_train_damaged_config_in_run_folder(capsys, run_folder):
    (run_folder / "config.yaml").write_text("model: {n_layers: -3}\n")
    fails(capsys, ["train", "--resume", str(run_folder)], "n_layers")


# ------------------------------------------------------------------ aah eval
def test_eval_errors(capsys, tmp_path, run_folder):
    fails(capsys, ["eval", str(tmp_path / "nowhere")], "not a run folder")
    fails(capsys, ["eval", str(run_folder)], "no checkpoint")
    fails(capsys, ["eval", str(run_folder), "--checkpoint", "7"], "no checkpoint at step 7")
    fails(capsys, ["eval", str(run_folder), "--checkpoint", "0"], "--checkpoint")
    fails(capsys, ["eval", str(run_folder), "--batches", "0"], "--batches")
    checkpoint_dir(run_folder, 3).mkdir(parents=True)  # a folder with nothing in it
    fails(capsys, ["eval", str(run_folder), "--checkpoint", "3"], "step 3", "info.json is missing")
    fails(capsys, ["eval", str(run_folder)], "verifies", "info.json is missing")


def test_eval_on_a_missing_corpus(capsys, corpus, tmp_path):
    run = tmp_path / "r"
    assert main(["train", empty_config(tmp_path), *tiny(corpus, tmp_path / "cache"), "--out", str(run)]) == 0
    capsys.readouterr()
    fails(capsys, ["eval", str(run), "--corpus", str(tmp_path / "no_text_here")], "no_text_here")
    assert not list(run.glob("eval*.json"))


# ------------------------------------------------------------------ aah experiment / demo
def test_experiment_errors(capsys, tmp_path):
    fails(capsys, ["experiment", str(tmp_path / "none.yaml")], "none.yaml")
    suite = tmp_path / "suite.yaml"
    suite.write_text("name: s\nconfig_dir: configs/cpu\nregimes: [not_a_regime]\nseeds: [0]\n")
    fails(capsys, ["experiment", str(suite)], "not_a_regime")
    suite.write_text("name: s\nsurprise: 1\n")
    fails(capsys, ["experiment", str(suite)], "surprise")
    fails(capsys, ["experiment", str(suite), "--jobs", "0"], "--jobs")
    fails(capsys, ["experiment", str(suite), "--seeds", "-1"], "--seeds")


def test_experiment_output_folder_is_a_file(capsys, tmp_path):
    suite = Path("configs/suites/cpu/quick.yaml")
    if not suite.is_file():
        pytest.skip("run from the repository root")
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    fails(capsys, ["experiment", str(suite), "--out", str(blocker)], "is a file")


def test_demo_with_a_missing_suite(capsys, tmp_path):
    fails(capsys, ["demo", "--suite", str(tmp_path / "gone.yaml"), "--out", str(tmp_path / "o")], "gone.yaml")


# ------------------------------------------------------------------ aah report
def test_report_errors(capsys, tmp_path):
    fails(capsys, ["report", str(tmp_path / "nowhere")], "nowhere")
    (tmp_path / "empty").mkdir()
    fails(capsys, ["report", str(tmp_path / "empty")], "no run folders")
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "meta.json").write_text("{}")
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    fails(capsys, ["report", str(tmp_path / "runs"), "--out", str(blocker)], "is a file")


# ------------------------------------------------------------------ aah bench
def test_bench_attention_errors(capsys):
    fails(capsys, ["bench", "attention", "--windows", "a,b"], "--windows")
    fails(capsys, ["bench", "attention", "--backends", ","], "--backends")
    fails(capsys, ["bench", "attention", "--seq-len", "0"], "--seq-len")
    fails(capsys, ["bench", "attention", "--heads", "8", "--kv-heads", "3", "--seq-len", "16"], "--kv-heads")
    fails(capsys, ["bench", "attention", "--seq-len", "16", "--heads", "2", "--windows", "4"], "window")
    fails(capsys, ["bench", "attention", "--seq-len", "16", "--backends", "warp_drive"], "warp_drive")


def test_bench_train_errors(capsys):
    fails(capsys, ["bench", "train", "--windows", "x"], "--windows")


# ------------------------------------------------------------------ argparse itself
@pytest.mark.parametrize("argv", [["train", "--bogus"], ["eval"], ["eval", "r", "--checkpoint", "latest"], ["frobnicate"]])
def test_argument_errors_exit_2_without_traceback(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error:" in err


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out
