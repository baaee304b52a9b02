"""Recall accuracy and text-only loss on a recall corpus (:mod:`aah.data.recall`).

One pass over the validation blocks gives, besides the mean next-token loss:

* ``text_loss``: the mean loss on the corpus bytes alone (episode bytes left out),
  comparable with the plain corpus's validation loss;
* ``recall_accuracy``: the share of queries whose whole value is predicted, every
  value byte the model's argmax under teacher forcing (the query and the value
  bytes before it are given; greedy decoding of the value would produce the same
  bytes exactly when every argmax is right, so this is the exact match of a greedy
  continuation of ``?k37=``);
* the same accuracy by distance bucket (``< T/4``, ``T/4 .. < T/2``, ``>= T/2``) and
  by eighths of the block (``recall_by_distance``, for the accuracy-vs-distance
  figure), with the number of queries behind each.

Everything is summed over ranks under torchrun, so the numbers do not depend on
the world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.recall import BUCKET_NAMES, TEXT, VALUE, RecallDataset, distance_bucket
from ..train.distributed import DistInfo

__all__ = ["DISTANCE_BINS", "is_recall", "recall_metrics", "summarise"]

#: Bins of the accuracy-vs-distance curve: eighths of the block length.
DISTANCE_BINS = 8


def is_recall(val) -> bool:
    """Whether validation blocks ``val`` carry recall episodes."""
    return isinstance(getattr(val, "dataset", None), RecallDataset)


def _sums_of_batch(
    logits: torch.Tensor, y: torch.Tensor, kind: np.ndarray, distance: np.ndarray, query: np.ndarray,
    seq_len: int,
) -> np.ndarray:
    """Sums of one batch, laid out as :func:`summarise` reads them."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
    right = (logits.argmax(-1) == y).cpu().numpy()
    nll = nll.double().cpu().numpy()
    text = kind == TEXT
    out = np.zeros(_width(), dtype=np.float64)
    out[0], out[1] = nll.sum(), nll.size
    out[2], out[3] = nll[text].sum(), text.sum()
    value = kind == VALUE
    out[4], out[5] = right[value].sum(), value.sum()
    rows, cols = np.nonzero(value)
    if rows.size:
        # one query = (row, query id); it is right when all its value bytes are
        key = rows * (int(query.max()) + 1) + query[rows, cols]
        ids, inverse = np.unique(key, return_inverse=True)
        wrong = np.zeros(ids.size, dtype=np.int64)
        np.add.at(wrong, inverse, ~right[rows, cols])
        dist_of = np.zeros(ids.size, dtype=np.int64)
        dist_of[inverse] = distance[rows, cols]
        ok = (wrong == 0).astype(np.float64)
        bucket = distance_bucket(dist_of, seq_len)
        fine = np.minimum(dist_of * DISTANCE_BINS // seq_len, DISTANCE_BINS - 1)
        base = 6
        np.add.at(out, base + 2 * bucket, ok)
        np.add.at(out, base + 2 * bucket + 1, 1.0)
        base += 2 * len(BUCKET_NAMES)
        np.add.at(out, base + 2 * fine, ok)
        np.add.at(out, base + 2 * fine + 1, 1.0)
    return out


def _width() -> int:
    return 6 + 2 * len(BUCKET_NAMES) + 2 * DISTANCE_BINS


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def summarise(sums: np.ndarray, seq_len: int) -> dict:
    """The metrics (JSON-ready) from summed counts; accuracies of empty buckets are None."""
    s = [float(v) for v in sums]
    buckets = s[6 : 6 + 2 * len(BUCKET_NAMES)]
    fine = s[6 + 2 * len(BUCKET_NAMES) :]
    queries = sum(buckets[1::2])
    edges = [seq_len * i // DISTANCE_BINS for i in range(DISTANCE_BINS + 1)]
    return {
        "val_loss": _ratio(s[0], s[1]),
        "text_loss": _ratio(s[2], s[3]),
        "text_tokens": int(s[3]),
        "recall_accuracy": _ratio(sum(buckets[0::2]), queries),
        "recall_queries": int(queries),
        "recall_byte_accuracy": _ratio(s[4], s[5]),
        "recall_accuracy_by_bucket": {n: _ratio(buckets[2 * i], buckets[2 * i + 1]) for i, n in enumerate(BUCKET_NAMES)},
        "recall_queries_by_bucket": {n: int(buckets[2 * i + 1]) for i, n in enumerate(BUCKET_NAMES)},
        "recall_by_distance": [
            {"lo": edges[i], "hi": edges[i + 1], "accuracy": _ratio(fine[2 * i], fine[2 * i + 1]),
             "queries": int(fine[2 * i + 1])}
            for i in range(DISTANCE_BINS)
        ],
    }


@torch.no_grad()
def recall_metrics(
    model,
    val,
    *,
    batch_size: int,
    max_batches: int | None,
    device: torch.device,
    autocast: Callable | None = None,
    info: DistInfo | None = None,
) -> dict:
    """Loss, text-only loss and recall accuracy over recall validation blocks (module docstring).

    ``val`` is a :class:`~aah.data.loader.ValidationBlocks` over a
    :class:`~aah.data.recall.RecallDataset`; rank ``r`` of ``W`` takes blocks ``r, r+W, ...``
    as :meth:`~aah.data.loader.ValidationBlocks.batches` does, and the first
    ``max_batches`` batches of each rank are used.
    """
    if not is_recall(val):
        raise ValueError("recall metrics need validation blocks of a recall corpus (data.corpus *_recall)")
    info = info or DistInfo()
    ds: RecallDataset = val.dataset
    mine = val.indices[info.rank :: info.world_size]
    sums = np.zeros(_width(), dtype=np.float64)
    was_training = model.training
    model.eval()
    try:
        for i, lo in enumerate(range(0, len(mine), batch_size)):
            if max_batches is not None and i >= max_batches:
                break
            idx = mine[lo : lo + batch_size]
            x, y = ds.batch(idx)
            kind, distance, query = ds.annotations(idx)
            with autocast() if autocast else contextlib.nullcontext():
                logits, _ = model(x.to(device))
            sums += _sums_of_batch(logits, y.to(device), kind, distance, query, ds.seq_len)
    finally:
        model.train(was_training)
    if info.enabled:
        t = torch.tensor(sums, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        sums = t.cpu().numpy()
    if sums[1] == 0:
        raise ValueError("no validation tokens: the validation split is empty")
    return summarise(sums, ds.seq_len)
