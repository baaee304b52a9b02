"""``aah generate RUN_DIR``: stream text from a trained run with the per-window KV cache.

The run folder's ``config.yaml`` rebuilds the model and its tokenizer; a
checkpoint supplies the weights and the controllers' windows. By default that is
the newest checkpoint that verifies against its sha256 manifest (as ``aah eval``
and ``--resume`` choose it): each newer, damaged one is named on stderr and
passed over. A checkpoint named with ``--checkpoint`` that is damaged is an
error, not a fallback. The prompt is encoded with the run's own tokenizer, prefilled through
the cache of :mod:`aah.decode.cache`, and every new token is printed as soon as it is
decoded (a multi-byte character waits for its last byte). The text goes to
stdout; a last line on stderr gives the new tokens, tokens/s, the KV-cache
bytes next to a full cache of the same length, and which decode step ran
(:func:`aah.decode.ring_decode.decode_step_label`).

Every expected failure (a folder that is not a run, an unknown or unreadable
checkpoint, an empty or too long prompt, a bad option) is a
:class:`~aah.errors.CLIError`: one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..cli_flags import add_new_tokens, refuse
from ..errors import CLIError
from . import ring_decode
from .generate import check_sampling

__all__ = ["add_commands", "run_generate"]


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="stream text from a run's checkpoint (windowed KV cache)",
        description=(
            "Continue a prompt with a trained run's model, streaming the text as it is decoded. "
            "Ends with tokens/s and KV-cache bytes on stderr."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by aah train")
    p.add_argument("--prompt", default=None, metavar="TEXT", help="the prompt (or --prompt-file)")
    p.add_argument("--prompt-file", default=None, metavar="F", help="read the prompt from a UTF-8 file")
    add_new_tokens(p)
    refuse(p, "--max-new-tokens", "--max-new-tokens is now --new-tokens N")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: smallest set with mass p, in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--checkpoint", type=int, default=None, metavar="STEP", help="checkpoint step (default: the newest that verifies)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu")
    p.set_defaults(func=_run)


def _prompt_text(args: argparse.Namespace) -> str:
    if (args.prompt is None) == (args.prompt_file is None):
        raise CLIError("give exactly one of --prompt TEXT or --prompt-file F")
    if args.prompt is not None:
        text = args.prompt
    else:
        path = Path(args.prompt_file)
        if path.is_dir():
            raise CLIError(f"--prompt-file {path} is a directory, not a file")
        if not path.is_file():
            raise CLIError(f"--prompt-file {path}: no such file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CLIError(f"--prompt-file {path}: cannot be read as UTF-8 text ({exc.__class__.__name__})") from None
    if not text:
        raise CLIError("the prompt is empty")
    return text


def _check_options(args: argparse.Namespace) -> None:
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as exc:  # "top_k must be ..." -> "--top-k must be ..."
        name, rest = str(exc).split(" ", 1)
        raise CLIError(f"--{name.replace('_', '-')} {rest}") from None
    if args.checkpoint is not None and args.checkpoint < 0:
        raise CLIError(f"--checkpoint must be a step >= 0, got {args.checkpoint}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device is available")


def _checkpoint_folder(run_dir: Path, checkpoint: int | None, warn: Callable[[str], None]) -> tuple[int, Path]:
    """(step, folder) of the checkpoint to load, its weights verified against the manifest
    (generation never reads the training state).

    Without ``checkpoint`` the newest checkpoint that verifies, each newer bad one named
    through ``warn``; a named ``checkpoint`` that is missing or bad is an error, not a fallback.
    """
    from ..train.checkpoint import CheckpointError, checkpoint_at, newest_good_checkpoint

    try:
        if checkpoint is None:
            step, folder, _ = newest_good_checkpoint(run_dir, warn=warn, with_state=False)
            return step, folder
        return checkpoint, checkpoint_at(run_dir, checkpoint, warn=warn, with_state=False)
    except CheckpointError as exc:
        raise CLIError(str(exc)) from None


def _load(run_dir: Path, checkpoint: int | None, device: str, warn: Callable[[str], None]):
    """The run's tokenizer, model (weights loaded, eval mode) and checkpoint step.

    ``warn`` hears about the bad checkpoints passed over (see :func:`_checkpoint_folder`).
    """
    from ..config import ConfigError, load_config
    from ..data.tokenizers import get_tokenizer
    from ..train.checkpoint import CheckpointError, load_weights
    from ..train.setup import model_from_config

    if not run_dir.is_dir():
        raise CLIError(f"{run_dir} is not a folder")
    if not (run_dir / "config.yaml").is_file():
        raise CLIError(f"{run_dir} is not a run folder (no config.yaml)")
    try:
        cfg = load_config(run_dir / "config.yaml")
    except ConfigError as exc:
        raise CLIError(f"{run_dir}/config.yaml: {exc}") from None
    step, folder = _checkpoint_folder(run_dir, checkpoint, warn)
    d = cfg.data
    try:
        tokenizer = get_tokenizer(
            d.tokenizer, corpus=d.corpus, cache_dir=d.cache_dir, vocab_size=d.bpe_vocab_size,
            val_fraction=d.val_fraction, verbose=False,
        )
    except (ImportError, OSError, ValueError) as exc:
        raise CLIError(f"cannot build the run's tokenizer {d.tokenizer!r}: {exc}") from None
    model = model_from_config(cfg, tokenizer.vocab_size)
    try:
        load_weights(folder, model, map_location="cpu")
    except CheckpointError as exc:
        raise CLIError(f"checkpoint at step {step}: {exc}".splitlines()[0]) from None
    except Exception as exc:  # a damaged checkpoint: any reader error is the user's to fix
        raise CLIError(f"checkpoint at step {step} cannot be loaded: {exc}".splitlines()[0]) from None
    return tokenizer, model.to(device).eval(), step


class _TextStream:
    """Prints the decoded text of a growing id list, holding back an unfinished character."""

    def __init__(self, tokenizer, ids: list[int], out) -> None:
        self.tokenizer, self.ids, self.out = tokenizer, list(ids), out
        self.printed = ""

    def push(self, token: int | None = None, *, final: bool = False) -> None:
        if token is not None:
            self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            return  # wait for the rest of a multi-byte character
        if text.startswith(self.printed):
            new = text[len(self.printed) :]
        else:  # a tokenizer whose decoding of a prefix changed: print what is new
            new = text[len(self.printed) :] if len(text) > len(self.printed) else ""
        if new:
            self.out.write(new)
            self.out.flush()
        self.printed = text


def run_generate(args: argparse.Namespace, out=None, err=None) -> dict:
    """Run ``aah generate`` with parsed ``args``; returns the summary figures."""
    from .generate import iter_tokens

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    _check_options(args)
    text = _prompt_text(args)
    tokenizer, model, step = _load(
        Path(args.run_dir), args.checkpoint, args.device, lambda message: err.write(message + "\n")
    )
    ids = tokenizer.encode(text)
    if not ids:
        raise CLIError("the prompt is empty once tokenized")
    limit = model.config.max_seq_len
    if len(ids) > limit:
        raise CLIError(f"the prompt is {len(ids)} tokens, longer than the model's length {limit}")
    fits = limit - len(ids) + 1  # the last new token is never fed back
    if args.new_tokens > fits:
        raise CLIError(
            f"--new-tokens {args.new_tokens}: a prompt of {len(ids)} tokens leaves room for at most "
            f"{fits} new tokens (model length {limit})"
        )
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.tensor([ids], dtype=torch.long)
    stream = _TextStream(tokenizer, ids, out)
    stream.push()
    caches: list = []
    count = 0
    start = time.perf_counter()
    first = None
    for token in iter_tokens(
        model, prompt, args.new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, generator=generator, cache_out=caches,
    ):
        if first is None:
            first = time.perf_counter()
        count += 1
        stream.push(int(token[0]))
    end = time.perf_counter()
    stream.push(final=True)
    out.write("\n")
    out.flush()
    cache = caches[0]
    decode_s = end - first if first is not None and count > 1 else 0.0
    summary = {
        "checkpoint_step": step,
        "prompt_tokens": len(ids),
        "new_tokens": count,
        "prefill_s": (first or end) - start,
        "tokens_per_s": (count - 1) / decode_s if decode_s > 0 else None,
        "total_tokens_per_s": count / (end - start) if end > start else None,
        "kv_bytes": cache.memory_bytes(),
        "full_kv_bytes": cache.full_memory_bytes(),
        "decode_step": ring_decode.decode_step_label(cache.layers[0].device),
        "decode_route": cache.route,
    }
    rate = "n/a" if summary["tokens_per_s"] is None else f"{summary['tokens_per_s']:.1f} tokens/s"
    err.write(
        f"-- {count} new tokens from checkpoint step {step}: {rate} decoding "
        f"(after a {summary['prefill_s']:.3f} s prefill of {len(ids)} prompt tokens); "
        f"KV cache {summary['kv_bytes']:,} bytes ({summary['kv_bytes'] / summary['full_kv_bytes']:.3f} "
        f"of a full cache, {summary['full_kv_bytes']:,} bytes); decode step: {summary['decode_step']}, "
        f"route: {summary['decode_route']}\n"
    )
    err.flush()
    return summary


def _run(args: argparse.Namespace) -> int:
    run_generate(args)
    return 0
