"""The paper as written by default, and each of our departures as a named switch (paper 5.3-5.8).

Hierarchy shape caps (5.4), the reference's collapsed-top stop, diagnostics of the attention as
executed versus full context (5.3), pass-through upper levels, and the resolution EMA (5.8).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from aah import regimes
from aah.controller import ControllerConfig, HeadController
from aah.controller.features import attention_diagnostics, sample_query_positions
from aah.controller.hierarchy import cap_groups, level0_cosine_groups
from aah.controller.selection import resolution_ema


def controller(num_heads=4, max_seq_len=32, config=None, **overrides) -> HeadController:
    cfg = (config or ControllerConfig()).replace(**overrides)
    return HeadController(num_heads, cfg, max_seq_len=max_seq_len)


def family_features() -> torch.Tensor:
    """Six heads, three families (A, B, C, A, B, C): base 5 everywhere, +1 on the family column."""
    feats = torch.full((6, 9), 5.0)
    for h in range(6):
        feats[h, h % 3] += 1.0
    return feats


def angles(*degs: float) -> torch.Tensor:
    return torch.tensor([[math.cos(math.radians(d)), math.sin(math.radians(d))] for d in degs])


# ---------------------------------------------------------------------- hierarchy shape (5.4)


@pytest.mark.parametrize(
    "shape,max_depth,grouping,expected",
    [
        ((2,), 4, "feature", 2),  # "one binary split from heads into two level-0 groups"
        ((2, 2, 2, 2), 4, "feature", 16),  # four binary stages: 2 * 2 * 2 * 2 leaves
        ((2, 2, 2, 2), 2, "feature", 4),  # only the levels max_depth lets grow count
        ((3, 2), 4, "feature", 6),  # three top items, each with at most two children
        ((2,), 4, "random", 2),
        ((2,), 4, "per_head", None),  # grouping off: every head is its own item
    ],
)
def test_level0_cap_is_the_product_of_the_used_shape(shape, max_depth, grouping, expected):
    cfg = ControllerConfig(hierarchy=shape, max_depth=max_depth, grouping=grouping)
    assert cfg.max_level0_groups == expected


def test_cap_groups_merges_the_most_similar_centroids_by_hand():
    feats = angles(0, 50, 10, 100)
    groups = [[0], [1], [2], [3]]
    assert cap_groups(groups, feats, None) == groups
    assert cap_groups(groups, feats, 4) == groups
    # round 1: 0 and 10deg are closest (cos 10deg) -> [0, 2]
    assert cap_groups(groups, feats, 3) == [[0, 2], [1], [3]]
    # round 2: centroid of [0, 2] points at 5deg; cos 45deg (to 50) beats cos 50deg (50 to 100)
    assert cap_groups(groups, feats, 2) == [[0, 1, 2], [3]]
    assert cap_groups(groups, feats, 1) == [[0, 1, 2, 3]]
    # the order of the groups decides the sibling pairs: a merge keeps the first one's place,
    # and groups within the cap are left as they are
    assert cap_groups([[3], [1], [0, 2]], angles(0, 50, 10, 100), 2) == [[3], [0, 1, 2]]
    assert cap_groups([[1, 3], [0, 2]], angles(0, 50, 10, 100), 2) == [[1, 3], [0, 2]]


def test_shape_two_gives_two_level0_groups_with_standardised_or_raw_features():
    feats = family_features()
    # standardised, threshold clustering finds the three families ...
    std = ControllerConfig(standardize_features=True)
    assert len(controller(6, config=std).build_topology(feats)[0]) == 3  # [2,2,2,2]: cap 16
    # ... and shape [2] merges the two most similar: all three centroids are at cosine -1/2,
    # so the first pair (families A and B) merges
    shallow_std = controller(6, config=regimes.get("shallow_freeze_plus"))
    assert shallow_std.build_topology(feats) == (((0, 1, 3, 4), (2, 5)),)
    # raw features collapse (cosine ~.996) and the forced bipartition gives two groups
    shallow_raw = controller(6, config=regimes.get("shallow_freeze"))
    assert shallow_raw.build_topology(feats) == (((0, 2, 3), (1, 4, 5)),)


def _heads_qkv(seed: int, heads: int = 12, t: int = 64, d: int = 8):
    """Heads with their own scales and offsets, so standardised features tell them apart."""
    g = torch.Generator().manual_seed(seed)

    def one():
        scale = torch.rand(1, heads, 1, 1, generator=g) * 3 + 0.2
        shift = torch.randn(1, heads, 1, d, generator=g) * 2
        return torch.randn(1, heads, t, d, generator=g) * scale + shift

    return one(), one(), one()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("name", ["shallow_freeze", "shallow_freeze_plus", "fixed_random_grouping"])
def test_shallow_regimes_freeze_exactly_two_level0_groups_on_twelve_heads(seed, name):
    cfg = regimes.get(name, control_warmup=0, control_interval=1, seed=seed)
    ctrl = controller(12, max_seq_len=64, config=cfg)
    q, k, v = _heads_qkv(seed)
    ctrl.set_step(0)
    ctrl.windows_for(q, k, v)
    level0 = ctrl.cached_topology()[0]
    assert len(level0) == 2
    assert sorted(h for g in level0 for h in g) == list(range(12))
    assert ctrl.levels_used() == 1
    # the features do separate the heads: uncapped, standardised clustering finds many groups
    feats = ctrl.feature_ema.clone()
    std = (feats - feats.mean(0)) / (feats.std(0, unbiased=False) + 1e-6)
    assert len(level0_cosine_groups(std, 0.72)) > 2


def test_deep_shape_keeps_up_to_sixteen_level0_groups():
    # eight heads in four well separated families: [2,2,2,2] allows them all, [2] merges to two
    feats = torch.full((8, 9), 10.0)
    for h in range(8):
        theta = math.radians(90 * (h // 2))
        feats[h, 0] += math.cos(theta)
        feats[h, 1] += math.sin(theta)
    deep = controller(8, 64, standardize_features=True)
    assert deep.build_topology(feats)[0] == ((0, 1), (2, 3), (4, 5), (6, 7))
    shallow = controller(8, 64, standardize_features=True, hierarchy=(2,))
    assert len(shallow.build_topology(feats)[0]) == 2
    capped = controller(8, 64, standardize_features=True, max_depth=1)  # [2,2,2,2] cut to one level
    assert len(capped.build_topology(feats)[0]) == 2


# ---------------------------------------------------------------------- paper rows as written


def test_paper_regimes_run_the_paper_as_written_and_ours_are_named():
    paper_defaults = {"standardize_features": False, "diagnostics_context": "executed", "keep_collapsed_top": False}
    for name in regimes.names():
        cfg = regimes.get(name)
        if regimes.is_ours(name):
            continue
        for field, value in paper_defaults.items():
            assert getattr(cfg, field) == value, (name, field)
    fields = ("standardize_features", "diagnostics_context")
    for base in ("grouping_off", "full_adaptive", "shallow_freeze", "deep_practical_reuse"):
        plus = f"{base}_plus"
        assert regimes.is_ours(plus)
        assert regimes.get(plus) == regimes.get(base).replace(**regimes.OURS)
        assert {f: getattr(regimes.get(plus), f) for f in fields} == {"standardize_features": True, "diagnostics_context": "full"}
    full = regimes.get("full_adaptive")
    assert regimes.get("full_adaptive_standardized") == full.replace(standardize_features=True)
    assert regimes.get("full_adaptive_full_context") == full.replace(diagnostics_context="full")


def test_values_the_paper_leaves_open_come_from_the_reference_configs():
    cfg = ControllerConfig()
    assert (cfg.level0_threshold, cfg.upper_threshold) == (0.72, 0.76)
    assert (cfg.base_hidden, cfg.joint_hidden) == (16, 64)
    assert (cfg.control_warmup, cfg.max_depth) == (100, 4)
    # the paper's own values (5.3, 5.4, 5.8, 7.1)
    assert (cfg.control_interval, cfg.feature_ema, cfg.resolution_ema) == (5, 0.9, 0.15)
    assert (cfg.norm_penalty, cfg.norm_eps) == (16.0, 1e-6)


def test_table8_fixed_random_grouping_is_depth_four_and_table5_is_shallow():
    t8 = regimes.get("fixed_random_grouping_deep")
    assert (t8.grouping, t8.hierarchy, t8.max_depth, t8.num_levels) == ("random", (2, 2, 2, 2), 4, 4)
    assert t8 == regimes.get("full_adaptive").replace(grouping="random")
    t5 = regimes.get("fixed_random_grouping")
    assert (t5.grouping, t5.hierarchy, t5.topology, t5.num_levels) == ("random", (2,), "frozen", 1)
    assert "Table 8" in regimes.describe("fixed_random_grouping_deep").paper_row
    assert "Table 8" not in regimes.describe("fixed_random_grouping").paper_row


# ---------------------------------------------------------------------- diagnostics (5.3)


def _reference_diagnostics(q, k, v, long_range, num_queries, windows):
    """Entropy / output norm / usage by explicit loops in float64 (window None = full context)."""
    b, h, t, d = q.shape
    pos = sample_query_positions(t, num_queries, long_range).tolist()
    out = torch.zeros(h, 3, dtype=torch.float64)
    for head in range(h):
        w = t if windows is None else windows[head]
        rows = []
        for bi, i in itertools.product(range(b), pos):
            keys = [j for j in range(t) if i - w < j <= i]
            s = torch.stack([q[bi, head, i].double() @ k[bi, head, j].double() for j in keys]) / math.sqrt(d)
            p = torch.softmax(s, dim=0)
            ent = float(-(p * p.log()).sum() / math.log(len(keys))) if len(keys) > 1 else 0.0
            o = (p[:, None] * torch.stack([v[bi, head, j].double() for j in keys])).sum(0)
            usage = float(sum(pj for pj, j in zip(p.tolist(), keys) if i - j >= long_range))
            rows.append([ent, float(o.norm()), usage])
        out[head] = torch.tensor(rows, dtype=torch.float64).mean(0)
    return out


@pytest.mark.parametrize("windows", [None, (4, 8, 16, 32), (4, 4, 32, 6)])
def test_diagnostics_match_a_loop_reference_in_the_executed_window_or_full_context(windows):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 32, 8, generator=g) for _ in range(3))
    got = attention_diagnostics(q, k, v, long_range=4, num_queries=6, windows=windows)
    ref = _reference_diagnostics(q, k, v, 4, 6, windows)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_a_head_in_the_smallest_window_shows_no_long_range_usage_unless_measured_in_full():
    g = torch.Generator().manual_seed(4)
    q = torch.zeros(1, 2, 32, 8)  # uniform attention
    k, v = torch.randn(1, 2, 32, 8, generator=g), torch.randn(1, 2, 32, 8, generator=g)
    executed = attention_diagnostics(q, k, v, long_range=4, num_queries=8, windows=(4, 32))
    full = attention_diagnostics(q, k, v, long_range=4, num_queries=8)
    assert executed[0, 2] == 0.0  # window 4 sees no key at distance >= 4
    torch.testing.assert_close(executed[1], full[1])  # a full window is full context
    assert full[0, 2] > 0.5
    torch.testing.assert_close(executed[:, 0], torch.ones(2))  # uniform: entropy 1 either way
    with pytest.raises(ValueError, match="windows"):
        attention_diagnostics(q, k, v, long_range=4, windows=(4,))


def test_controller_measures_diagnostics_in_the_windows_it_executes():
    # Simple policy on uniform attention. After the first decision every head runs window 4 of
    # (4, 8, 16, 32). Executed diagnostics then see no long-range mass (usage 0, entropy 1):
    # floor(4 * (1 + 0) / 2) = 2 -> window 16, the shrink confirming itself. Measured in full
    # context, usage stays high and the head returns to the full window.
    g = torch.Generator().manual_seed(1)
    q = torch.zeros(1, 4, 32, 8)
    uniform = (q, torch.randn(1, 4, 32, 8, generator=g), torch.randn(1, 4, 32, 8, generator=g))
    peaked_q = torch.zeros(1, 4, 32, 8)
    peaked_q[..., 0] = 50.0
    peaked_k = torch.zeros(1, 4, 32, 8)
    peaked_k[..., 0] = torch.arange(32, dtype=torch.float32)
    peaked = (peaked_q, peaked_k, uniform[2])

    def windows(context):
        ctrl = controller(config=regimes.get("simple_policy", control_warmup=0, control_interval=1, diagnostics_context=context))
        seen, usage = [], []
        for step, qkv in enumerate((peaked, uniform, uniform)):
            ctrl.set_step(step)
            seen.append(ctrl.windows_for(*qkv))
            usage.append(ctrl.last_diagnostics[:, 2].clone())
        return seen, usage

    seen, usage = windows("executed")
    assert seen == [(32,) * 4, (4,) * 4, (16,) * 4]
    assert usage[1].tolist() == [0.0] * 4  # measured in window 4
    seen_full, usage_full = windows("full")
    assert seen_full == [(32,) * 4, (4,) * 4, (32,) * 4]
    assert bool((usage_full[1] > 0.5).all())


# ---------------------------------------------------------------------- freeze after warmup


def test_passthrough_upper_levels_copy_level0_whatever_the_similarity():
    # two groups at 0 and 5deg with equal norms would merge (and then stop, collapsed)
    feats = torch.zeros(4, 9)
    feats[:2, :2] = angles(0, 0)
    feats[2:, :2] = angles(60, 60)
    merged = controller(4, upper_levels="merge")
    passthrough = controller(4, upper_levels="passthrough")
    level0 = ((0, 1), (2, 3))
    assert passthrough.build_topology(feats) == (level0, ((0,), (1,)), ((0,), (1,)), ((0,), (1,)))
    assert passthrough.last_stop_reason == "max_depth"
    # merged: the 60deg gap (cos .5, equal norms) is below .76: single-child parents as well
    assert merged.build_topology(feats) == passthrough.build_topology(feats)
    # raw heads at 0 and 5deg collapse at level 0 -> forced bipartition (0, 1 | 2, 3); the two
    # groups (cos 5deg, equal norms) would then merge into one item
    close = torch.zeros(4, 9)
    close[:2, :2] = angles(0, 0)
    close[2:, :2] = angles(5, 5)
    topo_pass = passthrough.build_topology(close)
    assert topo_pass == (level0, ((0,), (1,)), ((0,), (1,)), ((0,), (1,)))
    assert merged.build_topology(close) == (level0,)
    assert merged.last_stop_reason == "upper_level_collapsed"


def test_freeze_after_warmup_readings_differ_only_in_the_upper_levels():
    ours = regimes.get("freeze_after_warmup")
    ref = regimes.get("freeze_after_warmup_passthrough")
    assert ref == ours.replace(upper_levels="passthrough")
    assert ours.topology == ref.topology == "freeze_after_warmup"
    # warmup observation then freeze, with pass-through levels above the observed level 0
    ctrl = controller(4, config=ref.replace(control_warmup=2, control_interval=1))
    g = torch.Generator().manual_seed(0)
    qkv = tuple(torch.randn(1, 4, 32, 8, generator=g) for _ in range(3))
    for step in range(2):
        ctrl.set_step(step)
        assert ctrl.windows_for(*qkv) == (32,) * 4  # windows pass through at full span
    frozen = ctrl.cached_topology()
    assert len(frozen) == 4 and all(level == tuple((i,) for i in range(len(frozen[0]))) for level in frozen[1:])
    g2 = torch.Generator().manual_seed(9)
    other = tuple(torch.randn(1, 4, 32, 8, generator=g2) * 5 for _ in range(3))
    for step in range(2, 5):
        ctrl.set_step(step)
        ctrl.windows_for(*other)
        assert ctrl.cached_topology() == frozen


# ---------------------------------------------------------------------- resolution EMA (5.8)


def test_resolution_ema_of_085_pins_four_windows_at_the_full_window_forever():
    # c = round(.85 c_prev + .15 c_new) from c = 3: the smallest mix is .85 * 3 = 2.55 -> 3,
    # so with K = 4 no head ever leaves the full window: the same windows as control off.
    cfg = regimes.get("fixed_window", control_warmup=0, control_interval=1, fixed_window_index=0, resolution_ema=0.85)
    ctrl = controller(config=cfg)
    off = controller(config=regimes.get("control_off", control_warmup=0, control_interval=1))
    g = torch.Generator().manual_seed(0)
    for step in range(30):
        qkv = tuple(torch.randn(1, 4, 32, 8, generator=g) for _ in range(3))
        for c in (ctrl, off):
            c.set_step(step)
        assert ctrl.windows_for(*qkv) == off.windows_for(*qkv) == (32,) * 4
    assert int(ctrl.num_updates) == 30
    assert ctrl.last_decision.head_index.tolist() == [0] * 4  # it kept asking for window 4
    # any beta >= 5/6 pins (halves round up: 5/6 * 3 = 2.5 -> 3); beta .8 moves (2.4 -> 2)
    for beta in (5 / 6, 0.85, 0.9):
        assert resolution_ema(torch.tensor([3]), torch.tensor([0]), beta, 4).item() == 3
    assert resolution_ema(torch.tensor([3]), torch.tensor([0]), 0.8, 4).item() == 2


def test_resolution_ema_of_04_smooths_and_still_reaches_every_target():
    def path(beta, start, target, updates=4):
        c, out = torch.tensor([start]), []
        for _ in range(updates):
            c = resolution_ema(c, torch.tensor([target]), beta, 4)
            out.append(c.item())
        return out

    # .4 * 3 = 1.2 -> 1, then .4 * 1 = .4 -> 0: one update of lag on a jump of three
    assert path(0.4, 3, 0) == [1, 0, 0, 0]
    assert path(0.4, 0, 3) == [2, 3, 3, 3]  # 1.8 -> 2, .8 + 1.8 = 2.6 -> 3
    # .5 stalls one index above the target when coming down: .5 * 1 = .5 rounds up to 1
    assert path(0.5, 3, 0) == [2, 1, 1, 1]
    # the paper's .15 never changes the new index
    assert path(0.15, 3, 0) == [0, 0, 0, 0]
