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

from aah.cli import main
from aah.config import load_config
from aah.evaluate import evaluate_run
from aah.train import TrainingStopped, lr_at, run_dir, train
from aah.train import checkpoint as ckpt
from aah.train.checkpoint import checkpoint_dir, latest_checkpoint, list_checkpoints
from aah.train.run_dir import machine_description

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


def test_decay_steps_sets_the_schedule_length_apart_from_the_run_length(corpus, tmp_path):
    """A 12-step run on a 44-step schedule logs the rates of that schedule's first 12 steps, not
    a cosine that ends at step 12."""
    overrides = tiny_overrides(corpus, tmp_path / "cache") + ["optim.warmup_steps=4", "optim.decay_steps=44",
                                                              "log.every=1"]
    cfg = load_config(None, overrides)
    assert cfg.optim.decay_steps == 44 and cfg.train.max_steps == 12
    train(cfg, tmp_path / "run")
    logged = {r["step"]: r["lr"] for r in train_records(tmp_path / "run")}
    lr = cfg.optim.lr
    for logged_step, value in logged.items():
        step = logged_step - 1  # a record is logged after its step, under the count of steps done
        # The hand-written schedule: warmup over 4 steps, then a cosine over the 40 that follow.
        expected = lr * (step + 1) / 4 if step < 4 else lr * 0.5 * (1 + math.cos(math.pi * (step - 4) / 40))
        assert value == pytest.approx(expected, rel=1e-6), logged_step
    assert logged[max(logged)] > 0.8 * lr  # a cosine ending at step 12 would be near 0 here


def test_run_folder_has_config_metrics_checkpoints_and_meta(corpus, tmp_path):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "cache"))
    run = tmp_path / "run"
    result = train(cfg, run)
    assert result.status == "complete" and result.step == 12
    assert (run / "config.yaml").is_file()
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["seed"] == 0 and meta["regime"] == "full_adaptive"
    assert meta["backend"] and meta["torch"] == torch.__version__
    assert meta["machines"] == [machine_description(torch.device("cpu"))]
    assert meta["machines"][0]["cpu"] and meta["machines"][0]["torch_threads"] == torch.get_num_threads()
    assert [s for s, _ in list_checkpoints(run)] == [4, 8, 12]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [6, 12]
    last = final_train_record(run)
    assert sum(last["bucket_fractions"].values()) == pytest.approx(1.0)
    assert 0 < last["acr"] <= 1 and last["levels_used"] >= 1
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_meta_lists_each_machine_a_run_trained_on_once_in_order(monkeypatch):
    cpu = torch.device("cpu")
    here = machine_description(cpu)
    started = run_dir.machines_with([], cpu)
    assert started == [here]
    assert run_dir.machines_with(started, cpu) == [here]  # resumed where it started: nothing new
    other = {**here, "cpu": "Another CPU", "cpu_count": 64}
    monkeypatch.setattr(run_dir, "machine_description", lambda device: other)
    moved = run_dir.machines_with(started, cpu)
    assert moved == [here, other] and started == [here]
    assert run_dir.machines_with(moved, cpu) == [here, other]


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
    overrides = tiny_overrides(corpus, tmp_path / "cache", steps=24) + ["train.checkpoint_every=4", "eval.every=0"]
    cfg_path = empty_config(tmp_path)
    full = tmp_path / "full"
    train(load_config(cfg_path, overrides), full)

    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "aah.cli", "train", str(cfg_path), *overrides, "--out", str(killed)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and latest_checkpoint(killed) is None and proc.poll() is None:
        time.sleep(0.01)
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    meta = json.loads((killed / "meta.json").read_text())
    assert meta["status"] == "running"  # nobody recorded an end: the process died mid-run
    step, _ = latest_checkpoint(killed)
    assert step < 24
    assert final_train_record(killed)["step"] < 24
    resumed = train(load_config(killed / "config.yaml"), killed, resume=True)
    assert resumed.step == 24
    resumed_meta = json.loads((killed / "meta.json").read_text())
    assert resumed_meta["resumed_from"] == step
    assert resumed_meta["machines"] == [machine_description(torch.device("cpu"))]  # resumed where it started
    a, b = final_train_record(full), final_train_record(killed)
    assert a["loss"] == b["loss"] and a["windows"] == b["windows"]


