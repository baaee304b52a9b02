"""Recall metrics (aah.evaluate.recall): accuracy by distance bucket and the text-only loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from aah.data.loader import ValidationBlocks
from aah.data.recall import MARKUP, VALUE, RecallDataset, RecallSpec
from aah.evaluate.recall import recall_metrics

from ..data.test_recall_corpus import T, _base


class _Lookup(nn.Module):
    """Predicts from a table of the right next tokens; ``wrong(kind, distance)`` marks targets
    where it predicts a wrong byte instead (with a confident one-hot either way)."""

    def __init__(self, ds: RecallDataset, blocks, wrong):
        super().__init__()
        self.rows = {}
        for b in blocks:
            x, y = ds.batch([b])
            kind, distance, _ = ds.annotations([b])
            bad = torch.from_numpy(wrong(kind[0], distance[0]))
            pred = torch.where(bad, (y[0] + 1) % 256, y[0])
            self.rows[bytes(x[0].to(torch.uint8).numpy())] = pred

    def forward(self, x):
        preds = torch.stack([self.rows[bytes(r.to(torch.uint8).numpy())] for r in x])
        return torch.nn.functional.one_hot(preds, 256).float() * 30.0, None


def _metrics(ds, wrong):
    val = ValidationBlocks(ds, max_blocks=12)
    model = _Lookup(ds, range(12), wrong)
    return recall_metrics(model, val, batch_size=5, max_batches=None, device=torch.device("cpu"))


def test_perfect_predictions_give_full_recall_and_zero_loss():
    ds = RecallDataset(_base(), RecallSpec(fraction=0.12, pairs=4), "val")
    m = _metrics(ds, lambda kind, d: np.zeros_like(kind, dtype=bool))
    assert m["recall_accuracy"] == 1.0 and m["recall_byte_accuracy"] == 1.0
    assert m["text_loss"] < 1e-6 and m["val_loss"] < 1e-6
    kind = ds.annotations(range(12))[0]
    assert m["recall_queries"] == int((kind == VALUE).sum()) // 3 > 0


def test_far_errors_count_only_in_the_far_bucket_and_text_loss_ignores_episodes():
    ds = RecallDataset(_base(), RecallSpec(fraction=0.12, pairs=4), "val")
    # wrong on the LAST value byte of far queries only, and on every markup byte
    def wrong(kind, distance):
        last = np.zeros_like(kind, dtype=bool)
        value = kind == VALUE
        last[:-1] = value[:-1] & ~value[1:]
        last[-1] = value[-1]
        return (last & (distance * 2 >= T)) | (kind == MARKUP)

    m = _metrics(ds, wrong)
    kinds, dists = ds.annotations(range(12))[0], ds.annotations(range(12))[1]
    value_d = dists[kinds == VALUE]
    n_far = int((value_d * 2 >= T).sum()) // 3
    n_near = int(((value_d * 4 < T)).sum()) // 3
    assert m["recall_accuracy_by_bucket"]["gt_half"] == 0.0
    assert m["recall_queries_by_bucket"]["gt_half"] == n_far
    assert m["recall_queries_by_bucket"]["lt_quarter"] == n_near
    if n_near:
        assert m["recall_accuracy_by_bucket"]["lt_quarter"] == 1.0
    total = m["recall_queries"]
    assert m["recall_accuracy"] == pytest.approx((total - n_far) / total)
    assert m["text_loss"] < 1e-6 < m["val_loss"]  # markup errors raise the loss, not the text loss
    by = m["recall_by_distance"]
    assert sum(b["queries"] for b in by) == total
    assert all(b["accuracy"] in (0.0, None) for b in by if b["lo"] * 2 >= T)
