"""Tokenizers behind one small interface: ``byte``, trained ``bpe``, and local ``hf:`` files.

Every tokenizer has ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
``vocab_size``, a readable ``name``, a ``fingerprint`` that changes whenever the
mapping from text to ids could change (it keys the token cache), ``eos_id``
(``None`` when there is no end-of-text token) and ``separator`` (the ids put after
each document when a corpus is turned into one token stream).

``byte`` (the default)
    UTF-8 bytes, vocabulary 256, no training; ``decode(encode(s)) == s`` for every
    string. Documents are separated by a blank line (two ``\\n`` bytes).
``bpe``
    Byte-level BPE trained with the ``tokenizers`` library on the TRAIN split only,
    with a configurable vocabulary size and an ``<|endoftext|>`` token that separates
    documents. Training is deterministic, and the result is cached under
    ``<cache_dir>/tokenizers/`` keyed by the hash of the training text and the
    vocabulary size, so it is trained once and reloaded afterwards.
``hf:/local/path``
    Any Hugging Face tokenizer saved locally: a ``tokenizer.json`` file, or a folder
    holding one. It is read with ``tokenizers.Tokenizer.from_file`` and nothing is
    ever fetched from a hub. Special tokens (BOS/CLS...) are not added when encoding;
    documents are separated by the tokenizer's end-of-text token when it has one of
    the usual names, else by a blank line.

``bpe`` and ``hf:`` need the optional ``tokenizers`` package; without it they raise
:class:`TokenizerUnavailableError` saying ``pip install tokenizers``.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._files import atomic_path, default_cache_dir
from .corpora import Corpus, load_corpus

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers as hf_tokenizers

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerUnavailableError",
    "bpe_cache_path",
    "get_tokenizer",
    "train_bpe",
]

EOS_TOKEN = "<|endoftext|>"
#: End-of-text token names looked up (in this order) in ``hf:`` tokenizers.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eos|>")
#: Bumped whenever the BPE training recipe changes, so old cached files are not reused.
BPE_RECIPE = "bytelevel-bpe-v1"
DEFAULT_BPE_VOCAB_SIZE = 4096
TEXT_SEPARATOR = "\n\n"


class TokenizerUnavailableError(ImportError):
    """The optional ``tokenizers`` package is needed but not installed."""


def _import_tokenizers(what: str) -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise TokenizerUnavailableError(
            f"the {what} tokenizer needs the 'tokenizers' package: pip install tokenizers"
        ) from exc
    return tokenizers


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Tokenizer:
    """Common interface; subclasses implement ``encode``/``decode``."""

    name: str
    vocab_size: int
    fingerprint: str
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    @property
    def separator(self) -> list[int]:
        """Ids appended after every document in a token stream."""
        if self.eos_id is not None:
            return [self.eos_id]
        return self.encode(TEXT_SEPARATOR)

    @property
    def dtype(self) -> np.dtype:
        """Smallest unsigned dtype that holds every id (uint16 or uint32)."""
        return np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        """One token stream: each document followed by :attr:`separator`."""
        sep = self.separator
        pieces = []
        for ids in self.encode_batch(list(texts)):
            pieces.append(np.asarray(ids, dtype=self.dtype))
            pieces.append(np.asarray(sep, dtype=self.dtype))
        if not pieces:
            return np.zeros(0, dtype=self.dtype)
        return np.concatenate(pieces)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (vocabulary 256); exact round trip."""

    name = "byte"
    vocab_size = 256
    fingerprint = "byte-utf8-v1"
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        data = "".join(t + TEXT_SEPARATOR for t in texts).encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).astype(self.dtype)


class _HFBacked(Tokenizer):
    """Shared code for tokenizers held in a ``tokenizers.Tokenizer``."""

    def __init__(self, tok: hf_tokenizers.Tokenizer, name: str, fingerprint: str) -> None:
        self._tok = tok
        self.name = name
        self.fingerprint = fingerprint
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class BPETokenizer(_HFBacked):
    """Byte-level BPE trained on a corpus's train split (see :func:`train_bpe`)."""

    def __init__(self, path: Path) -> None:
        tokenizers = _import_tokenizers("bpe")
        tok = tokenizers.Tokenizer.from_file(str(path))
        super().__init__(
            tok,
            name=f"bpe-{tok.get_vocab_size(with_added_tokens=True)}",
            fingerprint=f"bpe-{_sha256_file(path)[:24]}",
        )
        self.path = path
        self.eos_id = tok.token_to_id(EOS_TOKEN)


