"""The training loop of the paper's protocol (section 7.1), at any scale.

Same tokenizer, data order, optimizer schedule, width/depth and seed for every
regime: two runs that differ only in ``aah.regime`` differ only in attention.
The trainer tells the model the optimizer step before each step (the
controllers schedule their updates from it), logs the routing diagnostics,
checkpoints the full AAH state atomically, and resumes exactly.

Reliability: a non-finite loss stops the run with a clear message (the last
good checkpoint is kept, nothing is written after the bad step); Ctrl-C (or
SIGTERM) finishes the current step, writes a checkpoint and exits; a failed
checkpoint write (full disk) removes its partial files and stops the run.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import __version__
from ..backends.auto import auto_choices, auto_label
from ..config import RunConfig, config_to_dict, save_config
from ..controller.budgeted import lost_mass_metrics
from ..controller.warmup import far_cost
from ..evaluate.core import validation_loss
from ..evaluate.recall import is_recall, recall_metrics
from ..model import GPT
from .checkpoint import (
    STATE_JSON,
    CheckpointError,
    full_state_dicts,
    load_checkpoint,
    load_sharded_checkpoint,
    newest_good_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .distributed import (
    DistInfo,
    all_gather_objects,
    all_ranks_equal,
    all_reduce_mean,
    any_rank,
    barrier,
    broadcast_object,
    init_distributed,
    shutdown,
    wrap_model,
)
from .run_dir import (
    MetricsLog,
    git_commit,
    machines_with,
    now_iso,
    peak_memory_mb,
    read_meta,
    update_meta,
)
from .setup import (
    autocast_context,
    data_from_config,
    model_from_config,
    resolve_device,
    window_buckets,
)

__all__ = ["TrainResult", "TrainingStopped", "train", "lr_at", "param_groups"]


class TrainingStopped(RuntimeError):
    """The run stopped before ``max_steps`` for a reason the message explains."""


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    status: str  # "complete" | "interrupted"
    last_loss: float


def lr_at(step: int, *, lr: float, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``lr * min_ratio`` at ``max_steps``
    (the schedule's length: ``optim.decay_steps`` when set, else ``train.max_steps``)."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, max_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (and embeddings); no decay for biases and norm gains."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class _StopFlag:
    """Turns SIGINT/SIGTERM into a request to stop after the current step."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: no handler
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = True
        print("\nstop requested: finishing this step and writing a checkpoint", file=sys.stderr)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def rank_seed(seed: int, rank: int) -> int:
    """The torch seed of rank ``rank`` > 0 after the (shared) model initialisation."""
    return (int(seed) * 1_000_003 + 7919 * int(rank)) % (2**63)


def _checkpoint_steps(cfg: RunConfig) -> set[int]:
    t = cfg.train
    steps = set(t.checkpoint_steps) | {t.max_steps}
    if t.checkpoint_every > 0:
        steps |= set(range(t.checkpoint_every, t.max_steps + 1, t.checkpoint_every))
    return steps


def train(
    cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, trust_pickled_state: bool = False
) -> TrainResult:
    """Train (or resume) the run in ``run_dir`` according to ``cfg``.

    A resume refuses a training state that an older version pickled (``train_state.pt``) unless
    ``trust_pickled_state``: unpickling runs whatever code the file holds.
    """
    run_dir = Path(run_dir)
    info = init_distributed("cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu")
    try:
        result = _Training(cfg, run_dir, info, resume, trust_pickled_state).run()
        barrier(info)  # rank 0 may still be writing its checkpoint: leave together
        return result
    finally:
        shutdown(info)


