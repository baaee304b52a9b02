"""Hierarchy construction over heads (paper section 5.4).

A topology is a tuple of levels; level ``r`` is a tuple of items; an item is
the tuple of its children: head indices at level 0, indices of level ``r-1``
items above. Levels are built bottom-up:

* level 0: one greedy pass in head order of cosine centroid-threshold
  clustering (a head joins the most similar centroid when the cosine reaches
  the threshold, else opens a cluster); if everything lands in one cluster,
  the deterministic forced bipartition takes the least similar pair of heads
  as anchors and gives every other head to the anchor it is more similar to
  (ties go to the smaller group, then to the first anchor); if there are more
  clusters than the hierarchy shape allows (2 for ``[2]``, 16 for
  ``[2,2,2,2]``), the two clusters with the most similar centroids merge until
  they fit (:func:`cap_groups`);
* upper levels: items merge with the ``cosine_normdiff`` similarity
  ``cos(a, b) - lambda * |‖a‖ - ‖b‖| / max(‖a‖, ‖b‖, eps)``; greedy in item
  order, each item takes its most similar unassigned partners above the
  threshold (up to the level's branching factor); an item with no partner
  becomes a single-child parent; growth stops at the maximum depth, or when a
  level would merge everything into one item: like the reference
  implementation that level is not added (stop reason
  ``upper_level_collapsed``) unless ``keep_collapsed_top`` asks for it;
* pass-through upper levels (the reference's freeze-after-warmup reading):
  every level above 0 copies the one below, one single-child parent per item.

Group features are child-weighted means (``g_i^(r)`` of section 5.4).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "Topology",
    "standardize",
    "cosine_matrix",
    "level0_cosine_groups",
    "forced_bipartition",
    "cap_groups",
    "random_bipartition",
    "normdiff_similarity",
    "merge_level",
    "level_features",
    "size_fractions",
    "parents_of",
    "build_upper_levels",
    "grow_upper_levels",
    "STOP_REASONS",
    "topology_to_tensor",
    "topology_from_tensor",
]

Level = tuple[tuple[int, ...], ...]
Topology = tuple[Level, ...]


def standardize(features: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Z-score every feature column across heads (rows)."""
    mean = features.mean(dim=0, keepdim=True)
    std = features.std(dim=0, unbiased=False, keepdim=True)
    return (features - mean) / (std + eps)


