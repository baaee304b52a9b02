"""Blocks of tokens, a seeded resumable batch iterator with DDP sharding, and validation blocks.

Blocks: a stream of N tokens is cut into ``(N - 1) // T`` non-overlapping blocks of
``T`` inputs. Block ``i`` has inputs ``tokens[i*T : i*T + T]`` and targets
``tokens[i*T + 1 : i*T + T + 1]`` (the inputs shifted by one), so every token except
the first is a target exactly once per epoch; the last target of a block is the
first input of the next one.

Order: epoch ``e`` visits the blocks in the permutation drawn by
``numpy.random.Generator(PCG64(SeedSequence([seed, e])))``; it depends only on the
seed and the epoch, never on global random state. Global batch ``p`` of the epoch is
``perm[p*B : (p+1)*B]`` for the global batch size ``B``; the incomplete tail of the
permutation is dropped (a different tail each epoch).

Resume: :meth:`BatchIterator.state_dict` is ``{"epoch", "position"}``, ``position``
being the number of global batches already produced in that epoch; loading it
continues with exactly the batch that would have come next.

DDP: ``batch_size`` is the GLOBAL batch size; it must be divisible by ``world_size``
and rank ``r`` yields the contiguous slice ``[r*b, (r+1)*b)`` of each global batch,
``b = batch_size // world_size``. Concatenating the ranks' batches of one step in rank
order gives exactly the single-process batch, and the state dict means the same at
any world size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["BatchIterator", "TokenDataset", "ValidationBlocks", "epoch_permutation"]


class TokenDataset:
    """Non-overlapping blocks of ``seq_len`` inputs (targets shifted by one) over a token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
        if tokens.ndim != 1:
            raise ValueError("tokens must be a 1-D array")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.num_blocks = max(0, (len(tokens) - 1) // self.seq_len)
        self._offsets = np.arange(self.seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_blocks

    def window(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``(len(indices), seq_len + 1)`` int64 array: each block and its next token."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_blocks):
            raise IndexError(f"block index out of range [0, {self.num_blocks})")
        starts = idx * self.seq_len
        return np.asarray(self.tokens[starts[:, None] + self._offsets[None, :]], dtype=np.int64)

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` LongTensors of shape ``(len(indices), seq_len)``."""
        w = torch.from_numpy(self.window(indices))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i < 0:
            i += self.num_blocks
        x, y = self.batch([i])
        return x[0], y[0]


def epoch_permutation(num_blocks: int, seed: int, epoch: int) -> np.ndarray:
    """The block order of one epoch: a function of (seed, epoch) only."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)])))
    return rng.permutation(num_blocks)


class BatchIterator:
    """Endless (or ``max_epochs``-long) seeded stream of ``(x, y)`` training batches.

    ``batch_size`` is the global batch size; this rank yields ``batch_size //
    world_size`` rows per step (see the module docstring for the sharding rule).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        max_epochs: int | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        if batch_size < 1 or batch_size % world_size:
            raise ValueError(
                f"global batch_size {batch_size} must be a positive multiple of world_size {world_size}"
            )
        if len(dataset) < batch_size:
            raise ValueError(
                f"only {len(dataset)} blocks of {dataset.seq_len} tokens, fewer than one global "
                f"batch of {batch_size}; use a smaller batch or sequence length, or more text"
            )
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.local_batch_size = self.batch_size // self.world_size
        self.max_epochs = max_epochs
        self.steps_per_epoch = len(dataset) // self.batch_size
        self.epoch = 0
        self.position = 0
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.steps_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch or self._perm is None:
            self._perm = epoch_permutation(len(self.dataset), self.seed, epoch)
            self._perm_epoch = epoch
        return self._perm

    def global_indices(self, epoch: int, position: int) -> np.ndarray:
        """Block indices of global batch ``position`` of ``epoch`` (all ranks)."""
        perm = self._permutation(epoch)
        return perm[position * self.batch_size : (position + 1) * self.batch_size]

    def local_indices(self, epoch: int, position: int) -> np.ndarray:
        """This rank's contiguous slice of :meth:`global_indices`."""
        lo = self.rank * self.local_batch_size
        return self.global_indices(epoch, position)[lo : lo + self.local_batch_size]

    def _normalise(self) -> None:
        if self.position >= self.steps_per_epoch:
            self.epoch += self.position // self.steps_per_epoch
            self.position %= self.steps_per_epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._normalise()
        if self.max_epochs is not None and self.epoch >= self.max_epochs:
            raise StopIteration
        idx = self.local_indices(self.epoch, self.position)
        self.position += 1
        return self.dataset.batch(idx)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}``: where the next batch comes from."""
        self._normalise()
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0:
            raise ValueError(f"invalid iterator state {state}")
        self.epoch, self.position = epoch, position
        self._normalise()


class ValidationBlocks:
    """A fixed list of blocks in stream order (the first ``max_blocks``, or all).

    No shuffling: the same blocks in the same order every time.
    """

    def __init__(self, dataset: TokenDataset, max_blocks: int | None = None) -> None:
        n = len(dataset) if max_blocks is None else min(int(max_blocks), len(dataset))
        if n < 1:
            raise ValueError(
                f"no validation block of {dataset.seq_len} tokens: the validation text is too short"
            )
        self.dataset = dataset
        self.indices = np.arange(n, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def seq_len(self) -> int:
        return self.dataset.seq_len

    @property
    def num_tokens(self) -> int:
        """Number of target tokens over all blocks."""
        return len(self.indices) * self.dataset.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset[int(self.indices[i])]

    def batches(
        self, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(x, y)`` batches in order; with DDP, rank ``r`` gets blocks ``r, r+W, r+2W, ...``.

        The last batch may be smaller. Sum losses and token counts over ranks for the mean.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        mine = self.indices[rank::world_size]
        for lo in range(0, len(mine), batch_size):
            yield self.dataset.batch(mine[lo : lo + batch_size])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(len(self)):
            yield self[i]