class _Training:
    def __init__(self, cfg: RunConfig, run_dir: Path, info: DistInfo, resume: bool, trust_pickled_state: bool):
        self.cfg, self.run_dir, self.info = cfg, run_dir, info
        self.trust_pickled_state = trust_pickled_state
        # FSDP2 shards the weights over ranks: checkpoints gather a full state dict first.
        self.sharded = info.enabled and cfg.train.distributed == "fsdp"
        self.device = resolve_device(cfg.train.device, info.local_rank)
        verbose = info.is_main
        self.data = data_from_config(cfg, rank=info.rank, world_size=info.world_size, verbose=verbose)
        self.model: GPT = model_from_config(cfg, self.data.tokenizer.vocab_size).to(self.device)
        if info.rank > 0:
            # Every rank built the same weights from train.seed; from here on each rank draws
            # its own dropout masks (rank 0 keeps the single-process stream).
            torch.manual_seed(rank_seed(cfg.train.seed, info.rank))
        self.ddp_model = wrap_model(self.model, info, cfg.train.distributed, self.device)
        if cfg.train.compile:
            # Compile the feed-forward blocks only: the attention path holds the controller's
            # Python-side schedule (an int step that changes every step would re-trigger
            # compilation) and backends with their own kernels.
            for block in self.model.blocks:
                block.mlp.compile()
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
            fused=self.device.type == "cuda",
        )
        self.autocast = lambda: autocast_context(cfg.train.precision, self.device)
        self.step = 0
        self.train_time = 0.0
        self.tokens_since_log = 0
        self.time_since_log = 0.0
        # Windows of the previous metrics record; the run starts at full windows.
        self.last_logged_windows: torch.Tensor = self.model.aah_windows(cfg.data.seq_len)
        if resume:
            self._resume()
        elif info.is_main:
            self._start_run_dir()
        self.metrics = (
            MetricsLog(run_dir, tensorboard=cfg.log.tensorboard, resume_after=self.step if resume else None)
            if info.is_main else None
        )
        self.checkpoint_steps = _checkpoint_steps(cfg)
        ctrls = self.model.controllers()
        if ctrls and ctrls[0].config.scoring != "none" and cfg.train.max_steps <= ctrls[0].config.control_warmup:
            print(
                f"warning: train.max_steps ({cfg.train.max_steps}) <= the control warmup "
                f"({ctrls[0].config.control_warmup}): the controller never acts and every window stays full",
                file=sys.stderr,
            )

    # ------------------------------------------------------------------ run folder
    def _start_run_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.run_dir / "config.yaml")
        ctrls = self.model.controllers()
        update_meta(
            self.run_dir,
            version=__version__,
            git_commit=git_commit(),
            regime=self.cfg.aah.regime,
            seed=self.cfg.train.seed,
            device=str(self.device),
            torch=torch.__version__,
            world_size=self.info.world_size,
            start_time=now_iso(),
            end_time=None,
            status="running",
            seq_len=self.cfg.data.seq_len,
            candidate_windows=list(ctrls[0].candidates) if ctrls else [self.cfg.data.seq_len],
            parameters=self.model.num_parameters(),
            config=config_to_dict(self.cfg),
            machines=machines_with([], self.device),
        )

    def _resume(self) -> None:
        # Rank 0 picks the newest checkpoint that verifies (saying which it skipped and why);
        # every rank loads that one.
        choice: tuple[int, str] | str
        skipped: list[dict] = []
        if self.info.is_main:
            try:
                step, folder, skipped = newest_good_checkpoint(self.run_dir)
                choice = (step, str(folder))
            except CheckpointError as exc:
                choice = f"nothing to resume in {self.run_dir}: {exc}"
        else:
            choice = ""
        choice = broadcast_object(choice, self.info)
        if isinstance(choice, str):
            raise CheckpointError(choice)
        step, folder = choice[0], Path(choice[1])
        trust = self.trust_pickled_state
        if self.sharded:
            state = load_sharded_checkpoint(folder, self.model, self.optimizer, trust_pickled_state=trust)
        else:
            state = load_checkpoint(folder, self.model, map_location=self.device, trust_pickled_state=trust)
        try:
            if not self.sharded:
                self.optimizer.load_state_dict(state["optimizer"])
            self.data.train.load_state_dict(state["data"])
            self._restore_rng(state)
            self.train_time = float(state.get("train_time", 0.0))
            self.last_logged_windows = state.get("last_logged_windows", self.last_logged_windows)
        except (AttributeError, KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            raise CheckpointError(
                f"checkpoint {folder}: {STATE_JSON} does not hold this run's training state "
                f"({type(exc).__name__}: {exc})".splitlines()[0]
            ) from None
        self.step = step
        if self.info.is_main:
            machines = machines_with(read_meta(self.run_dir).get("machines", []), self.device)
            update_meta(self.run_dir, status="running", resumed_from=step, end_time=None,
                        skipped_checkpoints=skipped, machines=machines)
            print(f"resuming {self.run_dir} from step {step}", file=sys.stderr)

    def _restore_rng(self, state: dict) -> None:
        """Give every rank back its own generator states (dropout masks continue exactly)."""
        per_rank = state.get("rng_per_rank")
        rank, world = self.info.rank, self.info.world_size
        if per_rank is not None and len(per_rank) == world:
            set_rng_state(per_rank[rank])
            return
        saved_world = len(per_rank) if per_rank is not None else 1
        if rank == 0:
            set_rng_state(state["rng"])
        else:
            torch.manual_seed(rank_seed(self.cfg.train.seed, rank) + 104729 * state["step"])
        if world != saved_world and self.info.is_main:
            print(
                f"warning: the checkpoint was written by {saved_world} process(es), this run has {world}: "
                "ranks without a saved RNG state draw fresh dropout masks, so with model.dropout > 0 "
                "the resumed run is not bit-identical to an uninterrupted one",
                file=sys.stderr,
            )

    # ------------------------------------------------------------------ loop
    def run(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        last_loss = float("nan")
        bar = tqdm(
            total=t.max_steps, initial=self.step, desc=f"{cfg.aah.regime} seed {t.seed}", unit="step",
            disable=not (cfg.log.progress and self.info.is_main), dynamic_ncols=True, leave=True,
        )
        status = "complete"
        try:
            with _StopFlag() as stop:
                while self.step < t.max_steps:
                    last_loss = self._train_step()
                    bar.update(1)
                    if self.step % cfg.log.every == 0 or self.step == t.max_steps:
                        record = self._log_train(last_loss)
                        bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                        acr=f"{record['acr']:.3f}")
                    if cfg.eval.every > 0 and self.step % cfg.eval.every == 0:
                        self._periodic_eval()
                    # Every rank acts on a stop request that reached any of them, at the same step.
                    stopping = any_rank(stop.requested, self.info, self.device)
                    if self.step in self.checkpoint_steps or stopping:
                        self._checkpoint()
                    if stopping and self.step < t.max_steps:
                        status = "interrupted"
                        break
        except TrainingStopped as exc:
            self._finish("failed", str(exc))
            raise
        except KeyboardInterrupt:
            self._finish("interrupted", "stopped at once by a second interrupt; resume from the last checkpoint")
            raise
        except BaseException as exc:
            self._finish("failed", f"{type(exc).__name__}: {exc}")
            raise
        finally:
            bar.close()
            if self.metrics is not None:
                self.metrics.close()
        self._finish(status)
        if status == "interrupted" and self.info.is_main:
            print(f"stopped at step {self.step}; continue with: aah train --resume {self.run_dir}", file=sys.stderr)
        return TrainResult(self.run_dir, self.step, status, last_loss)

    def _train_step(self) -> float:
        cfg = self.cfg
        accum = cfg.train.grad_accum
        self.model.train()
        if self.model.set_step(self.step) is not None and self.info.is_main:
            far = max(far_cost(c) for c in self.model.controllers())
            print(f"step {self.step}: far-context cost {far:.4g} nats/token; the control warm-up ends",
                  file=sys.stderr)
        lr = lr_at(self.step, lr=cfg.optim.lr, warmup=cfg.optim.warmup_steps,
                   max_steps=cfg.optim.decay_steps or cfg.train.max_steps, min_ratio=cfg.optim.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        total = 0.0
        tokens = 0
        for micro in range(accum):
            x, y = next(self.data.train)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            sync_ctx = (
                self.ddp_model.no_sync()
                if self.info.enabled and micro < accum - 1 and hasattr(self.ddp_model, "no_sync")
                else contextlib.nullcontext()
            )
            with sync_ctx, self.autocast():
                _, loss = self.ddp_model(x, y)
            (loss / accum).backward()
            total += loss.detach().float().item() / accum
            tokens += x.numel()
        loss_value = all_reduce_mean(total, self.info, self.device)
        if not math.isfinite(loss_value):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingStopped(
                f"loss became {loss_value} at step {self.step}; stopping. The last good checkpoint is kept "
                f"in {self.run_dir / 'checkpoints'}; lower optim.lr or enable optim.grad_clip."
            )
        clip = cfg.optim.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        self.grad_norm = float(norm)
        self.lr = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.train_time += elapsed
        self.time_since_log += elapsed
        self.tokens_since_log += tokens * self.info.world_size
        self.step += 1
        return loss_value

    # ------------------------------------------------------------------ logging
    def _log_train(self, loss: float) -> dict:
        t = self.cfg.data.seq_len
        cov = self.model.coverage(t)
        windows = self.model.aah_windows(t)
        changed = int((windows != self.last_logged_windows).sum())
        self.last_logged_windows = windows
        record = {
            "kind": "train",
            "step": self.step,
            "loss": loss,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": self.tokens_since_log / max(self.time_since_log, 1e-9),
            "peak_mem_mb": peak_memory_mb(self.device),
            "acr": cov["acr"],
            "causal_coverage": cov["causal_coverage"],
            "acr_per_layer": cov["acr_per_layer"],
            "bucket_fractions": window_buckets(self.model, t),
            "levels_used": self.model.levels_used(),
            "windows_changed": changed,
            "windows": windows.tolist(),
            "ranks_agree": all_ranks_equal(windows, self.info, self.device),
            "time_s": self.train_time,
        }
        record.update(lost_mass_metrics(self.model.controllers()))  # per-layer lost mass (budgeted policies)
        self.tokens_since_log, self.time_since_log = 0, 0.0
        if self.metrics is not None:
            self.metrics.write(record)
        return record

    def _periodic_eval(self) -> None:
        c = self.cfg
        if is_recall(self.data.val):
            self._recall_eval()
            return
        loss = validation_loss(
            self.model, self.data.val, batch_size=c.eval.batch_size or c.train.batch_size,
            max_batches=c.eval.batches, device=self.device, autocast=self.autocast, info=self.info,
        )
        if self.metrics is not None:
            self.metrics.write({"kind": "eval", "step": self.step, "val_loss": loss,
                                "val_ppl": math.exp(min(loss, 50.0))})

    def _recall_eval(self) -> None:
        """Validation on a recall corpus: one pass gives the loss, text-only loss and recall accuracy."""
        c = self.cfg
        m = recall_metrics(
            self.model, self.data.val, batch_size=c.eval.batch_size or c.train.batch_size,
            max_batches=c.eval.batches, device=self.device, autocast=self.autocast, info=self.info,
        )
        if self.metrics is not None:
            self.metrics.write({
                "kind": "eval", "step": self.step, "val_loss": m["val_loss"],
                "val_ppl": math.exp(min(m["val_loss"], 50.0)), "text_loss": m["text_loss"],
                "recall_accuracy": m["recall_accuracy"], "recall_accuracy_by_bucket": m["recall_accuracy_by_bucket"],
            })

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self) -> None:
        error = None
        full = full_state_dicts(self.model, self.optimizer) if self.sharded else None  # all ranks
        rngs = all_gather_objects(rng_state(), self.info)  # every rank's generators, rank order
        if self.info.is_main:
            try:
                self._write_checkpoint(full, rngs)
            except TrainingStopped as exc:
                error = exc
        if any_rank(error is not None, self.info, self.device):  # all ranks stop together, none waits forever
            raise error or TrainingStopped(f"rank 0 could not write the checkpoint of step {self.step}")

    def _write_checkpoint(self, full: tuple[dict, dict] | None, rngs: list[dict]) -> None:
        weights, optimizer_state = full if full is not None else (self.model, self.optimizer.state_dict())
        state = {
            "step": self.step,
            "optimizer": optimizer_state,
            "data": self.data.train.state_dict(),
            "rng": rngs[0],
            "rng_per_rank": rngs,
            "train_time": self.train_time,
            "last_logged_windows": self.last_logged_windows,
            "config": config_to_dict(self.cfg),
        }
        try:
            save_checkpoint(self.run_dir, self.step, weights, state)
        except OSError as exc:
            raise TrainingStopped(
                f"could not write the checkpoint of step {self.step} ({exc}); its partial files were "
                f"removed and earlier checkpoints in {self.run_dir / 'checkpoints'} are intact"
            ) from exc
        update_meta(self.run_dir, last_checkpoint=self.step, backend=auto_label(self.model.backends_used()),
                    auto_backend_choices=auto_choices())

    def _finish(self, status: str, message: str | None = None) -> None:
        if not self.info.is_main:
            return
        fields = {"status": status, "end_time": now_iso(), "step": self.step,
                  "backend": auto_label(self.model.backends_used()), "auto_backend_choices": auto_choices(),
                  "train_time_s": self.train_time}
        if message:
            fields["message"] = message
        with contextlib.suppress(OSError):  # a full disk must not hide the original error
            update_meta(self.run_dir, **fields)