def cosine_matrix(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Pairwise cosine similarity of the rows of ``x``; a zero row has cosine 0 with everything."""
    x = x.double()
    norms = x.norm(dim=1)
    return (x @ x.T) / (norms[:, None] * norms[None, :]).clamp_min(eps)


def _cosine(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-8) -> float:
    a, b = a.double(), b.double()
    return float((a @ b) / max(float(a.norm() * b.norm()), eps))


def level0_cosine_groups(features: torch.Tensor, threshold: float) -> list[list[int]]:
    """Greedy centroid-threshold clustering in head order (no fallback)."""
    groups: list[list[int]] = []
    centroids: list[torch.Tensor] = []
    for h in range(features.shape[0]):
        x = features[h]
        sims = [_cosine(x, c) for c in centroids]
        best = max(range(len(sims)), key=lambda i: sims[i]) if sims else -1
        if best >= 0 and sims[best] >= threshold:
            groups[best].append(h)
            centroids[best] = features[groups[best]].mean(dim=0)
        else:
            groups.append([h])
            centroids.append(x.clone())
    return groups


def forced_bipartition(features: torch.Tensor) -> list[list[int]]:
    """Deterministic split around the least similar pair of heads (the level-0 fallback)."""
    n = features.shape[0]
    if n < 2:
        return [list(range(n))]
    sim = cosine_matrix(features)
    iu = torch.triu_indices(n, n, offset=1)
    flat = sim[iu[0], iu[1]]
    pick = int(torch.argmin(flat))  # first least-similar pair in row-major order
    a, b = int(iu[0, pick]), int(iu[1, pick])
    ga, gb = [a], [b]
    for h in range(n):
        if h in (a, b):
            continue
        sa, sb = float(sim[h, a]), float(sim[h, b])
        if sa > sb or (sa == sb and len(ga) <= len(gb)):
            ga.append(h)
        else:
            gb.append(h)
    return [sorted(ga), sorted(gb)]


def cap_groups(groups: Sequence[Sequence[int]], features: torch.Tensor, max_groups: int | None) -> list[list[int]]:
    """Merge level-0 clusters until at most ``max_groups`` remain (the shape's cap, section 5.4).

    Each round merges the two groups whose centroids (mean feature of their
    heads) have the highest cosine; ties take the first pair in row-major
    order. The merged group takes the place of the first of the two, so the
    order of the groups (which decides the sibling pairs) is otherwise kept.
    ``None`` = no cap.
    """
    out = [sorted(g) for g in groups]
    if max_groups is None:
        return out
    if max_groups < 1:
        raise ValueError(f"max_groups must be >= 1, got {max_groups}")
    while len(out) > max_groups:
        centroids = torch.stack([features[g].double().mean(dim=0) for g in out])
        sim = cosine_matrix(centroids)
        n = len(out)
        best, pair = -float("inf"), (0, 1)
        for i in range(n):
            for j in range(i + 1, n):
                if float(sim[i, j]) > best:
                    best, pair = float(sim[i, j]), (i, j)
        i, j = pair
        out[i] = sorted(out[i] + out[j])
        del out[j]
    return out


def random_bipartition(num_heads: int, generator: torch.Generator) -> list[list[int]]:
    """A balanced random split of the heads (the fixed random grouping control)."""
    if num_heads < 2:
        return [list(range(num_heads))]
    perm = torch.randperm(num_heads, generator=generator).tolist()
    half = num_heads // 2
    groups = [sorted(perm[:half]), sorted(perm[half:])]
    return sorted(groups, key=lambda g: g[0])


def normdiff_similarity(a: torch.Tensor, b: torch.Tensor, penalty: float, eps: float) -> float:
    """``cos(a, b) - penalty * |‖a‖ - ‖b‖| / max(‖a‖, ‖b‖, eps)`` (section 5.4, upper levels)."""
    na, nb = float(a.double().norm()), float(b.double().norm())
    return _cosine(a, b) - penalty * abs(na - nb) / max(na, nb, eps)


def merge_level(
    features: torch.Tensor, threshold: float, penalty: float, eps: float, branching: int
) -> list[list[int]]:
    """Group the items of one level into parents (greedy in item order, see module doc)."""
    n = features.shape[0]
    assigned = [False] * n
    parents: list[list[int]] = []
    for i in range(n):
        if assigned[i]:
            continue
        assigned[i] = True
        children = [i]
        candidates = [
            (normdiff_similarity(features[i], features[j], penalty, eps), j)
            for j in range(i + 1, n)
            if not assigned[j]
        ]
        # Most similar first; equal similarity keeps item order.
        candidates.sort(key=lambda sj: (-sj[0], sj[1]))
        for sim, j in candidates:
            if len(children) >= branching or sim < threshold:
                break
            children.append(j)
            assigned[j] = True
        parents.append(sorted(children))
    return parents


def level_features(topology: Sequence[Sequence[Sequence[int]]], head_features: torch.Tensor) -> list[torch.Tensor]:
    """Child-weighted mean feature of every item, level by level: ``[(n_0, F), (n_1, F), ...]``."""
    out: list[torch.Tensor] = []
    below = head_features
    for level in topology:
        feats = torch.stack([below[list(children)].mean(dim=0) for children in level])
        out.append(feats)
        below = feats
    return out


def size_fractions(topology: Sequence[Sequence[Sequence[int]]]) -> list[torch.Tensor]:
    """``s_i^(r)``: immediate children of each item over all children of the level."""
    out = []
    for level in topology:
        counts = torch.tensor([len(children) for children in level], dtype=torch.float32)
        out.append(counts / counts.sum())
    return out


def parents_of(topology: Sequence[Sequence[Sequence[int]]]) -> list[list[int] | None]:
    """For each level, the index of each item's parent one level up (``None`` at the top)."""
    result: list[list[int] | None] = []
    for r, level in enumerate(topology):
        if r + 1 == len(topology):
            result.append(None)
            continue
        parent = [-1] * len(level)
        for p, children in enumerate(topology[r + 1]):
            for c in children:
                parent[c] = p
        result.append(parent)
    return result


#: Why :func:`build_upper_levels` stopped growing.
STOP_REASONS = ("max_depth", "upper_level_collapsed", "single_item")


def build_upper_levels(
    level0: Sequence[Sequence[int]],
    head_features: torch.Tensor,
    *,
    num_levels: int,
    branching: Sequence[int],
    threshold: float,
    penalty: float,
    eps: float,
    keep_collapsed_top: bool = False,
    passthrough: bool = False,
) -> Topology:
    """Grow the hierarchy above ``level0``; see :func:`grow_upper_levels` for the rules."""
    return grow_upper_levels(
        level0,
        head_features,
        num_levels=num_levels,
        branching=branching,
        threshold=threshold,
        penalty=penalty,
        eps=eps,
        keep_collapsed_top=keep_collapsed_top,
        passthrough=passthrough,
    )[0]


def grow_upper_levels(
    level0: Sequence[Sequence[int]],
    head_features: torch.Tensor,
    *,
    num_levels: int,
    branching: Sequence[int],
    threshold: float,
    penalty: float,
    eps: float,
    keep_collapsed_top: bool = False,
    passthrough: bool = False,
) -> tuple[Topology, str]:
    """The hierarchy above ``level0`` and why growth stopped (one of :data:`STOP_REASONS`).

    Level ``r >= 1`` merges items of level ``r - 1`` with at most
    ``branching[r]`` children each (the last entry repeats). Growth stops at
    ``num_levels`` levels (``max_depth``), when the top level already is a
    single item (``single_item``), or when a merge would leave one item
    (``upper_level_collapsed``): that level is then dropped, as in the
    reference implementation, unless ``keep_collapsed_top`` keeps it. With
    ``passthrough`` every upper level copies the one below item for item.
    """
    topology: list[Level] = [tuple(tuple(g) for g in level0)]
    while True:
        if len(topology) >= num_levels:
            return tuple(topology), "max_depth"
        if len(topology[-1]) <= 1:
            return tuple(topology), "single_item"
        if passthrough:
            parents = [[i] for i in range(len(topology[-1]))]
        else:
            feats = level_features(topology, head_features)[-1]
            b = branching[min(len(topology), len(branching) - 1)]
            parents = merge_level(feats, threshold, penalty, eps, b)
        if len(parents) == 1 and not keep_collapsed_top:
            return tuple(topology), "upper_level_collapsed"
        topology.append(tuple(tuple(p) for p in parents))


def topology_to_tensor(topology: Topology, num_heads: int, max_levels: int) -> torch.Tensor:
    """Encode as (max_levels, H): the item index of every head at every level, -1 where unused."""
    out = torch.full((max_levels, num_heads), -1, dtype=torch.long)
    item_of_head = list(range(num_heads))
    for r, level in enumerate(topology):
        owner = {}
        for i, children in enumerate(level):
            for c in children:
                owner[c] = i
        item_of_head = [owner[x] for x in item_of_head]
        out[r] = torch.tensor(item_of_head)
    return out


def topology_from_tensor(encoded: torch.Tensor) -> Topology:
    """Inverse of :func:`topology_to_tensor`."""
    levels: list[Level] = []
    below = list(range(encoded.shape[1]))  # item index of each head one level below
    for row in encoded.tolist():
        if row[0] < 0:
            break
        n_items = max(row) + 1
        children: list[list[int]] = [[] for _ in range(n_items)]
        for head, item in enumerate(row):
            child = below[head]
            if child not in children[item]:
                children[item].append(child)
        levels.append(tuple(tuple(sorted(c)) for c in children))
        below = row
    return tuple(levels)
