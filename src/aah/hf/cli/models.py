"""Loading what the ``aah hf`` commands read: a transformers folder (offline) and text blocks.

Every expected failure is one line (:class:`aah.errors.CLIError`), raised before the weights load
where it can be.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ...errors import CLIError

__all__ = ["convert_command", "load_model_folder", "token_blocks_of"]


def convert_command(args: argparse.Namespace) -> int:
    import torch

    try:
        from .. import convert_gguf

        out = convert_gguf(args.gguf_file, args.out_dir, dtype=getattr(torch, args.dtype))
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as exc:
        raise CLIError(str(exc)) from None
    print(f"converted {args.gguf_file} -> {out}")
    return 0


def load_model_folder(model_dir: str, seq_len: int):
    """(config, tokenizer, load_model) for a transformers folder, offline.

    The config and tokenizer are checked first, so that bad input fails before the weights
    load; ``load_model()`` then reads them. CLIError for every expected failure.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from .._transformers import require

        transformers = require()
    except ImportError as exc:
        raise CLIError(str(exc)) from None
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise CLIError(f"{folder} is not a transformers model folder (no config.json); see aah hf convert")
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise CLIError(f"{folder}: unreadable config: {exc}") from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise CLIError(f"{folder} holds a {config.model_type} model, which is not a causal LM")
    _check_supported(transformers, config, folder)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise CLIError(f"--seq-len {seq_len} must be in [2, {limit}] (max_position_embeddings of the model)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise CLIError(f"{folder} has no usable tokenizer: {exc}") from None

    def load_model():
        import torch
        from safetensors import SafetensorError

        try:
            return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CLIError(f"{folder}: the weights cannot be loaded ({type(exc).__name__}: {first})") from None

    return config, tokenizer, load_model


def _check_supported(transformers, config, folder: Path) -> None:
    """CLIError unless the bridge can patch this architecture: its layers, built on the meta device
    (no memory, no weights read), have the attention modules :func:`aah.hf.patch` needs."""
    import torch

    from ..bridge.spec import attention_modules

    try:
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
        attention_modules(skeleton)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise CLIError(f"{folder}: {str(exc).splitlines()[0]}") from None


def token_blocks_of(tokenizer, corpus: str, split: str, seq_len: int, count: int):
    from ...data.corpora import CorpusNotFoundError
    from ..evaluation.text import token_blocks

    if count < 1:
        raise CLIError(f"--batches must be >= 1, got {count}")
    try:
        return token_blocks(tokenizer, corpus, split, seq_len, count)
    except (CorpusNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
