"""Validation loss and the evaluation of a run's checkpoint (paper section 7.6, Table 6).

Evaluation runs the model in eval mode under ``torch.no_grad``: controllers
read their cached windows and never change state, so evaluating a checkpoint
twice gives the same numbers (tokens/s aside, which is measured).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ..backends import executed_coverage
from ..config import load_config
from ..model import GPT
from ..train.checkpoint import checkpoint_at, load_weights, newest_good_checkpoint
from ..train.distributed import DistInfo
from ..train.run_dir import write_json_atomic
from ..train.setup import (
    autocast_context,
    data_from_config,
    model_from_config,
    resolve_device,
    window_buckets,
)
from .recall import is_recall, recall_metrics

__all__ = ["validation_loss", "evaluate_run", "eval_filename"]


@torch.no_grad()
def _loss_sums(
    model: GPT,
    batches,
    max_batches: int | None,
    device: torch.device,
    autocast: Callable | None,
    timer: list | None = None,
) -> tuple[float, int]:
    loss_sum, tokens = 0.0, 0
    for i, (x, y) in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        x, y = x.to(device), y.to(device)
        start = time.perf_counter()
        with autocast() if autocast else contextlib.nullcontext():
            _, loss = model(x, y)
        value = float(loss.float().item())  # synchronises the device
        if timer is not None and i > 0:  # the first batch is the warm-up
            timer[0] += time.perf_counter() - start
            timer[1] += x.numel()
        loss_sum += value * y.numel()
        tokens += y.numel()
    return loss_sum, tokens


def validation_loss(
    model: GPT,
    val,
    *,
    batch_size: int,
    max_batches: int | None,
    device: torch.device,
    autocast: Callable | None = None,
    info: DistInfo | None = None,
    timer: list | None = None,
) -> float:
    """Mean next-token loss over the validation blocks (summed over ranks under torchrun)."""
    info = info or DistInfo()
    was_training = model.training
    model.eval()
    try:
        batches = val.batches(batch_size, rank=info.rank, world_size=info.world_size)
        loss_sum, tokens = _loss_sums(model, batches, max_batches, device, autocast, timer)
    finally:
        model.train(was_training)
    if info.enabled:
        t = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        loss_sum, tokens = float(t[0]), int(t[1])
    if tokens == 0:
        raise ValueError("no validation tokens: the validation split is empty")
    return loss_sum / tokens


def eval_filename(corpus: str | None, default_corpus: str) -> str:
    """``eval.json`` for the run's own corpus, ``eval_<corpus>.json`` for another one."""
    if corpus is None or corpus == default_corpus:
        return "eval.json"
    slug = "".join(ch if ch.isalnum() else "_" for ch in corpus).strip("_")
    return f"eval_{slug}.json"


