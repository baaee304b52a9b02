"""The budgeted policy's knapsack solver against brute force, and its budget checks."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from aah.controller.budget import (
    budget_capacity,
    check_budget,
    choose_windows,
    min_budget,
    solve_knapsack,
    uniform_choice,
    window_costs,
)
from aah.windows import causal_coverage


def brute_force(lost, costs, capacity, allowed=None):
    n, k = lost.shape
    best = None
    for choice in itertools.product(range(k), repeat=n):
        if allowed is not None and not all(allowed[i, c] for i, c in enumerate(choice)):
            continue
        cost = sum(costs[i, c] for i, c in enumerate(choice))
        if cost > capacity:
            continue
        loss = sum(lost[i, c] for i, c in enumerate(choice))
        if best is None or loss < best[0] - 1e-12:
            best = (loss, cost)
    return best


@pytest.mark.parametrize("trial", range(60))
def test_solver_matches_brute_force(trial):
    rng = np.random.default_rng(trial)
    n = int(rng.integers(1, 7))
    k = int(rng.integers(1, 5))
    # Shared per-head costs (as in the policy) half the time, arbitrary item costs otherwise.
    if trial % 2:
        costs = np.tile(np.sort(rng.integers(1, 40, size=k)), (n, 1))
    else:
        costs = rng.integers(0, 40, size=(n, k))
    lost = rng.random((n, k)).round(int(rng.integers(1, 4)))  # rounding makes ties common
    allowed = rng.random((n, k)) < 0.7 if trial % 3 == 0 else None
    if allowed is not None:
        allowed[np.arange(n), rng.integers(0, k, size=n)] = True
    cheapest = np.where(allowed if allowed is not None else True, costs, 10**9).min(axis=1).sum()
    capacity = int(cheapest + rng.integers(0, costs.sum() + 1))
    expected = brute_force(lost, costs, capacity, allowed)
    choice = solve_knapsack(lost, costs, capacity, allowed)
    cost = sum(costs[i, c] for i, c in enumerate(choice))
    loss = sum(lost[i, c] for i, c in enumerate(choice))
    assert cost <= capacity
    if allowed is not None:
        assert all(allowed[i, c] for i, c in enumerate(choice))
    assert loss == pytest.approx(expected[0], abs=1e-9)


def test_solver_hand_example():
    # Two heads, windows (small, large) cost (1, 3); capacity 4 allows one large window.
    # Head 1 loses more at the small window, so it gets the large one.
    lost = np.array([[0.2, 0.0], [0.5, 0.0]])
    costs = np.array([[1, 3], [1, 3]])
    assert solve_knapsack(lost, costs, 4) == [0, 1]
    assert solve_knapsack(lost, costs, 6) == [1, 1]
    assert solve_knapsack(lost, costs, 2) == [0, 0]
    # Equal loss: the cheaper choice wins.
    assert solve_knapsack(np.zeros((2, 2)), costs, 6) == [0, 0]


def test_solver_infeasible_and_bad_input():
    with pytest.raises(ValueError, match="capacity 1"):
        solve_knapsack(np.zeros((2, 2)), np.ones((2, 2), dtype=int), 1)
    with pytest.raises(ValueError, match="non-negative integers"):
        solve_knapsack(np.zeros((1, 2)), np.array([[0.5, 1.0]]), 3)
    with pytest.raises(ValueError, match="no allowed window"):
        solve_knapsack(np.zeros((1, 2)), np.ones((1, 2)), 3, allowed=np.zeros((1, 2), dtype=bool))


def test_solver_scales_to_a_model():
    # 64 items (a model-wide scope), 4 windows, ladder costs: still exact and quick.
    rng = random.Random(0)
    costs = window_costs([128, 256, 512, 1024], 1024)
    lost = np.array([sorted((rng.random() for _ in range(3)), reverse=True) + [0.0] for _ in range(64)])
    choice = choose_windows(lost, costs, 0.45, 1024)
    windows = [[128, 256, 512, 1024][c] for c in choice]
    assert causal_coverage(windows, 1024) <= 0.45
    # Exactness on the relaxation: no single swap to a larger window fits and helps.
    used = sum(costs[c] for c in choice)
    cap = budget_capacity(0.45, 64, 1024)
    for i, c in enumerate(choice):
        for d in range(c + 1, 4):
            if used - costs[c] + costs[d] <= cap:
                assert lost[i, d] >= lost[i, c] - 1e-12


def test_choose_windows_respects_coverage_with_groups():
    costs = window_costs([2, 4, 8], 8)
    lost = np.array([[0.9, 0.5, 0.0], [0.1, 0.05, 0.0]])
    sizes = [3, 1]
    choice = choose_windows(lost, costs, 0.6, 8, sizes=sizes)
    windows = [[2, 4, 8][choice[0]]] * 3 + [[2, 4, 8][choice[1]]]
    assert causal_coverage(windows, 8) <= 0.6
    expected = brute_force(lost, np.array(sizes)[:, None] * np.array(costs)[None, :], budget_capacity(0.6, 4, 8))
    assert lost[0, choice[0]] + lost[1, choice[1]] == pytest.approx(expected[0])


def test_costs_and_capacity_are_causal_coverage():
    t = 1024
    cands = [128, 256, 512, 1024]
    full = t * (t + 1) // 2
    for w, c in zip(cands, window_costs(cands, t)):
        assert c / full == pytest.approx(causal_coverage([w], t))
    # min_window clamps the candidate before costing.
    assert window_costs(cands, t, min_window=200)[0] == window_costs([200], t)[0]
    assert budget_capacity(0.45, 8, t) == (9 * 8 * full) // 20  # the decimal 0.45, exactly
    assert budget_capacity(1.0, 8, t) == 8 * full
    assert min_budget(cands, t) == pytest.approx(causal_coverage([128], t))


def test_check_budget_names_both_numbers():
    cands = [128, 256, 512, 1024]
    floor = min_budget(cands, 1024)
    assert check_budget(floor, cands, 1024) == pytest.approx(floor)
    with pytest.raises(ValueError, match=r"0\.2 is below the causal coverage 0\.2343 of the smallest window 128"):
        check_budget(0.2, cands, 1024)
    for bad in (0.0, -0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            check_budget(bad, cands, 1024)
    with pytest.raises(ValueError, match="none is set"):
        check_budget(None, cands, 1024)


def test_uniform_choice_largest_within_budget_and_exact_mix():
    t, cands = 1024, [128, 256, 512, 1024]
    costs = window_costs(cands, t)
    # 0.45 lies between T/4 (0.437) and T/2 (0.750): uniform T/4.
    assert uniform_choice(costs, 0.45, 8, t) == [1] * 8
    assert uniform_choice(costs, 1.0, 8, t) == [3] * 8
    # Exact mixing: the largest number of heads on T/2 that keeps the coverage within the budget.
    budget = 0.6
    mixed = uniform_choice(costs, budget, 8, t, exact=True)
    windows = [cands[c] for c in mixed]
    assert causal_coverage(windows, t) <= budget
    upgraded = sum(c == 2 for c in mixed)
    assert mixed == [2] * upgraded + [1] * (8 - upgraded)
    one_more = [512] * (upgraded + 1) + [256] * (8 - upgraded - 1)
    assert causal_coverage(one_more, t) > budget
    with pytest.raises(ValueError, match="below"):
        uniform_choice(costs, 0.1, 8, t)


@pytest.mark.parametrize("trial", range(30))
def test_solver_returns_the_cheapest_optimum(trial):
    # Small integer losses: exact in floating point, so ties between optima are real ties.
    rng = np.random.default_rng(100 + trial)
    n, k = int(rng.integers(1, 6)), int(rng.integers(2, 5))
    costs = rng.integers(0, 20, size=(n, k))
    lost = rng.integers(0, 3, size=(n, k)).astype(float)
    capacity = int(costs.min(axis=1).sum() + rng.integers(0, costs.sum() + 1))
    feasible = [
        (sum(lost[i, c] for i, c in enumerate(ch)), sum(costs[i, c] for i, c in enumerate(ch)))
        for ch in itertools.product(range(k), repeat=n)
        if sum(costs[i, c] for i, c in enumerate(ch)) <= capacity
    ]
    best_loss = min(loss for loss, _ in feasible)
    cheapest = min(cost for loss, cost in feasible if loss == best_loss)
    choice = solve_knapsack(lost, costs, capacity)
    assert sum(lost[i, c] for i, c in enumerate(choice)) == best_loss
    assert sum(costs[i, c] for i, c in enumerate(choice)) == cheapest
