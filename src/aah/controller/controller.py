"""The AAH-v3 head controller of one attention layer (paper sections 5.3-5.8, 7.1).

On a control step it observes the layer's q/k/v (feature EMA), builds or
reuses the head hierarchy, scores every level with the base and joint
sibling scorers, selects windows top-down with the parent clamp, maps them to
heads, smooths them with the resolution EMA and caches the execution windows.
Between control steps the cached windows are reused, and in evaluation mode
nothing is ever changed.

Scheduling follows the trainer's optimizer step (:meth:`HeadController.set_step`);
the controller never counts forwards. A control update happens at the first
forward of step ``s`` when ``s >= warmup`` and ``(s - warmup) % interval == 0``;
later forwards of the same step (gradient accumulation) reuse its decision.

All state is kept in buffers, so it is saved and loaded with the model; the
attention module registers the controller as ``aah_state``, giving state-dict
keys such as ``blocks.0.attn.aah_state.feature_ema``. Under
``torch.distributed`` the observed features are averaged over ranks, so
every rank makes the same decision.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..windows import candidate_windows
from . import budgeted, loss_aware
from .budget import check_budget, check_budget_layout
from .config import BUDGET_SCORINGS, ControllerConfig
from .features import (
    NUM_FEATURES,
    SampledScores,
    attention_diagnostics,
    qkv_moments,
    sample_scores,
    statistics_from_moments,
)
from .hierarchy import (
    Topology,
    cap_groups,
    forced_bipartition,
    grow_upper_levels,
    level0_cosine_groups,
    level_features,
    parents_of,
    random_bipartition,
    size_fractions,
    standardize,
    topology_from_tensor,
    topology_to_tensor,
)
from .lost_mass import lost_mass as measure_lost_mass
from .ranks import mean_over_ranks
from .scoring import SeededMLP, enrich, level_coordinate, score_level
from .selection import (
    execution_windows,
    map_to_heads,
    resolution_ema,
    select_top_down,
    share_within_kv_groups,
    simple_policy_index,
)

__all__ = ["HeadController", "Decision", "LevelDecision", "derive_seed"]

_ENRICHED = 3 * NUM_FEATURES + 2  # 29


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (run seed, layer, purpose...)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _generator(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


@dataclass
class LevelDecision:
    """What happened at one hierarchy level."""

    items: tuple[tuple[int, ...], ...]  # children of each item (heads at level 0)
    parents: list[int] | None  # parent item one level up; None at the top
    inputs: torch.Tensor  # enriched inputs (n, 29)
    logits: torch.Tensor  # window logits after joint replacement (n, K)
    pairs: list[tuple[int, int]]  # sibling pairs scored jointly
    raw_index: torch.Tensor  # argmax before the parent clamp (n,)
    index: torch.Tensor  # after the parent clamp (n,)


@dataclass
class Decision:
    """One control decision, every step inspectable."""

    topology: Topology
    levels: list[LevelDecision] = field(default_factory=list)
    head_index: torch.Tensor | None = None  # c_h after group-to-head mapping (and shuffle)
    smoothed_index: torch.Tensor | None = None  # c~_h after the resolution EMA
    windows: tuple[int, ...] = ()  # execution windows at the controller's max length

    @property
    def levels_used(self) -> int:
        return len(self.topology)


class HeadController(nn.Module):
    """Chooses one causal window per head for one layer."""

    def __init__(
        self,
        num_heads: int,
        config: ControllerConfig,
        *,
        max_seq_len: int,
        layer_idx: int = 0,
        num_kv_heads: int | None = None,
    ):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if self.num_kv_heads < 1 or num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({num_heads})")
        self.config = config
        self.num_heads = num_heads
        self.max_seq_len = max_seq_len
        self.layer_idx = layer_idx
        cands = tuple(config.windows) if config.windows is not None else candidate_windows(max_seq_len)
        if cands[-1] > max_seq_len:
            raise ValueError(
                f"controller.windows: largest window {cands[-1]} exceeds the model's max length {max_seq_len}"
            )
        if config.scoring == "fixed" and config.fixed_window_index >= len(cands):
            raise ValueError(
                f"controller.fixed_window_index: {config.fixed_window_index} is not an index of "
                f"the {len(cands)} candidate windows {list(cands)}"
            )
        self.candidates = cands
        self.num_windows = len(cands)
        self.min_window = config.min_window if config.min_window is not None else cands[0]
        self.max_levels = max(1, config.num_levels)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self._check_budget_settings()
        h, k = num_heads, self.num_windows

        self.register_buffer("candidate_windows", torch.tensor(cands, dtype=torch.long))
        self.register_buffer("feature_ema", torch.zeros(h, NUM_FEATURES))
        self.register_buffer("feature_ema_ready", torch.tensor(False))
        self.register_buffer("last_diagnostics", torch.zeros(h, 3))
        self.register_buffer("has_diagnostics", torch.tensor(False))
        self.register_buffer("topology", torch.full((self.max_levels, h), -1, dtype=torch.long))
        self.register_buffer("resolution_index", torch.full((h,), k - 1, dtype=torch.long))
        self.register_buffer("windows", torch.full((h,), cands[-1], dtype=torch.long))
        self.register_buffer("last_update_step", torch.tensor(-1, dtype=torch.long))
        self.register_buffer("num_updates", torch.tensor(0, dtype=torch.long))
        # Lost attention mass per head and candidate (EMA over control updates), see lost_mass.py.
        self.register_buffer("lost_mass", torch.zeros(h, k))
        self.register_buffer("lost_mass_ready", torch.tensor(False))
        if config.scoring == "loss_aware":  # only here: other regimes' checkpoints keep their keys
            # Estimated loss cost per head and candidate (EMA over control steps), see loss_aware.py.
            self.register_buffer("loss_cost", torch.zeros(h, k))
            self.register_buffer("loss_cost_ready", torch.tensor(False))
        if config.warmup_trigger == "far_cost":
            # The step the warm-up ended at, -1 while it lasts (aah.controller.warmup).
            self.register_buffer("warmup_end", torch.tensor(-1, dtype=torch.long))
            # The first grid step of the current run of far costs at or above the threshold, -1 if none.
            self.register_buffer("far_cost_since", torch.tensor(-1, dtype=torch.long))
            self.register_load_state_dict_pre_hook(_default_far_cost_since)
        self._pending_change: tuple[torch.Tensor, torch.Tensor] | None = None

        gen = _generator(config.seed, "scorers", layer_idx)
        self.base_scorer = SeededMLP((_ENRICHED, config.base_hidden, k), gen)
        self.joint_scorer = SeededMLP((4 * _ENRICHED, config.joint_hidden, 2 * k), gen)

        self.step = -1
        self._window_cache: dict[int, tuple[int, ...]] = {}
        self._last_update_step = -1
        self._has_topology = False
        self._decided = False
        self.budget_pending = False  # model-scope budget: measured this control step, awaiting the model
        self.last_decision: Decision | None = None
        self.last_stop_reason: str | None = None  # why the last hierarchy build stopped growing
        self.register_load_state_dict_post_hook(lambda module, _incompatible: module._refresh_mirrors())

    def _check_budget_settings(self) -> None:
        cfg = self.config
        if cfg.window_granularity == "kv_group" and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"controller.window_granularity: kv_group needs num_heads ({self.num_heads}) divisible "
                f"by num_kv_heads ({self.num_kv_heads})"
            )
        if cfg.scoring not in BUDGET_SCORINGS:
            return
        check_budget(cfg.budget, self.candidates, self.max_seq_len, self.min_window)
        check_budget_layout(
            cfg.scoring, cfg.budget_scope, cfg.window_granularity, self.num_heads, self.num_kv_heads
        )

    @property
    def is_decided(self) -> bool:
        """Whether a control decision (or pinned windows) has replaced the full-window start."""
        return self._decided

    # ------------------------------------------------------------------ schedule
    def set_step(self, step: int) -> None:
        """Tell the controller the current optimizer step (the trainer's job)."""
        self.step = int(step)

    def _refresh_mirrors(self) -> None:
        self._window_cache.clear()
        self._last_update_step = int(self.last_update_step)
        self._has_topology = bool(self.topology[0, 0] >= 0)
        self._decided = bool(self.num_updates > 0)

    @property
    def warmup_steps(self) -> int | None:
        """The step control updates start from: ``control_warmup``, or under the far-cost
        trigger the step it fired at (None while the warm-up lasts)."""
        if self.config.warmup_trigger == "steps":
            return self.config.control_warmup
        end = int(self.warmup_end)
        return end if end >= 0 else None

    def end_warmup(self, step: int) -> None:
        """End a far-cost warm-up at ``step`` (:func:`.warmup.settle_warmup`); control starts there."""
        self.warmup_end.fill_(int(step))

    def _on_grid(self, start: int) -> bool:
        s = self.step
        return s >= start and s != self._last_update_step and (s - start) % self.config.control_interval == 0

    def control_due(self) -> bool:
        """Whether the current step is a control-update step not yet acted on."""
        start = self.warmup_steps
        if self.config.scoring == "none" or start is None:
            return False
        return self._on_grid(start)

    def _measure_in_warmup(self) -> bool:
        """Far-cost warm-up: the control grid from ``control_warmup`` on measures the loss cost
        (windows stay full) so that the trigger can read it."""
        return self.config.warmup_trigger == "far_cost" and self.warmup_steps is None \
            and self._on_grid(self.config.control_warmup)

    def _observe_in_warmup(self) -> bool:
        cfg, s = self.config, self.step
        return (
            cfg.topology == "freeze_after_warmup"
            and 0 <= s < cfg.control_warmup
            and s != self._last_update_step
            and s % cfg.control_interval == 0
        )

    # ------------------------------------------------------------------ main entry
    def windows_for(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
        """Execution windows for this forward; runs a control update first when one is due.

        Only in training mode: evaluation never changes controller state.
        """
        if self.training:
            if self.control_due():
                self.control_update(q, k, v)
            elif self._observe_in_warmup():
                self._warmup_observation(q, k, v)
            elif self._measure_in_warmup():
                self._warmup_measurement(q, k, v)
        return self.current_windows(q.shape[2])

    def current_windows(self, seq_len: int) -> tuple[int, ...]:
        """Cached execution windows ``clamp(W[c~_h], W_min, T)`` for length ``seq_len``."""
        cached = self._window_cache.get(seq_len)
        if cached is None:
            if self._decided:
                cached = execution_windows(self.resolution_index, self.candidates, self.min_window, seq_len)
            else:  # before the first decision: ordinary full causal attention (section 5.8)
                cached = (seq_len,) * self.num_heads
            self._window_cache[seq_len] = cached
        return cached

    @torch.no_grad()
    def control_update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Decision:
        """Observe, decide and commit; then store fresh diagnostics for the next update.

        The lost-mass table is measured first (budgeted scorings decide from it). A
        model-scope budget commits nothing here: the model solves for all layers
        once every layer has measured (:func:`.budgeted.settle_model_budget`).
        The sampled scores are computed once and shared by both measurements.
        """
        sampled = self.sample_scores(q, k)
        self.record_lost_mass(q, k, sampled=sampled)
        if self.config.scoring == "loss_aware":
            self.prepare_loss_cost(q, k, v)
        if self.config.scoring == "budgeted" and self.config.budget_scope == "model":
            self.observe(q, k, v)
            self._mark_step()
            self.record_diagnostics(q, k, v, sampled=sampled)
            self.budget_pending = True
            return Decision(topology=())
        features = self.observe(q, k, v)
        decision = self.decide(features)
        self.commit(decision)
        self.record_diagnostics(q, k, v, sampled=sampled)
        return decision

    @torch.no_grad()
    def _warmup_observation(self, q, k, v) -> None:
        features = self.observe(q, k, v)
        topology = self.build_topology(features)
        self._store_topology(topology)
        self._mark_step()
        self.record_diagnostics(q, k, v)

    @torch.no_grad()
    def _warmup_measurement(self, q, k, v) -> None:
        sampled = self.sample_scores(q, k)
        self.record_lost_mass(q, k, sampled=sampled)
        self.prepare_loss_cost(q, k, v)
        self._mark_step()

    # ------------------------------------------------------------------ features
    @torch.no_grad()
    def observe(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Update the feature EMA with the current base features; returns the smoothed features."""
        stats = statistics_from_moments(mean_over_ranks(qkv_moments(q, k, v)))
        current = torch.cat([stats, self.last_diagnostics.to(stats)], dim=1).to(self.feature_ema)
        if bool(self.feature_ema_ready):
            alpha = self.config.feature_ema
            self.feature_ema.mul_(alpha).add_(current, alpha=1.0 - alpha)
        else:
            self.feature_ema.copy_(current)
            self.feature_ema_ready.fill_(True)
        return self.feature_ema.clone()

    def sample_scores(self, q: torch.Tensor, k: torch.Tensor) -> SampledScores:
        """The sampled query scores that the diagnostics and the lost mass both read (section 5.3)."""
        return sample_scores(q, k, num_queries=self.config.diagnostic_queries, start=self.candidates[0])

    @torch.no_grad()
    def record_diagnostics(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sampled: SampledScores | None = None
    ) -> None:
        """Sampled entropy / output norm / usage, kept for the next control update.

        With ``diagnostics_context="executed"`` (the paper's reading) each head
        is measured in the window it now executes; with ``"full"`` (ours)
        against full causal context.
        """
        windows = self.current_windows(q.shape[2]) if self.config.diagnostics_context == "executed" else None
        diag = attention_diagnostics(
            q, k, v, long_range=self.candidates[0], num_queries=self.config.diagnostic_queries,
            windows=windows, sampled=sampled,
        )
        self.last_diagnostics.copy_(mean_over_ranks(diag).to(self.last_diagnostics))
        self.has_diagnostics.fill_(True)

    @torch.no_grad()
    def record_lost_mass(self, q: torch.Tensor, k: torch.Tensor, *, sampled: SampledScores | None = None) -> None:
        """Measure the lost mass at every (clamped) candidate and fold it into the EMA."""
        windows = [min(max(w, self.min_window), self.max_seq_len) for w in self.candidates]
        current = measure_lost_mass(
            q, k, windows, num_queries=self.config.diagnostic_queries, start=self.candidates[0], sampled=sampled
        )
        current = mean_over_ranks(current.to(self.lost_mass))
        if bool(self.lost_mass_ready):
            alpha = self.config.lost_mass_ema
            self.lost_mass.mul_(alpha).add_(current, alpha=1.0 - alpha)
        else:
            self.lost_mass.copy_(current)
            self.lost_mass_ready.fill_(True)

    @torch.no_grad()
    def prepare_loss_cost(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Compute each head's output change under every candidate at the sampled queries; the
        gradient of this step's backward completes the measurement (:meth:`watch_output`)."""
        windows = [min(max(w, self.min_window), self.max_seq_len) for w in self.candidates]
        pos = loss_aware.sampled_positions(q.shape[2], self.config.diagnostic_queries, self.candidates[0])
        self._pending_change = (pos, loss_aware.window_output_change(q, k, v, pos, windows))

    def watch_output(self, y: torch.Tensor) -> None:
        """Called by the attention layer with its head outputs ``y`` (B, H, T, D): after a control
        step that prepared a measurement, the gradient reaching ``y`` folds its Fisher cost into
        the ``loss_cost`` EMA (``loss_aware`` scoring only)."""
        if self._pending_change is None or not y.requires_grad:
            return
        pos, change = self._pending_change
        self._pending_change = None
        tokens = y.shape[0] * y.shape[2]

        def fold(grad: torch.Tensor) -> None:
            with torch.no_grad():
                g = grad[:, :, pos.to(grad.device)].float() * tokens
                current = loss_aware.fisher_cost(g, change.to(g.device)).to(self.loss_cost)
                if bool(self.loss_cost_ready):
                    alpha = self.config.lost_mass_ema
                    self.loss_cost.mul_(alpha).add_(current, alpha=1.0 - alpha)
                else:
                    self.loss_cost.copy_(current)
                    self.loss_cost_ready.fill_(True)

        y.register_hook(fold)

    @torch.no_grad()
    def commit_budget_index(self, head_index: torch.Tensor) -> Decision:
        """Commit candidate indices chosen by a budget (used by the model-scope solve)."""
        index = head_index.long().cpu()
        decision = Decision(topology=(), head_index=index, smoothed_index=index)
        decision.windows = execution_windows(index, self.candidates, self.min_window, self.max_seq_len)
        self.commit(decision)
        self.budget_pending = False
        return decision

    # ------------------------------------------------------------------ topology
    def cached_topology(self) -> Topology | None:
        return topology_from_tensor(self.topology.cpu()) if self._has_topology else None

    def build_topology(self, features: torch.Tensor) -> Topology:
        """A fresh hierarchy from ``features`` (section 5.4), ignoring any cached one."""
        return self._grow(self._level0(features), features)

    def _level0(self, features: torch.Tensor) -> list[list[int]]:
        cfg = self.config
        if cfg.grouping == "per_head":
            return [[h] for h in range(self.num_heads)]
        if cfg.grouping == "random":
            return random_bipartition(self.num_heads, _generator(cfg.seed, "random_grouping", self.layer_idx))
        sim_feats = self._similarity_features(features)
        groups = level0_cosine_groups(sim_feats, cfg.level0_threshold)
        if len(groups) == 1 and self.num_heads > 1:
            groups = forced_bipartition(sim_feats)
        return cap_groups(groups, sim_feats, cfg.max_level0_groups)

    def _similarity_features(self, features: torch.Tensor) -> torch.Tensor:
        features = features.detach().float().cpu()
        return standardize(features) if self.config.standardize_features else features

    def _grow(self, level0, features: torch.Tensor) -> Topology:
        cfg = self.config
        # Upper levels compare raw group features: the norm-difference term is about magnitudes,
        # which standardisation would distort (standardisation serves level-0 cosine only).
        topology, self.last_stop_reason = grow_upper_levels(
            level0,
            features.detach().float().cpu(),
            num_levels=cfg.num_levels,
            branching=cfg.hierarchy,
            threshold=cfg.upper_threshold,
            penalty=cfg.norm_penalty,
            eps=cfg.norm_eps,
            keep_collapsed_top=cfg.keep_collapsed_top,
            passthrough=cfg.upper_levels == "passthrough",
        )
        return topology

    def topology_for_update(self, features: torch.Tensor) -> Topology:
        """The hierarchy a control update uses now, following the topology policy."""
        policy, cached = self.config.topology, self.cached_topology()
        if cached is not None:
            if policy == "frozen" or (policy == "freeze_after_warmup" and self.step >= self.config.control_warmup):
                return cached
            if policy == "reuse_level0":
                return self._grow([list(g) for g in cached[0]], features)
        return self.build_topology(features)

    def _store_topology(self, topology: Topology) -> None:
        self.topology.copy_(topology_to_tensor(topology, self.num_heads, self.max_levels))
        self._has_topology = True

    # ------------------------------------------------------------------ decision
    @torch.no_grad()
    def decide(self, features: torch.Tensor | None = None) -> Decision:
        """The decision the controller makes from ``features`` (default: the feature EMA).

        Pure: reads the state (cached topology, resolution EMA) but changes nothing.
        """
        cfg = self.config
        feats = (self.feature_ema if features is None else features).detach().float().cpu()
        k = self.num_windows
        if cfg.scoring in ("joint", "independent"):
            decision = self._hierarchical_decision(feats)
        elif cfg.scoring in BUDGET_SCORINGS:
            decision = self._budget_decision(feats)
        else:
            decision = Decision(topology=())
            if cfg.scoring == "fixed":
                decision.head_index = torch.full((self.num_heads,), cfg.fixed_window_index, dtype=torch.long)
            elif cfg.scoring == "simple" and bool(self.has_diagnostics):
                diag = self.last_diagnostics.float().cpu()
                decision.head_index = simple_policy_index(diag[:, 0], diag[:, 2], k)
            else:
                decision.head_index = torch.full((self.num_heads,), k - 1, dtype=torch.long)
        if cfg.shuffle_post_select:
            perm = torch.randperm(
                self.num_heads, generator=_generator(cfg.seed, "shuffle", self.layer_idx, int(self.num_updates))
            )
            decision.head_index = decision.head_index[perm]
        if cfg.scoring in BUDGET_SCORINGS:  # committed as chosen: smoothing could break the budget
            decision.smoothed_index = decision.head_index.clone()
        else:
            decision.smoothed_index = resolution_ema(
                self.resolution_index.cpu(), decision.head_index, cfg.resolution_ema, k
            )
        if cfg.window_granularity == "kv_group":
            decision.smoothed_index = share_within_kv_groups(decision.smoothed_index, self.num_kv_heads)
        decision.windows = execution_windows(decision.smoothed_index, self.candidates, self.min_window, self.max_seq_len)
        return decision

    def _hierarchical_decision(self, feats: torch.Tensor) -> Decision:
        cfg = self.config
        topology = self.topology_for_update(feats)
        num_levels = len(topology)
        item_feats = level_features(topology, feats)
        sizes = size_fractions(topology)
        parents = parents_of(topology)
        joint = self.joint_scorer if cfg.scoring == "joint" else None
        levels: list[LevelDecision] = []
        all_logits = []
        for r in range(num_levels):
            top = r == num_levels - 1
            parent_feats = None if top else item_feats[r + 1][parents[r]]
            inputs = enrich(item_feats[r], parent_feats, sizes[r], level_coordinate(r, num_levels))
            siblings = [range(len(topology[r]))] if top else topology[r + 1]
            logits, pairs = score_level(inputs, siblings, self.base_scorer, joint)
            all_logits.append(logits)
            levels.append(LevelDecision(topology[r], parents[r], inputs, logits, pairs, None, None))
        raw, clamped = select_top_down(all_logits, parents, parent_constraint=cfg.parent_constraint)
        for level, r_idx, c_idx in zip(levels, raw, clamped):
            level.raw_index, level.index = r_idx, c_idx
        head_index = map_to_heads(topology[0], clamped[0], self.num_heads)
        return Decision(topology=topology, levels=levels, head_index=head_index)

    def _budget_decision(self, feats: torch.Tensor) -> Decision:
        scoring = self.config.scoring
        if scoring == "uniform":
            return Decision(topology=(), head_index=budgeted.uniform_head_index(self))
        if scoring == "full_heads":
            return Decision(topology=(), head_index=budgeted.full_heads_head_index(self))
        if scoring == "loss_aware":
            return Decision(topology=(), head_index=budgeted.loss_aware_head_index(self))
        if scoring == "budgeted":
            if self.config.budget_scope == "model":  # decided by the model; keep the current windows
                return Decision(topology=(), head_index=self.resolution_index.cpu().clone())
            return Decision(topology=(), head_index=budgeted.budget_head_index(self))
        topology = self.topology_for_update(feats)
        return Decision(topology=topology, head_index=budgeted.grouped_budget_head_index(self, topology))

    @torch.no_grad()
    def commit(self, decision: Decision) -> None:
        """Make ``decision`` current: resolution EMA state, topology cache, windows, step."""
        if decision.topology:
            self._store_topology(decision.topology)
        self.resolution_index.copy_(decision.smoothed_index.to(self.resolution_index.device))
        self.windows.copy_(torch.tensor(decision.windows, dtype=torch.long))
        self.num_updates += 1
        self._decided = True
        self._mark_step()
        self._window_cache.clear()
        self.last_decision = decision

    @torch.no_grad()
    def pin_windows(self, windows: tuple[int, ...]) -> None:
        """Force these execution windows (each must be a candidate), e.g. for benchmarks."""
        if len(windows) != self.num_heads:
            raise ValueError(f"need {self.num_heads} windows, got {len(windows)}")
        missing = sorted(set(windows) - set(self.candidates))
        if missing:
            raise ValueError(f"windows {missing} are not candidates {list(self.candidates)}")
        index = torch.tensor([self.candidates.index(w) for w in windows], dtype=torch.long)
        self.resolution_index.copy_(index)
        self.windows.copy_(torch.tensor(windows, dtype=torch.long))
        self._decided = True
        self._window_cache.clear()

    def _mark_step(self) -> None:
        self.last_update_step.fill_(self.step)
        self._last_update_step = self.step

    # ------------------------------------------------------------------ reporting
    def levels_used(self) -> int:
        """Hierarchy levels of the current topology (0 before the first build or without one)."""
        if self.config.scoring not in ("joint", "independent", "budgeted_grouped") or not self._has_topology:
            return 0
        return int((self.topology[:, 0] >= 0).sum())

    def extra_repr(self) -> str:
        cfg = self.config
        return (
            f"heads={self.num_heads}, windows={list(self.candidates)}, grouping={cfg.grouping}, "
            f"hierarchy={list(cfg.hierarchy)}, topology={cfg.topology}, scoring={cfg.scoring}"
        )


def _default_far_cost_since(_module, state_dict, prefix, *_args) -> None:
    """Checkpoints of the far-cost warm-up made before its patience existed lack ``far_cost_since``.

    Its value there is "no run of high far costs under way" (-1): with no patience the warm-up
    ended at the first crossing, and once it has ended the buffer is never read again.
    """
    if prefix + "far_cost_since" not in state_dict:
        state_dict[prefix + "far_cost_since"] = torch.tensor(-1, dtype=torch.long)
