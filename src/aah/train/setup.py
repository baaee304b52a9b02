"""Building blocks shared by training and evaluation: device, precision, data, model."""

from __future__ import annotations

import contextlib

import torch

from ..config import ConfigError, RunConfig, controller_config, model_config
from ..data import Data, build_data
from ..model import GPT
from ..windows import bucket_fractions

__all__ = ["resolve_device", "autocast_context", "data_from_config", "model_from_config", "window_buckets"]


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` = CUDA when available, else CPU; ``cuda`` without a GPU is a :class:`ConfigError`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was asked for but no CUDA device is available; use 'cpu' or 'auto'")
        return torch.device("cuda", local_rank)
    return torch.device(name)


def autocast_context(precision: str, device: torch.device):
    """bf16 autocast where the device supports it (``auto`` picks it on CUDA only)."""
    use_bf16 = precision == "bf16" or (
        precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
    )
    if not use_bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def data_from_config(cfg: RunConfig, *, rank: int = 0, world_size: int = 1, corpus: str | None = None,
                     verbose: bool = True) -> Data:
    """The run's data; a corpus or tokenizer setting that cannot work raises :class:`ConfigError`
    (a missing corpus or package keeps its own ``FileNotFoundError`` / ``ImportError``)."""
    d = cfg.data
    val_corpus = d.val_corpus
    if corpus is not None and corpus != d.corpus:
        val_corpus = corpus  # evaluate on another corpus as out-of-domain text
    try:
        return _build(cfg, val_corpus, rank, world_size, verbose)
    except ConfigError:
        raise
    except ValueError as exc:  # the corpus or tokenizer settings do not work together
        raise ConfigError(f"data: {exc}") from None


def _build(cfg: RunConfig, val_corpus: str | None, rank: int, world_size: int, verbose: bool) -> Data:
    d = cfg.data
    return build_data(
        corpus=d.corpus,
        tokenizer=d.tokenizer,
        seq_len=d.seq_len,
        batch_size=cfg.train.batch_size,
        seed=cfg.train.seed,
        val_fraction=d.val_fraction,
        cache_dir=d.cache_dir,
        rank=rank,
        world_size=world_size,
        bpe_vocab_size=d.bpe_vocab_size,
        val_corpus=val_corpus,
        verbose=verbose,
        recall=d.recall_spec(),
    )


def model_from_config(cfg: RunConfig, vocab_size: int) -> GPT:
    """The model under ``train.seed``: identical backbone weights whatever the regime."""
    torch.manual_seed(cfg.train.seed)
    return GPT(model_config(cfg, vocab_size), controller_config(cfg))


def window_buckets(model: GPT, seq_len: int) -> dict[str, float]:
    """Fraction of all (layer, head) windows at each candidate window (keys are windows as strings).

    A window that is not a candidate (full attention before the first decision when the
    candidates stop below ``seq_len``) gets a bucket of its own.
    """
    windows = model.aah_windows(seq_len).flatten().tolist()
    ctrls = model.controllers()
    candidates = {min(w, seq_len) for w in ctrls[0].candidates} if ctrls else {seq_len}
    return bucket_fractions(windows, sorted(candidates | set(windows)))
