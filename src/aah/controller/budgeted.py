"""The budgeted window policies on a running controller.

Three scorings choose windows by a causal-coverage budget ``b`` instead of the
paper's scorers (docs/controller.md, "Budgeted windows"):

* ``budgeted``: per head (or per KV group with ``window_granularity=kv_group``)
  the windows that minimise the summed lost mass (:mod:`.lost_mass`) subject to
  causal coverage ``<= b``, solved exactly by :func:`.budget.choose_windows`;
  per layer, or for the whole model at once (``budget_scope=model``);
* ``budgeted_grouped``: the same objective decided top-down on the paper's
  AAH hierarchy (section 5.4): every level is a knapsack over its groups (lost
  mass and cost summed over each group's heads) whose choices are clamped to
  the parent's index (section 5.7), so the hierarchy is judged by what it adds;
* ``uniform``: the ``uniform_window`` baseline, every head the largest
  candidate within the budget, or two adjacent candidates mixed to match it
  (``uniform_exact``; the first heads or KV groups take the larger window).

The windows are committed as chosen (no resolution EMA: smoothing indices could
break the budget); the smoothing is the EMA of the lost-mass table. Each ``ctrl`` is a
layer's :class:`.controller.HeadController`, typed as the ``nn.Module`` it is: the
controller calls this module, which therefore does not import it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .budget import choose_windows, full_heads_choice, uniform_choice, window_costs
from .hierarchy import parents_of
from .ranks import mean_over_ranks

__all__ = [
    "budget_head_index",
    "grouped_budget_head_index",
    "uniform_head_index",
    "full_heads_head_index",
    "loss_aware_head_index",
    "settle_model_budget",
    "lost_mass_metrics",
]


def _costs(ctrl: nn.Module) -> list[int]:
    return window_costs(ctrl.candidates, ctrl.max_seq_len, ctrl.min_window)


def _items(ctrl: nn.Module) -> list[list[int]]:
    """The heads of each knapsack item: single heads, or the heads of each KV group."""
    if ctrl.config.window_granularity == "kv_group":
        per = ctrl.num_heads // ctrl.num_kv_heads
        return [list(range(g * per, (g + 1) * per)) for g in range(ctrl.num_kv_heads)]
    return [[h] for h in range(ctrl.num_heads)]


def _item_lost(lost: torch.Tensor, items: Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.stack([lost[list(heads)].double().sum(0) for heads in items])


def _to_heads(items: Sequence[Sequence[int]], choice: Sequence[int], num_heads: int) -> torch.Tensor:
    out = torch.full((num_heads,), -1, dtype=torch.long)
    for heads, c in zip(items, choice):
        out[list(heads)] = int(c)
    return out


def uniform_head_index(ctrl: nn.Module) -> torch.Tensor:
    """The ``uniform_window`` baseline's candidate index per head."""
    items = _items(ctrl)
    size = len(items[0])
    choice = uniform_choice(
        _costs(ctrl), ctrl.config.budget, len(items), ctrl.max_seq_len,
        exact=ctrl.config.uniform_exact, item_size=size,
    )
    return _to_heads(items, choice, ctrl.num_heads)


def full_heads_head_index(ctrl: nn.Module) -> torch.Tensor:
    """The fixed ``full_heads`` layout: the first heads full, the rest at the smallest window."""
    choice = full_heads_choice(_costs(ctrl), ctrl.config.budget, ctrl.num_heads, ctrl.max_seq_len)
    return torch.tensor(choice, dtype=torch.long)


def loss_aware_head_index(ctrl: nn.Module) -> torch.Tensor:
    """``loss_aware``: the knapsack over each head's estimated loss cost (:mod:`.loss_aware`).

    The table is averaged over ranks here, so every rank decides the same windows; before
    the first measurement the budget is split uniformly.
    """
    if not bool(ctrl.loss_cost_ready):
        return uniform_head_index(ctrl)
    cost = mean_over_ranks(ctrl.loss_cost.detach().clone()).double().cpu()
    choice = choose_windows(cost, _costs(ctrl), ctrl.config.budget, ctrl.max_seq_len)
    return torch.tensor(choice, dtype=torch.long)


def budget_head_index(ctrl: nn.Module) -> torch.Tensor:
    """Layer scope: the lost-mass knapsack over this layer's heads (or KV groups)."""
    if not bool(ctrl.lost_mass_ready):
        return uniform_head_index(ctrl)  # nothing measured yet: the uniform split of the budget
    items = _items(ctrl)
    lost = _item_lost(ctrl.lost_mass.cpu(), items)
    choice = choose_windows(lost, _costs(ctrl), ctrl.config.budget, ctrl.max_seq_len,
                            sizes=[len(i) for i in items])
    return _to_heads(items, choice, ctrl.num_heads)


