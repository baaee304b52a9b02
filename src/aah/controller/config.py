"""Typed settings of the AAH-v3 controller (paper sections 5.3-5.8, 7.1).

One frozen dataclass holds every knob the paper and its ablations name; the
named presets live in :mod:`aah.regimes`. Defaults run the paper as written:
its stated values (control interval 5, feature EMA 0.9, resolution EMA 0.15,
lambda 16, eps 1e-6: sections 5.3, 5.4, 5.8, 7.1), and the reference
implementation's values where the paper is silent (thresholds 0.72 / 0.76,
scorer hidden widths 16 / 64, the 100-step control warm-up, max depth 4, the
``upper_level_collapsed`` stop). Each of our departures is a field whose
default is off; the ``*_plus`` regimes switch them on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = [
    "ControllerConfig", "DIAGNOSTIC_CONTEXTS", "GROUPINGS", "TOPOLOGIES", "SCORINGS", "UPPER_LEVELS", "BUDGET_SCORINGS", "BUDGET_SCOPES",
    "LAYER_HEAD_SCORINGS",
    "WINDOW_GRANULARITIES", "WARMUP_TRIGGERS",
]

#: How level-0 items are formed: cosine clustering of head features (5.4),
#: one item per head (Grouping off), or a fixed seeded random bipartition.
GROUPINGS = ("feature", "per_head", "random")
#: When the hierarchy is rebuilt: every control update; once (first build);
#: level 0 once with upper levels recomputed; observed during warmup then frozen.
TOPOLOGIES = ("adaptive", "frozen", "reuse_level0", "freeze_after_warmup")
#: How windows are chosen: base scorer with joint sibling replacement (5.6),
#: base scorer only, a deterministic entropy/usage rule, one fixed window, or
#: no control at all (windows stay at the full-window start).
SCORINGS = ("joint", "independent", "simple", "fixed", "none")
#: Which attention the entropy / output-norm / usage diagnostics describe: the
#: attention as executed, each head in its own window (the paper's "most recent
#: stored attention statistics", 5.3), or full causal context (ours).
DIAGNOSTIC_CONTEXTS = ("executed", "full")
#: How levels above level 0 are built: merged by the ``cosine_normdiff``
#: similarity (5.4), or pass-through copies of level 0, one single-child parent
#: per item (the reference's freeze-after-warmup reading).
UPPER_LEVELS = ("merge", "passthrough")
#: Scorings chosen by a causal-coverage budget instead of the scorers: the
#: lost-mass knapsack per head (``budgeted``), per AAH group with the parent
#: clamp (``budgeted_grouped``), and the same window for every head (``uniform``);
#: ours for the recall suite: the knapsack over each head's estimated loss cost
#: (``loss_aware``, :mod:`aah.controller.loss_aware`) and a fixed "a few heads
#: full, the rest at the smallest window" layout (``full_heads``).
BUDGET_SCORINGS = ("budgeted", "budgeted_grouped", "uniform", "loss_aware", "full_heads")
#: Budget scorings that decide per layer and per head only.
LAYER_HEAD_SCORINGS = ("loss_aware", "full_heads")
SCORINGS = SCORINGS + BUDGET_SCORINGS
#: Where the coverage budget holds: in every layer, or summed over the model.
BUDGET_SCOPES = ("layer", "model")
#: Which heads share one window: each query head its own (the paper), or the
#: query heads of one KV head under grouped-query attention (our option: the
#: group takes the largest index its heads chose, so KV memory equals ACR).
WINDOW_GRANULARITIES = ("head", "kv_group")
#: When the control warm-up ends: after ``control_warmup`` steps (the reference), or
#: (ours, ``loss_aware`` only) once the estimated loss cost of cutting some head's far
#: context reaches ``far_cost_threshold`` (:mod:`aah.controller.warmup`).
WARMUP_TRIGGERS = ("steps", "far_cost")


@dataclass(frozen=True)
class ControllerConfig:
    """Settings of one layer's head controller.

    ``windows`` is the ascending candidate list; ``None`` means the paper's
    ladder ``T/8, T/4, T/2, T`` of the model's maximum length.
    """

    enabled: bool = True
    windows: tuple[int, ...] | None = None
    min_window: int | None = None  # W_min of the execution clamp (5.8); None = smallest candidate
    control_interval: int = 5  # paper 5.3 / 7.1
    control_warmup: int = 100  # reference configs (the paper does not state the warm-up length)
    feature_ema: float = 0.9  # alpha (paper 5.3, 7.1): new = alpha * old + (1 - alpha) * current
    resolution_ema: float = 0.15  # beta (paper 5.8, 7.1): c = round(beta * previous + (1 - beta) * new)
    grouping: str = "feature"
    hierarchy: tuple[int, ...] = (2, 2, 2, 2)  # shape (5.4): level 0 holds at most prod(shape) groups
    max_depth: int = 4  # reference configs
    topology: str = "adaptive"
    scoring: str = "joint"
    parent_constraint: bool = True
    upper_levels: str = "merge"  # 5.4; "passthrough" is the reference's freeze-after-warmup reading
    keep_collapsed_top: bool = False  # ours when True; the reference stops (upper_level_collapsed)
    standardize_features: bool = False  # ours when True; the paper clusters the raw features (5.4)
    diagnostics_context: str = "executed"  # paper 5.3; "full" (full causal context) is ours
    level0_threshold: float = 0.72  # reference configs (the paper gives no value)
    upper_threshold: float = 0.76  # reference configs (the paper gives no value)
    norm_penalty: float = 16.0  # lambda of the cosine_normdiff similarity (paper 5.4)
    norm_eps: float = 1e-6  # epsilon of the cosine_normdiff similarity (paper 5.4)
    shuffle_post_select: bool = False
    fixed_window_index: int = 1  # used by scoring="fixed": 1 = T/4 on the paper ladder (Table 5: fixed 1024)
    diagnostic_queries: int = 32  # ours: the paper does not say how diagnostics are sampled
    base_hidden: int = 16  # reference configs: base scorer 29 -> 16 -> K
    joint_hidden: int = 64  # reference configs: joint scorer 116 -> 64 -> 2K
    seed: int = 0
    # Budgeted policies (docs/controller.md, "Budgeted windows").
    budget: float | None = None  # target causal coverage in (0, 1]
    budget_scope: str = "layer"
    uniform_exact: bool = False
    lost_mass_ema: float = 0.9  # EMA of the lost-mass table over control updates
    window_granularity: str = "head"
    # Warm-up trigger (docs/controller.md, "Warm-up until far context matters").
    warmup_trigger: str = "steps"  # the reference: a fixed warm-up; "far_cost" is ours
    far_cost_threshold: float = 0.15  # nats per token; 3x the pre-lookup far cost of recall seed 3
    far_cost_patience: int = 0  # steps the far cost must stay >= the threshold; 0 = the first crossing
    warmup_max_steps: int | None = None  # far_cost: the warm-up ends here at the latest; None = no cap

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def fail(name: str, message: str) -> None:
            raise ValueError(f"controller.{name}: {message}")

        if self.windows is not None:
            wins = tuple(self.windows)
            if not wins or any(isinstance(w, bool) or not isinstance(w, int) or w <= 0 for w in wins):
                fail("windows", f"must be a non-empty list of positive ints, got {list(wins)}")
            if any(b <= a for a, b in zip(wins, wins[1:])):
                fail("windows", f"must be strictly ascending, got {list(wins)}")
            object.__setattr__(self, "windows", wins)
        if self.min_window is not None and self.min_window < 1:
            fail("min_window", f"must be >= 1 or null, got {self.min_window}")
        for name, least in (
            ("control_interval", 1), ("control_warmup", 0), ("max_depth", 1), ("fixed_window_index", 0),
            ("diagnostic_queries", 1), ("base_hidden", 1), ("joint_hidden", 1),
        ):
            if getattr(self, name) < least:
                fail(name, f"must be >= {least}, got {getattr(self, name)}")
        for name in ("feature_ema", "resolution_ema", "lost_mass_ema"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                fail(name, f"must be in [0, 1), got {value}")
        for name, allowed in (
            ("grouping", GROUPINGS),
            ("topology", TOPOLOGIES),
            ("scoring", SCORINGS),
            ("upper_levels", UPPER_LEVELS),
            ("diagnostics_context", DIAGNOSTIC_CONTEXTS),
            ("window_granularity", WINDOW_GRANULARITIES),
            ("budget_scope", BUDGET_SCOPES),
        ):
            if getattr(self, name) not in allowed:
                fail(name, f"must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        shape = tuple(self.hierarchy)
        if not shape or any(isinstance(b, bool) or not isinstance(b, int) or b < 2 for b in shape):
            fail("hierarchy", f"must be a non-empty list of branching factors >= 2, got {list(shape)}")
        object.__setattr__(self, "hierarchy", shape)
        if self.norm_eps <= 0:
            fail("norm_eps", f"must be > 0, got {self.norm_eps}")
        self._validate_budget(fail)

    def _validate_budget(self, fail) -> None:
        if self.budget is not None and (
            isinstance(self.budget, bool) or not isinstance(self.budget, (int, float))
            or not 0.0 < float(self.budget) <= 1.0
        ):
            fail("budget", f"must be a causal coverage in (0, 1], got {self.budget!r}")
        self._validate_warmup(fail)

    def _validate_warmup(self, fail) -> None:
        if self.warmup_trigger not in WARMUP_TRIGGERS:
            fail("warmup_trigger", f"must be one of {', '.join(WARMUP_TRIGGERS)}; got {self.warmup_trigger!r}")
        if self.warmup_trigger == "far_cost" and self.scoring != "loss_aware":
            fail("warmup_trigger", f"far_cost reads the loss cost table of scoring loss_aware; scoring is {self.scoring!r}")
        if isinstance(self.far_cost_threshold, bool) or not isinstance(self.far_cost_threshold, (int, float)) \
                or not self.far_cost_threshold > 0:
            fail("far_cost_threshold", f"must be a loss in nats per token > 0, got {self.far_cost_threshold!r}")
        patience = self.far_cost_patience
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            fail("far_cost_patience", f"must be an int >= 0 (steps), got {patience!r}")
        cap = self.warmup_max_steps
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < self.control_warmup):
            fail("warmup_max_steps", f"must be null or an int >= control_warmup ({self.control_warmup}), got {cap!r}")

    @property
    def num_levels(self) -> int:
        """Levels the hierarchy may grow to: the shape's length, capped by ``max_depth``."""
        if self.grouping == "per_head":
            return 1
        return min(len(self.hierarchy), self.max_depth)

    @property
    def max_level0_groups(self) -> int | None:
        """Most level-0 groups the shape allows: the product of its used entries (paper 5.4).

        A shape ``[b_0, ..., b_{R-1}]`` is a tree read from the top: the
        heads are split into ``b_0`` top-level items and every level-``r``
        item (``r >= 1``) has at most ``b_r`` children, so level 0 holds at
        most ``b_0 * ... * b_{R-1}`` groups: 2 for ``[2]`` ("one binary split
        from heads into two level-0 groups"), 16 for ``[2, 2, 2, 2]``. None
        for ``per_head`` grouping, where every head is its own item.
        """
        if self.grouping == "per_head":
            return None
        return math.prod(self.hierarchy[: self.num_levels])

    def replace(self, **changes) -> ControllerConfig:
        """A copy with ``changes``; unknown names raise ``ValueError`` listing the known ones."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(
                f"unknown controller setting(s) {unknown}; known: {', '.join(sorted(known))}"
            )
        return dataclasses.replace(self, **changes)
