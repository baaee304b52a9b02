"""Token cache: a corpus split is tokenised once and kept as a memory-mapped array.

Layout under the cache directory (``$AAH_CACHE_DIR``, else ``~/.cache/aah``)::

    tokens/<corpus>-<split>-<key>.npy    token ids, uint16 (vocab <= 65536) or uint32
    tokens/<corpus>-<split>-<key>.json   what the file holds (for people, not read back)
    tokenizers/bpe-<vocab>-<key>.json    trained BPE tokenizers (see tokenizers.py)

``<key>`` hashes the corpus content hash (names and texts of the split's documents),
the split name and the tokenizer fingerprint, so editing any text, changing the
split fraction or the tokenizer produces a new file. The stream is every document
followed by the tokenizer's separator (its end-of-text id when it has one, else the
encoding of a blank line; for ``byte`` that is two newline bytes).

Files are written to a temporary name in the same folder and moved into place with
:func:`os.replace`, so a crash never leaves a partial file under the final name, and
several processes (e.g. DDP ranks) may build the same entry concurrently.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ._files import atomic_path, default_cache_dir
from .corpora import Corpus
from .tokenizers import Tokenizer

__all__ = ["default_cache_dir", "encode_corpus", "token_cache_path", "write_array_atomic"]

CACHE_FORMAT = "tokens-v1"


def _slug(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_.")
    return slug[-48:] or "corpus"


def token_cache_path(
    corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Cache file for (corpus content, split, tokenizer fingerprint)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(
        f"{CACHE_FORMAT}|{corpus.content_hash}|{corpus.split}|{tokenizer.fingerprint}".encode()
    ).hexdigest()[:24]
    return root / "tokens" / f"{_slug(corpus.name)}-{corpus.split}-{key}.npy"


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        write(fh)


def write_array_atomic(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Save ``array`` as ``.npy`` at ``path`` via a temporary file and :func:`os.replace`."""
    _atomic_write(Path(path), lambda fh: np.save(fh, array, allow_pickle=False))


def encode_corpus(
    corpus: Corpus,
    tokenizer: Tokenizer,
    cache_dir: str | os.PathLike[str] | None = None,
    verbose: bool = True,
) -> np.ndarray:
    """Token ids of ``corpus`` (read-only memory map), tokenising on the first call only."""
    path = token_cache_path(corpus, tokenizer, cache_dir)
    if not path.is_file():
        start = time.perf_counter()
        if verbose:
            print(
                f"aah.data: tokenising {corpus.name}/{corpus.split} ({len(corpus)} documents, "
                f"{corpus.num_bytes / 1e6:.1f} MB) with {tokenizer.name} ...",
                end="",
                file=sys.stderr,
                flush=True,
            )
        tokens = tokenizer.encode_documents([d.text for d in corpus.documents])
        tokens = np.ascontiguousarray(tokens, dtype=tokenizer.dtype)
        if tokens.size and int(tokens.max()) >= tokenizer.vocab_size:
            raise ValueError(f"tokenizer {tokenizer.name} produced an id >= its vocab_size")
        write_array_atomic(path, tokens)
        meta = {
            "format": CACHE_FORMAT,
            "corpus": corpus.name,
            "split": corpus.split,
            "content_hash": corpus.content_hash,
            "documents": corpus.document_names,
            "tokenizer": tokenizer.name,
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "dtype": str(tokens.dtype),
            "num_tokens": int(tokens.size),
        }
        _atomic_write(
            path.with_suffix(".json"), lambda fh: fh.write(json.dumps(meta, indent=1).encode())
        )
        if verbose:
            print(
                f" {tokens.size:,} tokens in {time.perf_counter() - start:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    return np.load(path, mmap_mode="r", allow_pickle=False)