def evaluate_run(
    run_dir: str | Path,
    *,
    checkpoint: int | None = None,
    corpus: str | None = None,
    device: str | None = None,
    max_batches: int | None = None,
    write: bool = True,
) -> dict:
    """Evaluate a checkpoint of ``run_dir`` and (by default) write ``eval.json``.

    Only the config and the weights are read, never the training state. Without
    ``checkpoint`` the newest checkpoint whose weights verify is used; newer ones that do not
    are named on stderr and listed under ``skipped_checkpoints``. A ``checkpoint`` step that is
    missing or bad raises :class:`~aah.train.checkpoint.CheckpointError`.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml")
    skipped: list[dict] = []
    if checkpoint is None:
        step, folder, skipped = newest_good_checkpoint(run_dir, with_state=False)
    else:
        step, folder = checkpoint, checkpoint_at(run_dir, checkpoint, with_state=False)
    dev = resolve_device(device if device is not None else cfg.train.device)
    data = data_from_config(cfg, corpus=corpus, verbose=False)
    model = model_from_config(cfg, data.tokenizer.vocab_size)
    load_weights(folder, model, map_location="cpu")
    model.to(dev)
    seq_len = cfg.data.seq_len
    batches = max_batches if max_batches is not None else cfg.eval.batches
    timer = [0.0, 0]
    loss = validation_loss(
        model, data.val, batch_size=cfg.eval.batch_size or cfg.train.batch_size, max_batches=batches,
        device=dev, autocast=lambda: autocast_context(cfg.train.precision, dev), timer=timer,
    )
    recall = None
    if is_recall(data.val):  # text-only loss and recall accuracy (aah.evaluate.recall)
        recall = recall_metrics(
            model, data.val, batch_size=cfg.eval.batch_size or cfg.train.batch_size, max_batches=batches,
            device=dev, autocast=lambda: autocast_context(cfg.train.precision, dev),
        )
        recall.pop("val_loss")
    windows = model.aah_windows(seq_len)
    cov = model.coverage(seq_len)
    backends = model.backends_used()
    executed = sum(
        executed_coverage(next(iter(a.backends_used)), row.tolist(), seq_len)
        for a, row in zip(model.attention_layers(), windows)
    ) / len(windows)
    result = {
        "val_loss": loss,
        "val_ppl": math.exp(min(loss, 50.0)),
        "acr": cov["acr"],
        "causal_coverage": cov["causal_coverage"],
        "executed_coverage": executed,
        "bucket_fractions": window_buckets(model, seq_len),
        "windows": windows.tolist(),
        "candidate_windows": list(model.controllers()[0].candidates) if model.controllers() else [seq_len],
        "levels_used": model.levels_used(),
        # None (JSON null) when only the untimed warm-up batch ran.
        "inference_tokens_per_s": timer[1] / timer[0] if timer[0] > 0 else None,
        "backend": ",".join(backends),
        "device": str(dev),
        "checkpoint_step": step,
        "skipped_checkpoints": skipped,
        "corpus": corpus or cfg.data.corpus,
        "seq_len": seq_len,
        "regime": cfg.aah.regime,
        "seed": cfg.train.seed,
        "val_tokens": _evaluated_blocks(len(data.val), batches, cfg.eval.batch_size or cfg.train.batch_size)
        * seq_len,
    }
    if recall is not None:
        result.update(recall)
    if write:
        path = run_dir / eval_filename(corpus, cfg.data.corpus)
        write_json_atomic(path, result)
        result["path"] = str(path)  # where it went (not part of the file)
    return result


def _rate(tokens_per_s: float | None) -> str:
    return "n/a (one batch: warm-up only)" if tokens_per_s is None else f"{tokens_per_s:.0f} tok/s"


def _evaluated_blocks(available: int, max_batches: int | None, batch_size: int) -> int:
    return available if max_batches is None else min(available, max_batches * batch_size)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def recall_summary(result: dict) -> str:
    """One line: text-only loss and recall accuracy overall and per distance bucket."""
    by = result["recall_accuracy_by_bucket"]
    n = result["recall_queries_by_bucket"]
    parts = [f"{name} {_pct(by[name])} (n={n[name]})" for name in by]
    return (
        f"text loss {result['text_loss']:.4f}  recall {_pct(result['recall_accuracy'])} "
        f"(n={result['recall_queries']})  by distance: " + "  ".join(parts)
    )


def print_summary(result: dict, file=sys.stdout) -> None:
    print(
        f"step {result['checkpoint_step']}  corpus {result['corpus']}  backend {result['backend']}  "
        f"device {result['device']}\n"
        f"val loss {result['val_loss']:.4f}  ppl {result['val_ppl']:.2f}  ACR {result['acr']:.4f}  "
        f"causal coverage {result['causal_coverage']:.4f}  executed coverage {result['executed_coverage']:.4f}  "
        f"inference {_rate(result['inference_tokens_per_s'])}",
        file=file,
    )
    if "recall_accuracy" in result:
        print(recall_summary(result), file=file)
    buckets = "  ".join(f"W={k}: {v:.1%}" for k, v in result["bucket_fractions"].items())
    print(f"window buckets  {buckets}", file=file)
    for layer, row in enumerate(result["windows"]):
        print(f"  layer {layer:2d}: {row}", file=file)
