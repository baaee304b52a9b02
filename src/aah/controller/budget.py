"""The budgeted window choice: a multiple-choice knapsack, solved exactly.

Every item (a head, a KV group, or an AAH group of heads) takes exactly one
candidate window ``k``. Taking ``k`` costs ``costs[i, k]`` allowed
(query, key) pairs and loses ``lost[i, k]`` attention mass (the mass the
item's heads put on keys at distance ``>= W_k``, see
:mod:`aah.controller.lost_mass`). The policy minimises the summed lost mass
subject to the summed cost staying within a capacity that the coverage budget
``b`` fixes: ``sum cost <= b * (number of heads) * T (T + 1) / 2``, i.e. the
causal coverage of :func:`aah.windows.causal_coverage` is at most ``b``.

The solver is exact: a dynamic programme over the Pareto frontier of
(total cost, total lost mass) of the items decided so far. Costs are integer
pair counts, so no discretisation is needed; a state is dropped only when
another state is at most as expensive and loses strictly less, which cannot
remove an optimum. With a handful of candidate windows and identical
per-head costs the frontier stays small (at most the number of distinct
cost sums).

Everything here is a pure function of (lost-mass table, costs, budget): it
knows nothing of models, so the same policy can calibrate any attention
model whose lost masses were measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import numpy as np

__all__ = [
    "solve_knapsack",
    "window_costs",
    "budget_capacity",
    "min_budget",
    "check_budget",
    "choose_windows",
    "uniform_choice",
    "full_heads_choice",
]


def _as_float_matrix(values, name: str) -> np.ndarray:
    arr = np.asarray(values.detach().cpu().numpy() if hasattr(values, "detach") else values, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{name} must be a non-empty (items, windows) matrix, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite")
    return arr


def solve_knapsack(
    lost,
    costs,
    capacity: int,
    allowed=None,
) -> list[int]:
    """The choice per item minimising ``sum lost[i, c_i]`` with ``sum costs[i, c_i] <= capacity``.

    ``lost`` is an (n, K) float matrix, ``costs`` an (n, K) matrix of
    non-negative integers, ``allowed`` an optional (n, K) boolean mask of the
    choices each item may take (the parent clamp of the grouped policy).
    Among optima the cheapest is returned; remaining ties go to the choice
    found first (smaller indices of earlier items), so the result is
    deterministic. Raises ``ValueError`` when no choice fits the capacity.
    """
    lost_m = _as_float_matrix(lost, "lost")
    cost_f = _as_float_matrix(costs, "costs")
    if cost_f.shape != lost_m.shape:
        raise ValueError(f"costs has shape {cost_f.shape} but lost has shape {lost_m.shape}")
    if np.any(cost_f < 0) or np.any(cost_f != np.round(cost_f)):
        raise ValueError("costs must be non-negative integers (pair counts)")
    cost_m = cost_f.astype(np.int64)
    n, k = lost_m.shape
    if allowed is None:
        mask = np.ones((n, k), dtype=bool)
    else:
        mask = np.asarray(allowed.cpu().numpy() if hasattr(allowed, "cpu") else allowed, dtype=bool)
        if mask.shape != (n, k):
            raise ValueError(f"allowed has shape {mask.shape}, expected {(n, k)}")
        empty = np.flatnonzero(~mask.any(axis=1))
        if empty.size:
            raise ValueError(f"items {empty.tolist()} have no allowed window")
    capacity = int(capacity)
    cheapest = int(np.where(mask, cost_m, np.iinfo(np.int64).max).min(axis=1).sum())
    if cheapest > capacity:
        raise ValueError(f"no window choice fits the capacity {capacity}; the cheapest costs {cheapest}")

    state_cost = np.zeros(1, dtype=np.int64)
    state_lost = np.zeros(1, dtype=np.float64)
    back: list[tuple[np.ndarray, np.ndarray]] = []  # per item: (parent state, choice) of each state
    for i in range(n):
        cand_cost = (state_cost[:, None] + cost_m[i][None, :]).ravel()
        cand_lost = (state_lost[:, None] + lost_m[i][None, :]).ravel()
        parent = np.repeat(np.arange(state_cost.size), k)
        choice = np.tile(np.arange(k), state_cost.size)
        keep = np.tile(mask[i], state_cost.size) & (cand_cost <= capacity)
        cand_cost, cand_lost, parent, choice = cand_cost[keep], cand_lost[keep], parent[keep], choice[keep]
        # Sort by cost, then lost mass, then discovery order; keep strict improvements in lost mass.
        order = np.lexsort((np.arange(cand_cost.size), cand_lost, cand_cost))
        cand_cost, cand_lost, parent, choice = cand_cost[order], cand_lost[order], parent[order], choice[order]
        best_before = np.concatenate([[np.inf], np.minimum.accumulate(cand_lost)[:-1]])
        front = cand_lost < best_before
        state_cost, state_lost = cand_cost[front], cand_lost[front]
        back.append((parent[front], choice[front]))
    # The frontier's last state loses least; it is the cheapest state that does.
    state = state_cost.size - 1
    out = [0] * n
    for i in range(n - 1, -1, -1):
        parents, choices = back[i]
        out[i] = int(choices[state])
        state = int(parents[state])
    return out


def window_costs(candidates: Sequence[int], seq_len: int, min_window: int | None = None) -> list[int]:
    """Allowed (query, key) pairs of one head per candidate at length ``seq_len``.

    Each candidate is first clamped as the controller executes it:
    ``clamp(W, W_min, T)`` (paper section 5.8).
    """
    from ..windows import causal_pairs  # local: keeps this module free of torch at import

    lo = candidates[0] if min_window is None else min_window
    return [causal_pairs(min(max(int(w), lo), seq_len), seq_len) for w in candidates]


def _fraction(budget: float) -> Fraction:
    # The budget as the decimal the user wrote (0.45 is 9/20, not the nearest binary float).
    return Fraction(repr(float(budget)))


def budget_capacity(budget: float, num_heads: int, seq_len: int) -> int:
    """Pairs allowed to ``num_heads`` heads at causal coverage ``budget``: ``floor(b H T (T + 1) / 2)``."""
    if not 0.0 < float(budget) <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    full = seq_len * (seq_len + 1) // 2
    return int(_fraction(budget) * num_heads * full)


def min_budget(candidates: Sequence[int], seq_len: int, min_window: int | None = None) -> float:
    """The causal coverage of the smallest (clamped) candidate: the least budget that is feasible."""
    full = seq_len * (seq_len + 1) // 2
    return min(window_costs(candidates, seq_len, min_window)) / full


def check_budget(
    budget: float | None, candidates: Sequence[int], seq_len: int, min_window: int | None = None,
    *, field: str = "controller.budget",
) -> float:
    """Validate ``budget`` against the candidates; returns it as a float.

    Raises ``ValueError`` naming the budget and the smallest window's coverage
    when every head at the smallest window would already exceed the budget.
    """
    if budget is None:
        raise ValueError(f"{field}: a budgeted policy needs a target causal coverage in (0, 1]; none is set")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 < float(budget) <= 1.0:
        raise ValueError(f"{field}: must be a number in (0, 1], got {budget!r}")
    cheapest = min(window_costs(candidates, seq_len, min_window))
    full = seq_len * (seq_len + 1) // 2
    # floor(b H full) >= H * cheapest  <=>  b * full >= cheapest, for every head count H.
    if _fraction(budget) * full < cheapest:
        lo = candidates[0] if min_window is None else max(candidates[0], min_window)
        raise ValueError(
            f"{field}: {float(budget):g} is below the causal coverage {cheapest / full:.4f} of the "
            f"smallest window {min(lo, seq_len)} at length {seq_len}; raise the budget to at least "
            f"{cheapest / full:.4f}"
        )
    return float(budget)


def check_budget_layout(
    scoring: str, budget_scope: str, window_granularity: str, num_heads: int, num_kv_heads: int,
    *, prefix: str = "controller",
) -> None:
    """Raise ``ValueError`` for settings a budgeted scoring cannot honour (``prefix``: the config section).

    ``budgeted_grouped`` solves one knapsack per layer over the paper's
    feature groups, so it takes ``budget_scope=layer`` only, and one window per
    KV group (``kv_group`` with fewer KV heads than heads) would cut across those
    groups.
    """
    if scoring in ("loss_aware", "full_heads"):
        if budget_scope != "layer":
            raise ValueError(f"{prefix}.budget_scope: {scoring} decides per layer, so it takes layer; got {budget_scope!r}")
        if window_granularity != "head":
            raise ValueError(
                f"{prefix}.window_granularity: {scoring} gives each query head its own window, so it takes head; "
                f"got {window_granularity!r}"
            )
        return
    if scoring != "budgeted_grouped":
        return
    if budget_scope != "layer":
        raise ValueError(
            f"{prefix}.budget_scope: budgeted_grouped decides per layer, so it takes layer; "
            f"got {budget_scope!r} (model scope is available with scoring budgeted)"
        )
    if window_granularity == "kv_group" and num_kv_heads != num_heads:
        raise ValueError(
            f"{prefix}.window_granularity: budgeted_grouped groups heads by their features, so it takes "
            f"head with grouped-query attention ({num_heads} heads, {num_kv_heads} KV heads); "
            "kv_group is available with scoring budgeted or uniform"
        )


def choose_windows(
    lost,
    costs: Sequence[int],
    budget: float,
    seq_len: int,
    *,
    sizes: Sequence[int] | None = None,
    allowed=None,
    total_heads: int | None = None,
) -> list[int]:
    """Candidate index per item for causal coverage at most ``budget``.

    ``lost`` is (items, K): the lost mass of each item (summed over its heads)
    at each candidate; ``costs`` the per-head pair count of each candidate
    (:func:`window_costs`), one list for every item or one row per item (items
    whose heads execute a candidate differently, e.g. in a layer with its own
    sliding window); ``sizes`` the heads per item (default 1). The capacity
    counts ``total_heads`` heads (default: the sum of ``sizes``).
    """
    lost_m = _as_float_matrix(lost, "lost")
    n, k = lost_m.shape
    per_head = np.asarray(costs, dtype=np.int64)
    if per_head.ndim == 1:
        per_head = np.broadcast_to(per_head, (n, per_head.size))
    if per_head.shape != (n, k):
        raise ValueError(f"costs must have {k} entries (or {n} rows of {k}), got shape {per_head.shape}")
    sizes = [1] * n if sizes is None else [int(s) for s in sizes]
    if len(sizes) != n or any(s < 1 for s in sizes):
        raise ValueError(f"sizes must be {n} positive head counts, got {sizes}")
    cost_m = np.asarray(sizes, dtype=np.int64)[:, None] * per_head
    heads = sum(sizes) if total_heads is None else total_heads
    return solve_knapsack(lost_m, cost_m, budget_capacity(budget, heads, seq_len), allowed)


def uniform_choice(
    costs: Sequence[int], budget: float, num_items: int, seq_len: int, *, exact: bool = False,
    item_size: int = 1,
) -> list[int]:
    """The ``uniform_window`` baseline: candidate index per item.

    Every item takes the largest candidate whose coverage is within the budget.
    With ``exact`` the budget is matched as closely as the items allow by
    mixing two adjacent candidates: the largest number ``m`` of items that can
    take the next larger candidate without exceeding the budget does so, and
    those are the first ``m`` items (lowest head or KV-group indices).
    """
    capacity = budget_capacity(budget, num_items * item_size, seq_len)
    per_item = [c * item_size for c in costs]
    fitting = [i for i, c in enumerate(per_item) if c * num_items <= capacity]
    if not fitting:
        raise ValueError(f"budget {budget:g} is below the coverage of the smallest window")
    base = max(fitting)
    choice = [base] * num_items
    if exact and base + 1 < len(per_item):
        step = per_item[base + 1] - per_item[base]
        spare = capacity - per_item[base] * num_items
        upgraded = min(num_items, spare // step) if step > 0 else 0
        for i in range(upgraded):
            choice[i] = base + 1
    return choice


def full_heads_choice(costs: Sequence[int], budget: float, num_heads: int, seq_len: int) -> list[int]:
    """The fixed "a few heads full, the rest short" layout (DuoAttention's shape): candidate index per head.

    Greedy in head order: each head takes the largest candidate that the budget allows
    with every later head at the smallest one, so the first ``m`` heads are full (``m``
    the most the budget allows), capacity left over raises the next head as far as it
    fits, and the rest take the smallest candidate. Raises ``ValueError`` when even every head
    at the smallest candidate exceeds the budget.
    """
    capacity = budget_capacity(budget, num_heads, seq_len)
    used = costs[0] * num_heads
    if used > capacity:
        raise ValueError(f"budget {budget:g} is below the coverage of the smallest window")
    choice = [0] * num_heads
    for h in range(num_heads):  # in head order: each head the largest candidate the rest leaves room for
        fits = [c for c in range(len(costs)) if used - costs[0] + costs[c] <= capacity]
        choice[h] = max(fits)
        used += costs[choice[h]] - costs[0]
    return choice
