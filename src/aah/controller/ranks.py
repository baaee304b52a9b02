"""Averaging over ``torch.distributed`` ranks, so that every rank makes the same window decision."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["mean_over_ranks"]


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The mean of ``x`` over all ranks (a copy); ``x`` itself without a process group of several ranks."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= dist.get_world_size()
    return x
