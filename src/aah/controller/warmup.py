"""Warm-up until far context matters: the ``far_cost`` trigger of the control warm-up (ours).

The paper does not state a warm-up; the reference waits a fixed number of steps
(``control_warmup``) before the first window decision. A loss-aware policy that
decides before the model has learnt to use far context sees no cost in cutting
it, and the cut then keeps the model from ever learning it: on the recall suite
the 3,000-step warm-up ended before full attention's lookup had formed on one
seed in three, and that seed lost its recall (docs/results.md, "Recall suite").

With ``warmup_trigger="far_cost"`` the windows stay full and the loss cost table
of :mod:`.loss_aware` is measured on the control grid from ``control_warmup`` on.
The *far cost* of a layer is its largest head cost at the second-largest
candidate (``T/2`` on the paper's ladder): what the estimate says one head would
add to the loss per predicted token if it lost the far half of its context. The
warm-up of every layer ends together, at the first grid step where the largest
far cost of the model reaches ``far_cost_threshold``, or at ``warmup_max_steps``
(when set), whichever comes first; control updates run from that step on. The
far cost is averaged over ranks first, so every rank ends it at the same step.

``far_cost_patience`` asks the far cost to stay at or above the threshold for that
many steps of the grid before the warm-up ends. The cost table is an EMA of
one-batch estimates, and one batch can spike it past the threshold before any
lookup has formed: on recall seed 1 a single spike (0.085 to 0.214 nats/token in
one grid step, back below 0.1 40 steps later) ended the warm-up at step 3,680,
long before full attention's lookup forms on that seed (between steps 4,500 and 4,750), and
the run never learnt recall. A lookup forming raises the cost and keeps it up.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .controller import HeadController
from .ranks import mean_over_ranks

__all__ = ["far_cost", "settle_warmup"]


def far_cost(ctrl: HeadController) -> float:
    """The layer's largest head cost of losing the far half of its context (0.0 before a measurement)."""
    if not bool(ctrl.loss_cost_ready) or ctrl.num_windows < 2:
        return 0.0
    return float(ctrl.loss_cost[:, -2].max())


def _waiting(controllers: Sequence[HeadController]) -> list[HeadController]:
    return [c for c in controllers if c.config.warmup_trigger == "far_cost" and c.warmup_steps is None]


def _held_long_enough(waiting: Sequence[HeadController], step: int, threshold: float, patience: int) -> bool:
    """Track the run of grid steps whose far cost is at or above ``threshold``; True once it has
    lasted ``patience`` steps (at once for patience 0)."""
    costs = torch.tensor([far_cost(c) for c in waiting], dtype=torch.float64)
    above = float(mean_over_ranks(costs).max()) >= threshold
    since = int(waiting[0].far_cost_since)
    since = (step if since < 0 else since) if above else -1
    for ctrl in waiting:
        ctrl.far_cost_since.fill_(since)
    return above and step - since >= patience


def settle_warmup(controllers: Sequence[HeadController], step: int) -> int | None:
    """End the far-cost warm-up of all ``controllers`` at ``step`` when it is due; returns the step or None.

    Called with the optimizer step before its forward (``GPT.set_step``), so the
    check reads the costs measured by earlier steps' backward passes.
    """
    waiting = _waiting(controllers)
    if not waiting:
        return None
    cfg = waiting[0].config
    capped = cfg.warmup_max_steps is not None and step >= cfg.warmup_max_steps
    on_grid = step >= cfg.control_warmup and (step - cfg.control_warmup) % cfg.control_interval == 0
    if not (capped or on_grid):
        return None
    if not capped and not _held_long_enough(waiting, step, cfg.far_cost_threshold, cfg.far_cost_patience):
        return None
    for ctrl in waiting:
        ctrl.end_warmup(step)
    return step