def poison_loss_at(monkeypatch, bad_step: int) -> None:
    """Make the training loss NaN from optimizer step ``bad_step`` on (0-based, as set_step sees it)."""
    from aah.model import GPT

    real_forward, real_set_step = GPT.forward, GPT.set_step

    def set_step(self, step):
        self._test_step = step
        return real_set_step(self, step)

    def forward(self, idx, targets=None, **kw):
        logits, loss = real_forward(self, idx, targets, **kw)
        if loss is not None and self.training and getattr(self, "_test_step", -1) >= bad_step:
            loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "set_step", set_step)
    monkeypatch.setattr(GPT, "forward", forward)


def test_nan_loss_stops_with_message_and_keeps_last_checkpoint(corpus, tmp_path, monkeypatch):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "cache", steps=12))
    run = tmp_path / "nan"
    poison_loss_at(monkeypatch, 5)  # the sixth step; checkpoints come at 4, 8, 12
    with pytest.raises(TrainingStopped, match=r"loss became nan at step 5\b") as caught:
        train(cfg, run)
    assert str(run / "checkpoints") in str(caught.value)
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "failed" and meta["step"] == 5 and "step 5" in meta["message"]
    assert [s for s, _ in list_checkpoints(run)] == [4]  # the good one kept, nothing after the bad step
    assert ckpt.verify_checkpoint(checkpoint_dir(run, 4))
    assert max(r["step"] for r in train_records(run)) == 4
    assert all(math.isfinite(r["loss"]) for r in train_records(run))


def test_full_disk_during_checkpoint_leaves_no_partial_files(corpus, tmp_path, monkeypatch):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "cache", steps=8))
    run = tmp_path / "disk"
    real_save = ckpt.save_file  # writes the training state's tensors
    calls = {"n": 0}

    def failing_save(tensors, filename, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint hits a full disk
            raise OSError(28, "No space left on device")
        return real_save(tensors, filename, *a, **k)

    monkeypatch.setattr(ckpt, "save_file", failing_save)
    with pytest.raises(TrainingStopped, match="No space left"):
        train(cfg, run)
    assert [s for s, _ in list_checkpoints(run)] == [4]
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_eval_reports_and_is_repeatable(corpus, tmp_path):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "cache"))
    run = tmp_path / "ev"
    train(cfg, run)
    first = evaluate_run(run, device="cpu")
    second = evaluate_run(run, device="cpu")
    for key in ("val_loss", "acr", "causal_coverage", "executed_coverage", "windows", "bucket_fractions"):
        assert first[key] == second[key]
    assert math.isclose(first["val_ppl"], math.exp(first["val_loss"]), rel_tol=1e-9)
    assert first["checkpoint_step"] == 12 and first["backend"] and first["skipped_checkpoints"] == []
    assert json.loads((run / "eval.json").read_text())["val_loss"] == first["val_loss"]
    last = final_train_record(run)
    assert first["windows"] == last["windows"]

    # --checkpoint picks an older checkpoint; its windows are those logged at that step.
    assert main(["eval", str(run), "--checkpoint", "4", "--device", "cpu"]) == 0
    at4 = json.loads((run / "eval.json").read_text())
    assert at4["checkpoint_step"] == 4
    assert at4["windows"] == next(r["windows"] for r in train_records(run) if r["step"] == 4)
    assert at4["val_loss"] != first["val_loss"]

    # --corpus evaluates on other text and writes a file of its own.
    other = tmp_path / "other"
    other.mkdir()
    for i in range(3):
        (other / f"o{i}.txt").write_text("All the world's a stage, and all the men and women merely players. " * 20)
    assert main(["eval", str(run), "--corpus", str(other), "--device", "cpu"]) == 0
    files = sorted(p.name for p in run.glob("eval_*.json"))
    assert len(files) == 1 and files[0] != "eval.json"
    ood = json.loads((run / files[0]).read_text())
    assert ood["corpus"] == str(other) and ood["checkpoint_step"] == 12
    assert ood["val_loss"] != first["val_loss"]
    assert json.loads((run / "eval.json").read_text()) == at4  # the run's own eval is untouched


