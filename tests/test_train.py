"""The training harness: exact resume, Ctrl-C, NaN and disk-full handling, eval, torchrun."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aah.config import load_config
from aah.evaluate import evaluate_run
from aah.train import TrainingStopped, lr_at, train
from aah.train import checkpoint as ckpt
from aah.train.checkpoint import checkpoint_dir, latest_checkpoint, list_checkpoints

TEXT = (
    "Now is the winter of our discontent made glorious summer by this sun of York; "
    "and all the clouds that lour'd upon our house in the deep bosom of the ocean buried. "
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (root / f"doc{i}.txt").write_text((TEXT * 12) + f" part {i}\n")
    return root


def tiny_overrides(corpus: Path, cache: Path, regime: str = "full_adaptive", steps: int = 12) -> list[str]:
    return [
        f"aah.regime={regime}",
        "model.n_layers=2", "model.d_model=32", "model.n_heads=4",
        f"data.corpus={corpus}", "data.seq_len=32", f"data.cache_dir={cache}", "data.val_fraction=0.3",
        f"train.max_steps={steps}", "train.batch_size=4", "train.checkpoint_every=4", "train.device=cpu",
        "aah.windows=[8,16,32]", "aah.control_warmup=2", "aah.control_interval=2",
        "optim.warmup_steps=2", "optim.lr=0.003",
        "eval.every=6", "eval.batches=2", "log.every=2", "log.tensorboard=false", "log.progress=false",
    ]


def empty_config(folder: Path) -> Path:
    """A config file with no settings: the command-line tests pass everything as overrides."""
    path = folder / "cfg.yaml"
    path.write_text("{}\n")
    return path


def train_records(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["kind"] == "train"]


def final_train_record(run_dir: Path) -> dict:
    return train_records(run_dir)[-1]


def test_lr_schedule_warms_up_then_decays_to_floor():
    kw = dict(lr=1.0, warmup=4, max_steps=14, min_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.25)
    assert lr_at(3, **kw) == pytest.approx(1.0)
    assert lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_at(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(14, **kw) == pytest.approx(0.1)


def test_run_folder_has_config_metrics_checkpoints_and_meta(corpus, tmp_path):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "cache"))
    run = tmp_path / "run"
    result = train(cfg, run)
    assert result.status == "complete" and result.step == 12
    assert (run / "config.yaml").is_file()
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["seed"] == 0 and meta["regime"] == "full_adaptive"
    assert meta["backend"] and meta["torch"] == torch.__version__
    assert [s for s, _ in list_checkpoints(run)] == [4, 8, 12]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [6, 12]
    last = final_train_record(run)
    assert sum(last["bucket_fractions"].values()) == pytest.approx(1.0)
    assert 0 < last["acr"] <= 1 and last["levels_used"] >= 1
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_resumed_run_matches_uninterrupted_run_exactly(corpus, tmp_path):
    overrides = tiny_overrides(corpus, tmp_path / "cache")
    full = tmp_path / "full"
    train(load_config(None, overrides), full)

    # The same run, "crashed" after its step-8 checkpoint: keep only that checkpoint.
    part = tmp_path / "part"
    train(load_config(None, overrides), part)
    for step, folder in list_checkpoints(part):
        if step > 8:
            import shutil

            shutil.rmtree(folder)
    resumed = train(load_config(part / "config.yaml"), part, resume=True)
    assert resumed.step == 12
    a, b = final_train_record(full), final_train_record(part)
    assert a["loss"] == b["loss"]
    assert a["windows"] == b["windows"]
    after = [(r["step"], r["windows_changed"]) for r in train_records(full) if r["step"] > 8]
    assert after == [(r["step"], r["windows_changed"]) for r in train_records(part) if r["step"] > 8]
    steps = [json.loads(x)["step"] for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps), "a resumed run must not duplicate metric lines"


def test_killed_run_resumes_to_the_same_end_as_an_uninterrupted_run(corpus, tmp_path):
    overrides = tiny_overrides(corpus, tmp_path / "cache", steps=60) + ["train.checkpoint_every=4", "eval.every=0"]
    cfg_path = empty_config(tmp_path)
    full = tmp_path / "full"
    train(load_config(cfg_path, overrides), full)

    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "aah.cli", "train", str(cfg_path), *overrides, "--out", str(killed)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and latest_checkpoint(killed) is None and proc.poll() is None:
        time.sleep(0.02)
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait(timeout=60)
    found = latest_checkpoint(killed)
    assert found is not None
    resumed = train(load_config(killed / "config.yaml"), killed, resume=True)
    assert resumed.step == 60
    a, b = final_train_record(full), final_train_record(killed)
    assert a["loss"] == b["loss"] and a["windows"] == b["windows"]


def test_nan_loss_stops_with_message_and_keeps_last_checkpoint(corpus, tmp_path):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "cache", steps=8) + ["optim.lr=1e6", "optim.grad_clip=0"])
    run = tmp_path / "nan"
    with pytest.raises(TrainingStopped, match="loss became"):
        train(cfg, run)
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "failed"
    for _, folder in list_checkpoints(run):
        state = torch.load(folder / "train_state.pt", weights_only=False)
        assert state["step"] <= meta["step"]


def test_full_disk_during_checkpoint_leaves_no_partial_files(corpus, tmp_path, monkeypatch):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "cache", steps=8))
    run = tmp_path / "disk"
    real_save = ckpt.torch.save
    calls = {"n": 0}

    def failing_save(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint hits a full disk
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    with pytest.raises(TrainingStopped, match="No space left"):
        train(cfg, run)
    assert [s for s, _ in list_checkpoints(run)] == [4]
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_eval_reports_and_never_changes_controller_state(corpus, tmp_path):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "cache"))
    run = tmp_path / "ev"
    train(cfg, run)
    step, folder = latest_checkpoint(run)
    before = (folder / "model.safetensors").read_bytes()
    first = evaluate_run(run, device="cpu")
    second = evaluate_run(run, device="cpu")
    assert (folder / "model.safetensors").read_bytes() == before
    for key in ("val_loss", "acr", "causal_coverage", "executed_coverage", "windows", "bucket_fractions"):
        assert first[key] == second[key]
    assert math.isclose(first["val_ppl"], math.exp(first["val_loss"]), rel_tol=1e-9)
    assert first["checkpoint_step"] == 12 and first["backend"]
    assert json.loads((run / "eval.json").read_text())["val_loss"] == first["val_loss"]
    last = final_train_record(run)
    assert first["windows"] == last["windows"]


def test_ctrl_c_finishes_step_writes_checkpoint_and_resume_completes(corpus, tmp_path):
    overrides = tiny_overrides(corpus, tmp_path / "cache", steps=400) + ["train.checkpoint_every=0", "eval.every=0"]
    run = tmp_path / "sigint"
    cfg_path = empty_config(tmp_path)
    cmd = [sys.executable, "-m", "aah.cli", "train", str(cfg_path), *overrides, "--out", str(run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (run / "metrics.jsonl").is_file():
        time.sleep(0.05)
    while time.time() < deadline and not (run / "metrics.jsonl").read_text().strip():
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    found = latest_checkpoint(run)
    assert found is not None and 0 < found[0] < 400
    assert json.loads((run / "meta.json").read_text())["status"] == "interrupted"
    assert "--resume" in out


@pytest.mark.slow
def test_torchrun_two_processes_share_windows_and_match_single_process(corpus, tmp_path):
    overrides = tiny_overrides(corpus, tmp_path / "cache", steps=6) + ["train.checkpoint_every=0", "eval.every=0"]
    cfg_path = empty_config(tmp_path)
    single = tmp_path / "single"
    train(load_config(cfg_path, overrides), single)
    ddp = tmp_path / "ddp"
    done = _torchrun([str(cfg_path), *overrides, "--out", str(ddp)])
    assert done.returncode == 0, done.stdout + done.stderr
    a, b = final_train_record(single), final_train_record(ddp)
    assert a["windows"] == b["windows"]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    records = [json.loads(x) for x in (ddp / "metrics.jsonl").read_text().splitlines()]
    assert all(r["ranks_agree"] for r in records if r["kind"] == "train")
    meta = json.loads((ddp / "meta.json").read_text())
    assert meta["world_size"] == 2


def test_compile_option_trains_with_compiled_feed_forward_blocks(corpus, tmp_path):
    overrides = tiny_overrides(corpus, tmp_path / "cache", steps=4) + ["train.checkpoint_every=0", "eval.every=0"]
    plain = train(load_config(None, overrides), tmp_path / "plain")
    compiled = train(load_config(None, [*overrides, "train.compile=true"]), tmp_path / "compiled")
    assert compiled.status == "complete"
    assert compiled.last_loss == pytest.approx(plain.last_loss, rel=1e-3)


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    """``aah train ARGS`` under torchrun with two CPU processes."""
    with socket.socket() as sock:  # a free port, so parallel test runs do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(port), "-m", "aah.cli", "train", *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_fsdp_checkpoints_resume_exactly_and_match_single_process(corpus, tmp_path):
    overrides = tiny_overrides(corpus, tmp_path / "cache", steps=8) + [
        "train.checkpoint_every=4", "eval.every=0", "train.distributed=fsdp",
    ]
    cfg_path = empty_config(tmp_path)
    single = tmp_path / "single"
    train(load_config(cfg_path, overrides), single)
    fsdp = tmp_path / "fsdp"
    done = _torchrun([str(cfg_path), *overrides, "--out", str(fsdp)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert [s for s, _ in list_checkpoints(fsdp)] == [4, 8]
    a, b = final_train_record(single), final_train_record(fsdp)
    assert a["windows"] == b["windows"]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)

    import shutil

    shutil.rmtree(checkpoint_dir(fsdp, 8))
    done = _torchrun(["--resume", str(fsdp)])
    assert done.returncode == 0, done.stdout + done.stderr
    c = final_train_record(fsdp)
    assert c["loss"] == pytest.approx(b["loss"], rel=1e-6) and c["windows"] == b["windows"]
    # The gathered checkpoint loads into a plain single-process model too.
    assert evaluate_run(fsdp, device="cpu")["checkpoint_step"] == 8
