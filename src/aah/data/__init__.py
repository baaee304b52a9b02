"""Training data: corpora, tokenizers, a token cache and seeded, resumable, DDP-aware batches.

The one-call entry point is :func:`build_data`::

    train, val, tok = build_data("shakespeare", "byte", seq_len=256, batch_size=32, seed=0)
    x, y = next(train)                      # LongTensors (32, 256), y is x shifted by one
    for xv, yv in val.batches(64): ...      # fixed validation blocks

Pieces: :mod:`.corpora` (corpus registry and split by document), :mod:`.tokenizers`
(``byte``, ``bpe``, ``hf:/path``), :mod:`.cache` (memory-mapped token cache) and
:mod:`.loader` (blocks, :class:`BatchIterator`, :class:`ValidationBlocks`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from .cache import default_cache_dir, encode_corpus, token_cache_path
from .corpora import (
    Corpus,
    CorpusNotFoundError,
    Document,
    available_corpora,
    load_corpus,
    load_documents,
    register_corpus,
    split_documents,
)
from .loader import BatchIterator, TokenDataset, ValidationBlocks, epoch_permutation
from .recall import RECALL_CORPORA, RecallDataset, RecallSpec
from .tokenizers import (
    DEFAULT_BPE_VOCAB_SIZE,
    Tokenizer,
    TokenizerUnavailableError,
    get_tokenizer,
)

__all__ = [
    "BatchIterator",
    "Corpus",
    "CorpusNotFoundError",
    "Data",
    "Document",
    "RECALL_CORPORA",
    "RecallDataset",
    "RecallSpec",
    "TokenDataset",
    "Tokenizer",
    "TokenizerUnavailableError",
    "ValidationBlocks",
    "available_corpora",
    "build_data",
    "default_cache_dir",
    "encode_corpus",
    "epoch_permutation",
    "get_tokenizer",
    "load_corpus",
    "load_documents",
    "register_corpus",
    "split_documents",
    "token_blocks",
    "token_cache_path",
]


def token_blocks(
    corpus: str | Corpus,
    tokenizer: Tokenizer,
    seq_len: int,
    split: str = "train",
    val_fraction: float = 0.1,
    cache_dir: str | os.PathLike[str] | None = None,
    verbose: bool = True,
) -> TokenDataset:
    """Blocks of ``seq_len`` tokens of one split of a corpus (tokenised via the cache)."""
    if isinstance(corpus, str):
        corpus = load_corpus(corpus, split, val_fraction)
    return TokenDataset(encode_corpus(corpus, tokenizer, cache_dir, verbose=verbose), seq_len)


class Data(NamedTuple):
    """What :func:`build_data` returns; unpacks as ``train, val, tokenizer``."""

    train: BatchIterator
    val: ValidationBlocks
    tokenizer: Tokenizer


def build_data(
    corpus: str = "shakespeare",
    tokenizer: str = "byte",
    seq_len: int = 256,
    batch_size: int = 32,
    seed: int = 0,
    val_fraction: float = 0.1,
    cache_dir: str | os.PathLike[str] | None = None,
    rank: int = 0,
    world_size: int = 1,
    bpe_vocab_size: int = DEFAULT_BPE_VOCAB_SIZE,
    val_max_blocks: int | None = None,
    val_corpus: str | None = None,
    verbose: bool = True,
    recall: RecallSpec | None = None,
) -> Data:
    """Train iterator, validation blocks and tokenizer for one corpus.

    ``batch_size`` is the global batch size (this rank gets ``batch_size // world_size``
    rows). The tokenizer (``byte``, ``bpe`` or ``hf:/path``) is trained, for ``bpe``,
    on the train split only. Validation uses the corpus's val split, or, when
    ``val_corpus`` is given, the whole of that corpus (out-of-domain evaluation);
    ``val_max_blocks`` keeps only the first blocks. A recall corpus
    (:data:`RECALL_CORPORA`, byte tokenizer only) writes the key-value episodes of
    ``recall`` (default :class:`RecallSpec`) into the train and validation blocks of its
    own corpus (an out-of-domain ``val_corpus`` stays plain text).
    """
    is_recall = corpus in RECALL_CORPORA
    if is_recall and tokenizer != "byte":
        raise ValueError(
            f"the recall corpus {corpus!r} writes its episodes as bytes and needs tokenizer 'byte', "
            f"got {tokenizer!r}"
        )
    spec = (recall or RecallSpec()) if is_recall else None
    root = cache_dir if cache_dir is not None else default_cache_dir()
    train_corpus = load_corpus(corpus, "train", val_fraction)
    if val_corpus is None:
        val_split = load_corpus(corpus, "val", val_fraction)
    else:
        val_split = load_corpus(val_corpus, "all")
    tok = get_tokenizer(
        tokenizer, corpus=train_corpus, cache_dir=root, vocab_size=bpe_vocab_size, verbose=verbose
    )
    train_ds = TokenDataset(encode_corpus(train_corpus, tok, root, verbose=verbose), seq_len)
    val_ds = TokenDataset(encode_corpus(val_split, tok, root, verbose=verbose), seq_len)
    if spec is not None:
        train_ds = RecallDataset(train_ds, spec, "train")
        if val_corpus is None:
            val_ds = RecallDataset(val_ds, spec, "val")
    if val_corpus in RECALL_CORPORA and tokenizer == "byte":
        val_ds = RecallDataset(val_ds, recall or RecallSpec(), "all")
    train = BatchIterator(train_ds, batch_size, seed=seed, rank=rank, world_size=world_size)
    return Data(train, ValidationBlocks(val_ds, val_max_blocks), tok)