def test_validation_never_changes_controller_state_even_at_a_control_step(corpus, tmp_path):
    """Evaluation reads the committed windows: a forward at a due control step must not update."""
    from aah.evaluate.core import validation_loss
    from aah.train.setup import data_from_config, model_from_config

    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "cache", steps=4))
    run = tmp_path / "ev"
    train(cfg, run)
    data = data_from_config(cfg, verbose=False)
    model = model_from_config(cfg, data.tokenizer.vocab_size)
    ckpt.load_checkpoint(checkpoint_dir(run, 4), model)
    model.train()
    model.set_step(4)  # warm-up 2, interval 2: step 4 is a control step
    assert all(c.control_due() for c in model.controllers())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    validation_loss(model, data.val, batch_size=4, max_batches=2, device=torch.device("cpu"))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.training  # restored
    # The same forward in training mode does update: the check above can fail.
    x, y = next(iter(data.val.batches(4)))
    model(x, y)
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_ctrl_c_on_the_command_line_checkpoints_and_exits_130(corpus, tmp_path):
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
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "interrupted" and meta["step"] == found[0]
    assert f"aah train --resume {run}" in out
    assert "Traceback" not in out


def signal_during_step(monkeypatch, step: int, sig: int, times: int = 1) -> None:
    """Deliver ``sig`` to this process ``times`` times while optimizer step ``step`` (0-based) runs."""
    from aah.model import GPT

    real_set_step = GPT.set_step

    def set_step(self, s):
        real_set_step(self, s)
        if s == step:
            for _ in range(times):
                os.kill(os.getpid(), sig)

    monkeypatch.setattr(GPT, "set_step", set_step)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stop_signal_finishes_the_step_checkpoints_and_resume_matches_uninterrupted(corpus, tmp_path, monkeypatch, sig):
    overrides = tiny_overrides(corpus, tmp_path / "cache", steps=8) + ["eval.every=0", "model.dropout=0.1"]
    full = train(load_config(None, overrides), tmp_path / "full")
    run = tmp_path / "stopped"
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # default, or ignored under nohup
    with monkeypatch.context() as m:
        signal_during_step(m, 4, sig)  # the fifth step finishes, then the run stops at step 5
        stopped = train(load_config(None, overrides), run)
    assert (stopped.status, stopped.step) == ("interrupted", 5)
    assert [s for s, _ in list_checkpoints(run)] == [4, 5]
    assert json.loads((run / "meta.json").read_text())["status"] == "interrupted"
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are given back
    resumed = train(load_config(run / "config.yaml"), run, resume=True)
    assert (resumed.status, resumed.step) == ("complete", 8)
    assert resumed.last_loss == full.last_loss
    assert final_train_record(run)["windows"] == final_train_record(tmp_path / "full")["windows"]


def test_second_ctrl_c_stops_at_once_without_a_checkpoint(corpus, tmp_path, monkeypatch):
    overrides = tiny_overrides(corpus, tmp_path / "cache", steps=8) + ["eval.every=0"]
    run = tmp_path / "twice"
    signal_during_step(monkeypatch, 5, signal.SIGINT, times=2)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, overrides), run)
    assert [s for s, _ in list_checkpoints(run)] == [4]
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "interrupted" and "stopped at once" in meta["message"]
    assert meta["step"] == 5  # the sixth step never completed


