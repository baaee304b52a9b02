"""From window logits to per-head execution windows (paper sections 5.7-5.8).

1. hard argmax per item, top-down, with the parent index clamp
   ``c_i = min(c_raw_i, c_parent(i))`` below the top level;
2. group-to-head mapping ``c_h = c_group(h)`` from level 0;
3. resolution EMA ``c~_h = round(beta * c~_prev + (1 - beta) * c_h)``,
   exactly the paper's formula, rounding halves up;
4. execution window ``W_h = clamp(W[c~_h], W_min, T)``.

With ``window_granularity="kv_group"`` (our option, not the paper's) step 3 is
followed by :func:`share_within_kv_groups`: the query heads that share a KV
head take the largest index any of them holds, so they execute one window.

All steps are index operations without gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "select_top_down",
    "map_to_heads",
    "resolution_ema",
    "execution_windows",
    "simple_policy_index",
    "share_within_kv_groups",
]


def select_top_down(
    logits: Sequence[torch.Tensor],
    parents: Sequence[Sequence[int] | None],
    *,
    parent_constraint: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Raw argmax and parent-clamped indices for every level (level 0 first)."""
    raw = [z.argmax(dim=-1) for z in logits]
    clamped: list[torch.Tensor] = [torch.empty(0)] * len(logits)
    top = len(logits) - 1
    clamped[top] = raw[top]
    for r in range(top - 1, -1, -1):
        if parent_constraint:
            parent_index = clamped[r + 1][torch.as_tensor(parents[r], device=raw[r].device)]
            clamped[r] = torch.minimum(raw[r], parent_index)
        else:
            clamped[r] = raw[r]
    return raw, clamped


def map_to_heads(level0: Sequence[Sequence[int]], index: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``c_h = c_group(h)``: every head takes its level-0 group's index."""
    out = torch.full((num_heads,), -1, dtype=torch.long, device=index.device)
    for g, heads in enumerate(level0):
        out[list(heads)] = index[g]
    if bool((out < 0).any()):
        raise ValueError(f"level-0 groups {level0} do not cover all {num_heads} heads")
    return out


def resolution_ema(previous: torch.Tensor, new: torch.Tensor, beta: float, num_windows: int) -> torch.Tensor:
    """``round(beta * previous + (1 - beta) * new)`` clamped to the candidate range."""
    mixed = beta * previous.double() + (1.0 - beta) * new.double()
    return torch.floor(mixed + 0.5).long().clamp(0, num_windows - 1)


def execution_windows(
    index: torch.Tensor, candidates: Sequence[int], min_window: int, seq_len: int
) -> tuple[int, ...]:
    """``W_h = clamp(W[c~_h], W_min, T)`` as Python ints."""
    k = len(candidates)
    # clamp(x, lo, hi) with hi winning when T < W_min, as torch.clamp does.
    return tuple(
        min(max(int(candidates[max(0, min(k - 1, c))]), min_window), seq_len) for c in index.tolist()
    )


def simple_policy_index(entropy: torch.Tensor, usage: torch.Tensor, num_windows: int) -> torch.Tensor:
    """The deterministic ablation rule: index ``floor(K * (entropy + usage) / 2)``, capped at K - 1."""
    demand = ((entropy.double() + usage.double()) / 2).clamp(0.0, 1.0)
    return torch.floor(demand * num_windows).long().clamp(max=num_windows - 1)


def share_within_kv_groups(index: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Every query head takes the largest index of its KV group (``window_granularity="kv_group"``).

    Query head ``h`` belongs to KV group ``h // (H / H_kv)``, as in
    :func:`aah.attend`. The largest index is kept so that no head executes a
    shorter window than its own choice; a KV head's cache then holds exactly
    the window its query heads read. Example with 8 heads and 2 KV heads:
    ``[0, 0, 1, 0, 0, 3, 2, 0] -> [1, 1, 1, 1, 3, 3, 3, 3]``.
    """
    heads = index.shape[0]
    if num_kv_heads < 1 or heads % num_kv_heads:
        raise ValueError(f"{heads} heads cannot be split into {num_kv_heads} KV groups")
    grouped = index.reshape(num_kv_heads, heads // num_kv_heads)
    return grouped.amax(dim=1, keepdim=True).expand_as(grouped).reshape(heads).clone()
