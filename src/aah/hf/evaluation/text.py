"""Token blocks of real text for calibration and evaluation, cut from the project's corpora.

The documents of one split (``train`` for calibration, ``val`` for held-out evaluation; see
:mod:`aah.data.corpora`) are tokenized in name order, joined, and cut into non-overlapping
blocks of ``seq_len`` tokens. Only as many documents as the blocks need are tokenized.
"""

from __future__ import annotations

import torch

from ...data.corpora import load_corpus

__all__ = ["token_blocks"]


def token_blocks(tokenizer, corpus: str, split: str, seq_len: int, num_blocks: int) -> torch.Tensor:
    """(num_blocks, seq_len) int64 token ids; ``ValueError`` when the split is too short."""
    if seq_len < 2 or num_blocks < 1:
        raise ValueError(f"need seq_len >= 2 and at least one block, got {seq_len} and {num_blocks}")
    documents = load_corpus(corpus, split).documents
    needed = seq_len * num_blocks
    ids: list[int] = []
    for doc in documents:
        ids.extend(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
        if len(ids) >= needed:
            break
    if len(ids) < needed:
        raise ValueError(
            f"corpus {corpus!r} ({split} split) has {len(ids)} tokens; {num_blocks} block(s) of "
            f"{seq_len} need {needed}"
        )
    return torch.tensor(ids[:needed], dtype=torch.int64).reshape(num_blocks, seq_len)