class HFTokenizer(_HFBacked):
    """A Hugging Face ``tokenizer.json`` read from local disk."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        tokenizers = _import_tokenizers("hf:")
        p = Path(os.path.expanduser(str(path)))
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(
                f"hf tokenizer: no tokenizer.json at {p} (give a tokenizer.json file or a "
                "folder holding one; nothing is downloaded)"
            )
        tok = tokenizers.Tokenizer.from_file(str(file))
        super().__init__(tok, name=f"hf:{p}", fingerprint=f"hf-{_sha256_file(file)[:24]}")
        self.path = file
        for candidate in EOS_CANDIDATES:
            tid = tok.token_to_id(candidate)
            if tid is not None:
                self.eos_id = int(tid)
                break


# ---------------------------------------------------------------------------
# BPE training and cache
# ---------------------------------------------------------------------------


def bpe_cache_path(corpus: Corpus, vocab_size: int, cache_dir: str | os.PathLike[str]) -> Path:
    """Where the BPE trained on ``corpus`` with ``vocab_size`` is (or will be) stored."""
    key = hashlib.sha256(f"{BPE_RECIPE}|{vocab_size}|{corpus.content_hash}".encode()).hexdigest()
    return Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{key[:24]}.json"


def train_bpe(corpus: Corpus, vocab_size: int) -> hf_tokenizers.Tokenizer:
    """Train a byte-level BPE on the documents of ``corpus`` (deterministic)."""
    tokenizers = _import_tokenizers("bpe")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"bpe vocab_size must be at least {len(alphabet) + 1}, got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator([d.text for d in corpus.documents], trainer=trainer)
    return tok


def _load_or_train_bpe(
    corpus: Corpus, vocab_size: int, cache_dir: str | os.PathLike[str], verbose: bool
) -> BPETokenizer:
    path = bpe_cache_path(corpus, vocab_size, cache_dir)
    if not path.is_file():
        if verbose:
            print(
                f"aah.data: training bpe (vocab {vocab_size}) on {corpus.name}/{corpus.split} "
                f"({corpus.num_bytes / 1e6:.1f} MB)",
                file=sys.stderr,
                flush=True,
            )
        tok = train_bpe(corpus, vocab_size)
        with atomic_path(path) as tmp:
            tok.save(str(tmp))
    return BPETokenizer(path)


def get_tokenizer(
    spec: str = "byte",
    corpus: Corpus | str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    vocab_size: int = DEFAULT_BPE_VOCAB_SIZE,
    val_fraction: float = 0.1,
    verbose: bool = True,
) -> Tokenizer:
    """Build a tokenizer from its spec: ``"byte"``, ``"bpe"`` or ``"hf:/local/path"``.

    ``bpe`` needs ``corpus``: a :class:`Corpus` (its documents are the training text;
    a validation split is refused) or a corpus name, whose train split under
    ``val_fraction`` is then loaded. ``cache_dir`` defaults to ``$AAH_CACHE_DIR`` or
    ``~/.cache/aah``. ``bpe:N`` is accepted as a shorthand for ``vocab_size=N``.
    """
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("hf:"):
        return HFTokenizer(spec[len("hf:") :])
    if spec == "bpe" or spec.startswith("bpe:"):
        if spec.startswith("bpe:"):
            vocab_size = int(spec[len("bpe:") :])
        _import_tokenizers("bpe")
        if corpus is None:
            raise ValueError("the bpe tokenizer needs a corpus to train on (corpus=...)")
        if isinstance(corpus, str):
            corpus = load_corpus(corpus, "train", val_fraction)
        if corpus.split == "val":
            raise ValueError("refusing to train bpe on a validation split; pass the train split")
        return _load_or_train_bpe(corpus, vocab_size, cache_dir or default_cache_dir(), verbose)
    raise ValueError(f"unknown tokenizer {spec!r}: use 'byte', 'bpe' or 'hf:/local/path'")