def test_checkpoint_steps_and_tensorboard_events(corpus, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = tiny_overrides(corpus, tmp_path / "cache", steps=6) + [
        "train.checkpoint_every=0", "train.checkpoint_steps=[5,2]", "eval.every=3", "log.tensorboard=true",
    ]
    run = tmp_path / "tb"
    train(load_config(None, overrides), run)
    assert [s for s, _ in list_checkpoints(run)] == [2, 5, 6]  # the listed steps and the end
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/acr", "train/lr", "eval/val_loss"} <= set(tags)
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    expected = [(r["step"], r["loss"]) for r in train_records(run)]
    assert [s for s, _ in logged] == [s for s, _ in expected] == [2, 4, 6]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/val_loss")] == [3, 6]


def test_grad_accumulation_of_two_half_batches_equals_one_full_batch(corpus, tmp_path):
    base = tiny_overrides(corpus, tmp_path / "cache", regime="full_attention", steps=3) + [
        "train.checkpoint_every=0", "eval.every=0", "log.every=1", "model.dropout=0.0",
    ]
    one = tmp_path / "one"
    two = tmp_path / "two"
    a = train(load_config(None, [*base, "train.batch_size=4", "train.grad_accum=1"]), one)
    b = train(load_config(None, [*base, "train.batch_size=2", "train.grad_accum=2"]), two)
    # The same four blocks per step (the loader's batch 2p and 2p+1 are the halves of batch p),
    # so the same mean loss and the same update, up to the order of float additions.
    for ra, rb in zip(train_records(one), train_records(two), strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
    assert b.last_loss == pytest.approx(a.last_loss, rel=1e-5)
    from safetensors.torch import load_file

    wa = load_file(str(checkpoint_dir(one, 3) / "model.safetensors"))
    wb = load_file(str(checkpoint_dir(two, 3) / "model.safetensors"))
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=1e-5)
    # A different batch really changes the result (the comparison above can fail).
    c = train(load_config(None, [*base, "train.batch_size=2", "train.grad_accum=1"]), tmp_path / "half")
    assert c.last_loss != pytest.approx(a.last_loss, rel=1e-5)


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
    from torch._dynamo.utils import counters

    overrides = tiny_overrides(corpus, tmp_path / "cache", steps=4) + ["train.checkpoint_every=0", "eval.every=0"]
    plain = train(load_config(None, overrides), tmp_path / "plain")
    counters.clear()
    compiled = train(load_config(None, [*overrides, "train.compile=true"]), tmp_path / "compiled")
    assert compiled.status == "complete"
    assert counters["stats"]["unique_graphs"] >= 1, "train.compile=true compiled nothing"
    # Same maths, other kernels: fp32 agreement to rounding, over four optimizer steps.
    assert compiled.last_loss == pytest.approx(plain.last_loss, rel=1e-5)
    assert final_train_record(tmp_path / "compiled")["windows"] == final_train_record(tmp_path / "plain")["windows"]


@pytest.mark.slow
def test_torchrun_resume_with_dropout_is_exact_on_every_rank(corpus, tmp_path):
    """Each rank draws its own dropout masks; a resume restores every rank's generators."""
    overrides = tiny_overrides(corpus, tmp_path / "cache", steps=8) + [
        "train.checkpoint_every=4", "eval.every=0", "model.dropout=0.2", "log.every=1",
    ]
    cfg_path = empty_config(tmp_path)
    ddp = tmp_path / "ddp"
    done = _torchrun([str(cfg_path), *overrides, "--out", str(ddp)])
    assert done.returncode == 0, done.stdout + done.stderr
    state = ckpt.read_train_state(checkpoint_dir(ddp, 4))
    ranks = state["rng_per_rank"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["torch"], ranks[1]["torch"])
    uninterrupted = [(r["step"], r["loss"]) for r in train_records(ddp)]

    import shutil

    shutil.rmtree(checkpoint_dir(ddp, 8))  # "crashed" after the step-4 checkpoint
    done = _torchrun(["--resume", str(ddp)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert [(r["step"], r["loss"]) for r in train_records(ddp)] == uninterrupted


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
