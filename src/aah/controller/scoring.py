"""Enriched controller inputs and the two window scorers (paper sections 5.5-5.6).

* :func:`enrich` builds ``u = [g, eta_r, g - p, g - mean_r(g), s]``: 29 dims
  for the 9-dim base feature, parent difference zero at the top.
* :class:`SeededMLP` is a two-layer GELU MLP whose weights are buffers drawn
  from their own generator: they are seeded from the run seed, checkpointed
  with the AAH state, and never trained (argmax blocks all gradient, 5.7).
  Drawing them from a private generator keeps the backbone's initialisation
  identical whatever the regime.
* The base scorer maps ``u`` (29) to K window logits (29 -> 16 -> K); the wide
  joint sibling scorer maps ``[u_a, u_b, u_a - u_b, u_b - u_a]`` (116) to
  ``2 K`` logits that *replace* both siblings' base logits (116 -> 64 -> 2K).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["enrich", "level_coordinate", "joint_input", "SeededMLP", "sibling_pairs", "score_level"]


def level_coordinate(level: int, num_levels: int) -> float:
    """``eta_r = r / max(1, R - 1)``."""
    return level / max(1, num_levels - 1)


def enrich(
    features: torch.Tensor,
    parent_features: torch.Tensor | None,
    sizes: torch.Tensor,
    eta: float,
) -> torch.Tensor:
    """Enriched inputs of one level's items: (n, F) features -> (n, 3F + 2)."""
    n = features.shape[0]
    parent = features if parent_features is None else parent_features
    eta_col = torch.full((n, 1), float(eta), dtype=features.dtype, device=features.device)
    level_mean = features.mean(dim=0, keepdim=True)
    return torch.cat(
        [features, eta_col, features - parent, features - level_mean, sizes.to(features).view(n, 1)],
        dim=1,
    )


def joint_input(u_a: torch.Tensor, u_b: torch.Tensor) -> torch.Tensor:
    """The order-sensitive joint input ``[u_a, u_b, u_a - u_b, u_b - u_a]``."""
    return torch.cat([u_a, u_b, u_a - u_b, u_b - u_a], dim=-1)


class SeededMLP(nn.Module):
    """``Linear -> GELU -> Linear`` with PyTorch's default init drawn from a private generator."""

    def __init__(self, sizes: Sequence[int], generator: torch.Generator):
        super().__init__()
        self.sizes = tuple(sizes)
        for i, (fan_in, fan_out) in enumerate(zip(self.sizes, self.sizes[1:])):
            bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) and bias bound alike
            w = (torch.rand(fan_out, fan_in, generator=generator) * 2 - 1) * bound
            b = (torch.rand(fan_out, generator=generator) * 2 - 1) * bound
            self.register_buffer(f"weight{i}", w)
            self.register_buffer(f"bias{i}", b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = len(self.sizes) - 1
        for i in range(layers):
            w, b = getattr(self, f"weight{i}"), getattr(self, f"bias{i}")
            x = torch.nn.functional.linear(x.to(device=w.device, dtype=w.dtype), w, b)
            if i + 1 < layers:
                x = torch.nn.functional.gelu(x)
        return x


def sibling_pairs(children: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive children of one parent: (c0, c1), (c2, c3), ...; an odd one out is left alone."""
    return [(children[i], children[i + 1]) for i in range(0, len(children) - 1, 2)]


def score_level(
    inputs: torch.Tensor,
    sibling_groups: Sequence[Sequence[int]],
    base: SeededMLP,
    joint: SeededMLP | None,
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Window logits (n, K) for one level and the sibling pairs whose logits were replaced.

    ``sibling_groups`` lists, per parent (or once for the top level), the
    items that share it. With ``joint=None`` the base logits are kept
    (independent scoring).
    """
    # Decisions are tiny: whatever the scorer's device and dtype, logits come back as CPU float32.
    logits = base(inputs).float().cpu()
    pairs: list[tuple[int, int]] = []
    if joint is None:
        return logits, pairs
    for children in sibling_groups:
        pairs.extend(sibling_pairs(list(children)))
    if pairs:
        a = torch.tensor([p[0] for p in pairs])
        b = torch.tensor([p[1] for p in pairs])
        out = joint(joint_input(inputs[a], inputs[b])).float().cpu()
        k = logits.shape[1]
        logits = logits.clone()
        logits[a] = out[:, :k]
        logits[b] = out[:, k:]
    return logits, pairs
