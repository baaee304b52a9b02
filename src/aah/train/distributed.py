"""Process-group set-up for ``torchrun``: DDP by default, FSDP2 by config.

Under ``torchrun --nproc-per-node N`` the environment carries ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE``; outside it everything runs in one process.
The controllers average their observed features over ranks themselves
(:mod:`aah.controller.controller`), so every rank holds the same windows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistInfo",
    "all_gather_objects",
    "all_ranks_equal",
    "all_reduce_mean",
    "any_rank",
    "barrier",
    "broadcast_object",
    "init_distributed",
    "shutdown",
    "wrap_model",
]


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group that ``torchrun`` describes (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    if device_type == "cuda":
        torch.cuda.set_device(local)
    return DistInfo(rank=rank, local_rank=local, world_size=world)


def wrap_model(model: nn.Module, info: DistInfo, strategy: str, device: torch.device) -> nn.Module:
    """DDP (or FSDP2 ``fully_shard`` per block) around ``model``; unchanged in one process."""
    if not info.enabled:
        return model
    if strategy == "fsdp":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # public from torch 2.6 on
            from ..config import ConfigError

            raise ConfigError(
                f"train.distributed=fsdp needs torch >= 2.6 (FSDP2 fully_shard); this is torch {torch.__version__}"
            ) from None

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    # Buffers need no broadcast: the controllers reach identical decisions on every rank.
    return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)


def all_reduce_mean(value: float, info: DistInfo, device: torch.device) -> float:
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / info.world_size


def any_rank(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """``flag`` OR-ed over all ranks (the flag itself in one process)."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def all_ranks_equal(value: torch.Tensor, info: DistInfo, device: torch.device) -> bool:
    """Whether every rank holds exactly ``value`` (always true in one process)."""
    if not info.enabled:
        return True
    mine = value.to(device)
    gathered = [torch.empty_like(mine) for _ in range(info.world_size)]
    dist.all_gather(gathered, mine)
    return all(bool(torch.equal(g, mine)) for g in gathered)


def all_gather_objects(obj: object, info: DistInfo) -> list:
    """Every rank's ``obj`` in rank order (``[obj]`` in one process)."""
    if not info.enabled:
        return [obj]
    out: list = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, info: DistInfo, src: int = 0) -> object:
    """Rank ``src``'s ``obj`` on every rank (``obj`` itself in one process)."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