def _heads_per_item(topology) -> list[list[list[int]]]:
    heads = [[list(item) for item in topology[0]]]
    for level in topology[1:]:
        below = heads[-1]
        heads.append([sorted(h for child in item for h in below[child]) for item in level])
    return heads


def grouped_budget_head_index(ctrl: nn.Module, topology) -> torch.Tensor:
    """``budgeted_grouped``: a knapsack per hierarchy level, top down, clamped to the parent's index."""
    if not bool(ctrl.lost_mass_ready):
        return uniform_head_index(ctrl)
    lost = ctrl.lost_mass.cpu()
    costs = _costs(ctrl)
    k = len(costs)
    members = _heads_per_item(topology)
    parents = parents_of(topology)
    index: list[int] | None = None
    for r in range(len(topology) - 1, -1, -1):
        items = members[r]
        allowed = None
        if index is not None:
            cap = torch.tensor([index[p] for p in parents[r]])
            allowed = (torch.arange(k)[None, :] <= cap[:, None]).numpy()
        index = choose_windows(_item_lost(lost, items), costs, ctrl.config.budget, ctrl.max_seq_len,
                               sizes=[len(i) for i in items], allowed=allowed, total_heads=ctrl.num_heads)
    return _to_heads(members[0], index, ctrl.num_heads)


def settle_model_budget(controllers: Sequence[nn.Module]) -> bool:
    """Model scope: one knapsack over every layer's heads, once per control step.

    Each layer measured its lost mass during the forward of a control step and
    kept its windows; this solves for all layers together and commits the
    windows, which apply from the next forward. Returns whether it solved.
    """
    pending = [c for c in controllers if c.budget_pending]
    if not pending:
        return False
    if len(pending) != len(controllers):
        missing = [c.layer_idx for c in controllers if not c.budget_pending]
        raise RuntimeError(f"model-scope budget: layers {missing} skipped this control step")
    all_items, all_lost, owners = [], [], []
    for li, ctrl in enumerate(controllers):
        items = _items(ctrl)
        all_items.extend(items)
        all_lost.append(_item_lost(ctrl.lost_mass.cpu(), items))
        owners.extend([li] * len(items))
    first = controllers[0]
    choice = choose_windows(torch.cat(all_lost), _costs(first), first.config.budget, first.max_seq_len,
                            sizes=[len(i) for i in all_items])
    for li, ctrl in enumerate(controllers):
        mine = [(items, c) for items, c, o in zip(all_items, choice, owners) if o == li]
        ctrl.commit_budget_index(_to_heads([m[0] for m in mine], [m[1] for m in mine], ctrl.num_heads))
    return True


def lost_mass_metrics(controllers: Sequence[nn.Module]) -> dict:
    """Per-layer lost mass for the training log (empty before the first measurement).

    * ``lost_mass``: (layers, K) mean over heads of the smoothed lost mass at each candidate;
    * ``lost_mass_chosen_per_layer``: mean over heads of the lost mass at each head's current window;
    * ``lost_mass_chosen``: their mean over layers;
    * ``loss_cost`` (``loss_aware`` only): the estimated loss cost table, (layers, heads, K);
    * ``warmup_end`` (``warmup_trigger="far_cost"`` only): the step the warm-up ended at, -1 while it lasts.
    """
    ready = [c for c in controllers if bool(c.lost_mass_ready)]
    if not ready or len(ready) != len(controllers):
        return {}
    table, chosen = [], []
    for ctrl in controllers:
        lost = ctrl.lost_mass.float().cpu()
        table.append([round(float(x), 6) for x in lost.mean(0)])
        if ctrl.is_decided:
            idx = ctrl.resolution_index.cpu().clamp(0, lost.shape[1] - 1)
            chosen.append(float(lost.gather(1, idx[:, None]).mean()))
        else:
            chosen.append(0.0)  # full windows: nothing is lost
    out = {
        "lost_mass": table,
        "lost_mass_chosen_per_layer": [round(x, 6) for x in chosen],
        "lost_mass_chosen": round(sum(chosen) / len(chosen), 6),
    }
    if all(bool(getattr(c, "loss_cost_ready", False)) for c in controllers):
        # loss_aware: the estimated loss cost per head and candidate, (layers, heads, K)
        out["loss_cost"] = [[[float(f"{x:.4g}") for x in row] for row in c.loss_cost.float().cpu().tolist()]
                            for c in controllers]
    if controllers[0].config.warmup_trigger == "far_cost":
        out["warmup_end"] = int(controllers[0].warmup_end)
    return out
