"""The AAH-v3 controller's steps, one by one, against hand-worked examples (paper 5.3-5.8)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from aah import regimes
from aah.controller import ControllerConfig, HeadController
from aah.controller.features import attention_diagnostics, qkv_statistics, sample_query_positions
from aah.controller.hierarchy import (
    build_upper_levels,
    forced_bipartition,
    grow_upper_levels,
    level0_cosine_groups,
    level_features,
    merge_level,
    normdiff_similarity,
    parents_of,
    size_fractions,
    topology_from_tensor,
    topology_to_tensor,
)
from aah.controller.scoring import (
    SeededMLP,
    enrich,
    joint_input,
    level_coordinate,
    score_level,
    sibling_pairs,
)
from aah.controller.selection import (
    execution_windows,
    map_to_heads,
    resolution_ema,
    select_top_down,
    simple_policy_index,
)

# ---------------------------------------------------------------------- helpers


def controller(num_heads=4, max_seq_len=32, **overrides) -> HeadController:
    return HeadController(num_heads, ControllerConfig(**overrides), max_seq_len=max_seq_len)


def unit(deg: float) -> torch.Tensor:
    rad = math.radians(deg)
    return torch.tensor([math.cos(rad), math.sin(rad)], dtype=torch.float64)


def angles(*degs: float) -> torch.Tensor:
    return torch.stack([unit(d) for d in degs])


def manual_mlp(x: torch.Tensor, mlp: SeededMLP) -> torch.Tensor:
    """Linear -> exact (erf) GELU -> Linear, written out in float64 from the module's buffers."""
    w0, b0 = mlp.weight0.double(), mlp.bias0.double()
    w1, b1 = mlp.weight1.double(), mlp.bias1.double()
    h = x.double() @ w0.T + b0
    h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    return h @ w1.T + b1


def constant_qkv(q_val, k_val, v_val, heads=2, t=4, d=2):
    full = lambda val: torch.full((1, heads, t, d), float(val))  # noqa: E731
    return full(q_val), full(k_val), full(v_val)


# ---------------------------------------------------------------------- features (5.3)


def test_qkv_statistics_are_mean_abs_and_population_std_per_head():
    b, h, t, d = 2, 2, 3, 4
    q = torch.empty(b, h, t, d)
    q[:, 0] = 2.0  # constant: mean|q| = 2, std = 0
    q[:, 1] = torch.tensor([3.0, -3.0, 3.0, -3.0])  # mean 0 but mean|q| = 3, population std 3
    k = torch.empty(b, h, t, d)
    k[:, 0] = torch.tensor([1.0, 3.0, 1.0, 3.0])  # mean|k| 2, population std 1
    k[:, 1] = -5.0
    v = torch.empty(b, h, t, d)
    v[:, 0] = torch.tensor([0.0, 0.0, 0.0, 4.0])  # mean|v| 1, std sqrt(mean(x^2) - 1) = sqrt(3)
    v[:, 1] = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    stats = qkv_statistics(q, k, v)
    expected = torch.tensor(
        [
            [2.0, 0.0, 2.0, 1.0, 1.0, math.sqrt(3.0)],
            [3.0, 3.0, 5.0, 0.0, 1.0, 1.0],
        ]
    )
    assert stats.shape == (2, 6)
    assert stats.dtype == torch.float32
    torch.testing.assert_close(stats, expected)


def test_qkv_statistics_give_each_query_head_its_kv_heads_statistics():
    # 4 query heads, 2 KV heads: heads 0, 1 read KV head 0; heads 2, 3 read KV head 1.
    q = torch.ones(1, 4, 5, 2)
    k = torch.empty(1, 2, 5, 2)
    k[:, 0], k[:, 1] = 1.0, 7.0
    v = torch.empty(1, 2, 5, 2)
    v[:, 0], v[:, 1] = -2.0, 4.0
    stats = qkv_statistics(q, k, v)
    assert stats[:, 2].tolist() == [1.0, 1.0, 7.0, 7.0]
    assert stats[:, 4].tolist() == [2.0, 2.0, 4.0, 4.0]


def test_equal_keys_give_uniform_attention_with_entropy_one_and_long_range_usage():
    t, long_range = 8, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, t, 4, generator=g)
    k = torch.randn(2, 3, 1, 4, generator=g).expand(2, 3, t, 4)  # every key the same
    v = torch.tensor([3.0, 4.0, 0.0, 0.0]).expand(2, 3, t, 4)  # every value has norm 5
    diag = attention_diagnostics(q, k, v, long_range=long_range, num_queries=100)
    # Queries that can see long_range back: positions 2..7. Query i sees i + 1 keys, of which
    # the ones at distance >= 2 are keys 0..i-2: i - 1 of them.
    usage = sum((i - 1) / (i + 1) for i in range(2, 8)) / 6
    assert diag.shape == (3, 3)
    torch.testing.assert_close(diag[:, 0], torch.ones(3))
    torch.testing.assert_close(diag[:, 1], torch.full((3,), 5.0))
    torch.testing.assert_close(diag[:, 2], torch.full((3,), usage))


def test_one_dominant_key_gives_zero_entropy_and_its_value_as_output():
    t, d = 10, 4
    q = torch.zeros(1, 2, t, d)
    q[..., 0] = 1.0
    k = torch.zeros(1, 2, t, d)
    k[:, :, 0, 0] = 1000.0  # key 0 wins every row by a huge margin
    g = torch.Generator().manual_seed(1)
    v = torch.randn(1, 2, t, d, generator=g)
    v[:, :, 0] = torch.tensor([0.0, 6.0, 8.0, 0.0])  # norm 10
    diag = attention_diagnostics(q, k, v, long_range=3, num_queries=4)
    torch.testing.assert_close(diag[:, 0], torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(diag[:, 1], torch.full((2,), 10.0))
    # Every sampled query is at least 3 positions after key 0: all mass is long range.
    torch.testing.assert_close(diag[:, 2], torch.ones(2))


def test_attention_diagnostics_read_the_kv_head_of_each_query_head():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 12, 4, generator=g)
    k = torch.randn(1, 2, 12, 4, generator=g)
    v = torch.randn(1, 2, 12, 4, generator=g)
    grouped = attention_diagnostics(q, k, v, long_range=3, num_queries=5)
    expanded = attention_diagnostics(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), long_range=3, num_queries=5
    )
    torch.testing.assert_close(grouped, expanded)


@pytest.mark.parametrize("seq_len", [1, 2, 5, 17, 64])
@pytest.mark.parametrize("num_queries", [2, 3, 8, 100])
@pytest.mark.parametrize("start", [0, 4, 16, 200])
def test_sampled_query_positions_include_the_last_and_stay_in_range(seq_len, num_queries, start):
    pos = sample_query_positions(seq_len, num_queries, start)
    lo = max(0, min(start, seq_len - 1))
    assert pos.dtype == torch.long
    assert int(pos.max()) == seq_len - 1
    assert int(pos.min()) >= lo
    assert len(pos) <= num_queries
    assert pos.tolist() == sorted(set(pos.tolist()))


@pytest.mark.parametrize("seq_len, start", [(8, 2), (32, 4), (5, 0)])
def test_a_single_sampled_query_is_the_last_position(seq_len, start):
    # diagnostic_queries=1 is a valid setting: its one query must be the last position,
    # the one that sees the most context.
    assert sample_query_positions(seq_len, 1, start).tolist() == [seq_len - 1]


# ---------------------------------------------------------------------- feature EMA (5.3)


def test_first_observation_initialises_the_feature_ema_with_zero_diagnostics():
    ctrl = controller(num_heads=2)
    q, k, v = constant_qkv(2.0, -3.0, 0.5)
    feats = ctrl.observe(q, k, v)
    expected = torch.tensor([[2.0, 0.0, 3.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]] * 2)
    torch.testing.assert_close(feats, expected)
    torch.testing.assert_close(ctrl.feature_ema, expected)
    assert bool(ctrl.feature_ema_ready)


def test_later_observations_blend_ninety_percent_old_ten_percent_new():
    ctrl = controller(num_heads=2)
    ctrl.observe(*constant_qkv(1.0, 2.0, 4.0))
    ctrl.last_diagnostics.copy_(torch.tensor([[0.5, 2.0, 0.25], [1.0, 3.0, 0.75]]))
    feats = ctrl.observe(*constant_qkv(2.0, 12.0, -4.0))
    x0 = torch.tensor([1.0, 0.0, 2.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0])
    x1 = torch.tensor(
        [
            [2.0, 0.0, 12.0, 0.0, 4.0, 0.0, 0.5, 2.0, 0.25],
            [2.0, 0.0, 12.0, 0.0, 4.0, 0.0, 1.0, 3.0, 0.75],
        ]
    )
    torch.testing.assert_close(feats, 0.9 * x0 + 0.1 * x1)
    # by hand: mean|q| 0.9 * 1 + 0.1 * 2 = 1.1, mean|k| 0.9 * 2 + 0.1 * 12 = 3.0
    assert feats[0, 0].item() == pytest.approx(1.1)
    assert feats[0, 2].item() == pytest.approx(3.0)
    assert feats[1, 7].item() == pytest.approx(0.3)


def test_no_feature_ema_regime_uses_only_the_current_observation():
    ctrl = HeadController(2, regimes.get("no_feature_ema"), max_seq_len=32)
    ctrl.observe(*constant_qkv(1.0, 2.0, 4.0))
    feats = ctrl.observe(*constant_qkv(5.0, 6.0, 7.0))
    torch.testing.assert_close(
        feats, torch.tensor([[5.0, 0.0, 6.0, 0.0, 7.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    )


# ---------------------------------------------------------------------- level 0 (5.4)


def test_level0_clustering_joins_the_most_similar_centroid_above_threshold():
    # h0 0deg: new; h1 60deg: cos60 = .5 -> new; h2 25deg: cos25 = .91 vs cos35 = .82 -> group 0
    # (centroid now 12.5deg); h3 40deg: cos27.5 = .89 vs cos20 = .94 -> group 1 (centroid 50deg);
    # h4 180deg: new; h5 100deg: best is cos50 = .64 < .72 -> new.
    groups = level0_cosine_groups(angles(0, 60, 25, 40, 180, 100), 0.72)
    assert groups == [[0, 2], [1, 3], [4], [5]]


def test_level0_centroid_moves_after_each_join():
    # 0 and 40deg join (cos40 = .766); their centroid is at 20deg, so 60deg joins too (cos40)
    # although it is only cos60 = .5 from the first head.
    assert level0_cosine_groups(angles(0, 40, 60), 0.72) == [[0, 1, 2]]
    assert level0_cosine_groups(angles(0, 60), 0.72) == [[0], [1]]


def test_forced_bipartition_splits_around_the_least_similar_pair():
    feats = torch.tensor([[5.0, 1.0], [1.0, 5.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])
    # Least similar pair: heads 2 and 4 (cosine 0). h0 -> anchor 2, h1 -> anchor 4; h3 is
    # equally similar to both: sizes tie (2, 2), first anchor; h5 ties too and goes to the
    # now smaller group of anchor 4.
    groups = forced_bipartition(feats)
    assert sorted(groups) == [[0, 2, 3], [1, 4, 5]]


def _family_features() -> torch.Tensor:
    """Six heads, three families (A, B, C, A, B, C): base 5 everywhere, +1 on the family column."""
    feats = torch.full((6, 9), 5.0)
    for h in range(6):
        feats[h, h % 3] += 1.0
    return feats


def test_raw_nonnegative_features_collapse_but_standardized_ones_separate():
    feats = _family_features()
    # Raw: every cross-family cosine is 235/236 ~ .996, so greedy clustering collapses.
    assert level0_cosine_groups(feats, 0.72) == [[0, 1, 2, 3, 4, 5]]
    raw = controller(num_heads=6, standardize_features=False).build_topology(feats)
    std = controller(num_heads=6, standardize_features=True).build_topology(feats)
    # Collapse -> forced bipartition: anchors 0 (A) and 1 (B); C heads tie and go to the
    # smaller group (first anchor when sizes are equal).
    assert sorted(raw[0]) == [(0, 2, 3), (1, 4, 5)]
    # Standardized: each family column is (+1.41, -0.71, -0.71) across families, cross-family
    # cosine -0.5: the three families are found.
    assert sorted(std[0]) == [(0, 3), (1, 4), (2, 5)]


def test_controller_falls_back_to_bipartition_only_when_level0_collapses():
    feats = _family_features()
    # standardized, the families do not collapse: three groups, no fallback
    assert len(controller(num_heads=6, standardize_features=True).build_topology(feats)[0]) == 3
    # identical raw features collapse to one cluster -> forced two-way split
    same = torch.full((4, 9), 2.0)
    topo = controller(num_heads=4, standardize_features=False).build_topology(same)
    assert len(topo[0]) == 2
    assert sorted(h for g in topo[0] for h in g) == [0, 1, 2, 3]


# ---------------------------------------------------------------------- upper levels (5.4)


def test_normdiff_similarity_matches_the_paper_formula_by_hand():
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([4.0, 3.0])
    assert normdiff_similarity(a, b, 16.0, 1e-6) == pytest.approx(24 / 25)
    # same direction, norms 5 and 10: 1 - 16 * 5 / 10 = -7
    assert normdiff_similarity(a, 2 * a, 16.0, 1e-6) == pytest.approx(-7.0)
    # orthogonal, norms 1 and 1.1: 0 - 16 * 0.1 / 1.1
    c, e = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.1])
    assert normdiff_similarity(c, e, 16.0, 1e-6) == pytest.approx(-16 * 0.1 / 1.1)
    # zero vectors: the eps keeps it finite (cos 0, no norm difference)
    z = torch.zeros(3)
    assert normdiff_similarity(z, z, 16.0, 1e-6) == pytest.approx(0.0)
    # a smaller penalty weight scales the norm term only
    assert normdiff_similarity(a, 2 * a, 2.0, 1e-6) == pytest.approx(0.0)


def test_norm_penalty_decides_whether_same_direction_items_merge():
    a = torch.tensor([1.0, 0.0])
    # 1 - 16 * 0.01 / 1.01 = .842 >= .76 merges; 1 - 16 * 0.02 / 1.02 = .686 does not
    assert merge_level(torch.stack([a, 1.01 * a]), 0.76, 16.0, 1e-6, 2) == [[0, 1]]
    assert merge_level(torch.stack([a, 1.02 * a]), 0.76, 16.0, 1e-6, 2) == [[0], [1]]


def test_merge_level_pairs_greedily_above_threshold_with_single_child_parents():
    # unit vectors: 0: 0deg, 1: 90deg, 2: 10deg, 3: 100deg, 4: 200deg (equal norms, no penalty)
    feats = angles(0, 90, 10, 100, 200)
    assert merge_level(feats, 0.76, 16.0, 1e-6, 2) == [[0, 2], [1, 3], [4]]


def test_merge_level_takes_the_most_similar_partners_up_to_the_branching():
    feats = angles(0, 10, 5)
    # item 0: cos5 (item 2) beats cos10 (item 1); with branching 2 item 1 is left alone
    assert merge_level(feats, 0.76, 16.0, 1e-6, 2) == [[0, 2], [1]]
    assert merge_level(feats, 0.76, 16.0, 1e-6, 3) == [[0, 1, 2]]


def test_build_upper_levels_stops_before_a_collapsed_top_level_like_the_reference():
    level0 = [[0], [1], [2], [3]]
    feats = angles(0, 5, 10, 15)
    kwargs = dict(num_levels=4, branching=(2, 2, 2, 2), threshold=0.76, penalty=16.0, eps=1e-6)
    # level 1: (0,1), (2,3); level 2 would merge their means (2.5 and 12.5deg) into one item:
    # the reference stops before adding it (upper_level_collapsed)
    topo, reason = grow_upper_levels(level0, feats, **kwargs)
    assert topo == (((0,), (1,), (2,), (3,)), ((0, 1), (2, 3)))
    assert reason == "upper_level_collapsed"
    assert build_upper_levels(level0, feats, **kwargs) == topo
    # our switch keeps the merged single-item top level, and growth stops above it
    kept, reason = grow_upper_levels(level0, feats, keep_collapsed_top=True, **kwargs)
    assert kept == topo + (((0, 1),),)
    assert reason == "single_item"


def test_collapsed_top_level_switch_in_the_controller():
    # two heads pointing the same way with equal norms: level 0 forced bipartition (0 | 1),
    # level 1 would merge them (similarity 1 >= .76)
    feats = torch.full((2, 9), 1.0)
    ref = controller(num_heads=2)
    assert ref.build_topology(feats) == (((0,), (1,)),)
    assert ref.last_stop_reason == "upper_level_collapsed"
    ours = controller(num_heads=2, keep_collapsed_top=True)
    assert ours.build_topology(feats) == (((0,), (1,)), ((0, 1),))
    assert ours.last_stop_reason == "single_item"
    # with the single-item top, its argmax clamps both level-0 groups; without, the two
    # groups are the top items and keep their raw choices
    dec = ours.decide(feats)
    top = int(dec.levels[1].index[0])
    assert dec.levels[0].index.tolist() == [min(int(c), top) for c in dec.levels[0].raw_index]
    dec_ref = ref.decide(feats)
    assert len(dec_ref.levels) == 1
    assert torch.equal(dec_ref.levels[0].index, dec_ref.levels[0].raw_index)


def test_build_upper_levels_stops_at_num_levels_with_single_child_parents():
    level0 = [[0], [1], [2], [3]]
    feats = angles(0, 5, 90, 95)
    # level 1: (0,1), (2,3); level 2: means at 2.5 and 92.5deg never merge -> single children
    kwargs = dict(branching=(2, 2, 2, 2), threshold=0.76, penalty=16.0, eps=1e-6)
    topo = build_upper_levels(level0, feats, num_levels=4, **kwargs)
    assert topo == (
        ((0,), (1,), (2,), (3,)),
        ((0, 1), (2, 3)),
        ((0,), (1,)),
        ((0,), (1,)),
    )
    assert build_upper_levels(level0, feats, num_levels=2, **kwargs) == topo[:2]
    assert build_upper_levels(level0, feats, num_levels=1, **kwargs) == topo[:1]


def test_upper_level_features_are_child_weighted_not_head_weighted():
    heads = torch.tensor([[0.0, 1.0], [4.0, 1.0], [4.0, 1.0], [4.0, 1.0]])
    topo = (((0,), (1, 2, 3)), ((0, 1),))
    feats = level_features(topo, heads)
    torch.testing.assert_close(feats[0], torch.tensor([[0.0, 1.0], [4.0, 1.0]]))
    # mean of the two children (0 and 4) = 2; the mean over the 4 heads would be 3
    torch.testing.assert_close(feats[1], torch.tensor([[2.0, 1.0]]))


def test_size_fractions_count_immediate_children():
    topo = (((0,), (1, 2, 3)), ((0,), (1,)), ((0, 1),))
    fr = size_fractions(topo)
    torch.testing.assert_close(fr[0], torch.tensor([0.25, 0.75]))
    # level 1: one child each, whatever the number of heads below
    torch.testing.assert_close(fr[1], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(fr[2], torch.tensor([1.0]))
    fr3 = size_fractions((((0, 1), (2,), (3,)), ((0, 2), (1,))))
    torch.testing.assert_close(fr3[1], torch.tensor([2 / 3, 1 / 3]))


def test_parents_of_lists_each_items_parent_and_none_at_top():
    topo = (((0, 1), (2,), (3,)), ((0, 2), (1,)), ((0, 1),))
    assert parents_of(topo) == [[0, 1, 0], [0, 0], None]


def test_topology_tensor_encodes_item_of_every_head_and_round_trips():
    topo = (((0, 1), (2,), (3,)), ((0, 2), (1,)), ((0, 1),))
    enc = topology_to_tensor(topo, num_heads=4, max_levels=4)
    assert enc.tolist() == [
        [0, 0, 1, 2],
        [0, 0, 1, 0],
        [0, 0, 0, 0],
        [-1, -1, -1, -1],
    ]
    assert topology_from_tensor(enc) == topo
    # groups listed out of head order survive too
    odd = (((2, 3), (0, 1)), ((0, 1),))
    assert topology_from_tensor(topology_to_tensor(odd, 4, 2)) == odd


# ---------------------------------------------------------------------- enriched inputs (5.5)


def test_enriched_inputs_are_g_eta_parent_diff_mean_diff_size_in_order():
    f = torch.arange(18, dtype=torch.float32).view(2, 9)  # rows 0..8 and 9..17
    parent = torch.full((2, 9), 2.0)
    sizes = torch.tensor([0.25, 0.75])
    u = enrich(f, parent, sizes, 0.5)
    assert u.shape == (2, 29)
    mean = f.mean(dim=0)  # 4.5 .. 12.5
    for i in range(2):
        torch.testing.assert_close(u[i, 0:9], f[i])
        assert u[i, 9].item() == 0.5
        torch.testing.assert_close(u[i, 10:19], f[i] - 2.0)
        torch.testing.assert_close(u[i, 19:28], f[i] - mean)
        assert u[i, 28].item() == sizes[i].item()
    # mean difference by hand: item 0 is 4.5 below the mean in every column
    torch.testing.assert_close(u[0, 19:28], torch.full((9,), -4.5))


def test_parent_difference_is_zero_at_the_top_level():
    f = torch.rand(3, 9)
    u = enrich(f, None, torch.full((3,), 1 / 3), 1.0)
    assert torch.count_nonzero(u[:, 10:19]) == 0


@pytest.mark.parametrize(
    "r, levels, eta", [(0, 1, 0.0), (0, 4, 0.0), (1, 4, 1 / 3), (3, 4, 1.0), (1, 2, 1.0)]
)
def test_level_coordinate_is_r_over_levels_minus_one(r, levels, eta):
    assert level_coordinate(r, levels) == pytest.approx(eta)


def test_controller_levels_feed_enriched_inputs_built_from_their_topology():
    # Heads in pairs at angles 0, 90, 180, 270deg in columns 0-1 on top of 10 everywhere.
    # Level 0 (z-scored cosine): the four pairs. Level 1 (raw, norm-penalised): 0 and 90deg
    # have equal norms and cosine ~.995 and merge, so do 180 and 270deg; the two parents
    # differ in norm by ~2% (penalty ~.35) and stay apart up to the fourth level.
    feats = torch.full((8, 9), 10.0)
    for h in range(8):
        theta = math.radians(90 * (h // 2))
        feats[h, 0] += math.cos(theta)
        feats[h, 1] += math.sin(theta)
    ctrl = controller(num_heads=8, max_seq_len=64, standardize_features=True)
    dec = ctrl.decide(feats)
    topo = dec.topology
    assert topo == (
        ((0, 1), (2, 3), (4, 5), (6, 7)),
        ((0, 1), (2, 3)),
        ((0,), (1,)),
        ((0,), (1,)),
    )
    num_levels = len(topo)
    assert torch.count_nonzero(dec.levels[0].inputs[:, 10:19]) > 0
    # child-weighted features, written out here level by level
    below = [feats[h] for h in range(8)]
    per_level = []
    for level in topo:
        items = [torch.stack([below[c] for c in children]).mean(dim=0) for children in level]
        per_level.append(torch.stack(items))
        below = items
    for r, (level, lvl) in enumerate(zip(topo, dec.levels)):
        g_r = per_level[r]
        u = lvl.inputs
        assert u.shape == (len(level), 29)
        torch.testing.assert_close(u[:, :9], g_r)
        torch.testing.assert_close(u[:, 9], torch.full((len(level),), r / max(1, num_levels - 1)))
        if r == num_levels - 1:
            assert torch.count_nonzero(u[:, 10:19]) == 0
        else:
            parent_of = {c: p for p, children in enumerate(topo[r + 1]) for c in children}
            expected_parent = torch.stack(
                [per_level[r + 1][parent_of[i]] for i in range(len(level))]
            )
            torch.testing.assert_close(u[:, 10:19], g_r - expected_parent)
        torch.testing.assert_close(u[:, 19:28], g_r - g_r.mean(dim=0))
        total = sum(len(c) for c in level)
        torch.testing.assert_close(u[:, 28], torch.tensor([len(c) / total for c in level]))


# ---------------------------------------------------------------------- scoring (5.6)


def test_sibling_pairs_are_consecutive_and_leave_an_odd_one_out():
    assert sibling_pairs([0, 1, 2, 3, 4]) == [(0, 1), (2, 3)]
    assert sibling_pairs([3, 7, 9]) == [(3, 7)]
    assert sibling_pairs([5]) == []
    assert sibling_pairs([]) == []


def test_joint_input_is_ua_ub_and_both_directional_differences():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    assert joint_input(a, b).tolist() == [1.0, 2.0, 10.0, 20.0, -9.0, -18.0, 9.0, 18.0]
    assert joint_input(b, a).tolist() == [10.0, 20.0, 1.0, 2.0, 9.0, 18.0, -9.0, -18.0]


def _scorers(k=4):
    base = SeededMLP((29, 16, k), torch.Generator().manual_seed(11))
    joint = SeededMLP((116, 64, 2 * k), torch.Generator().manual_seed(12))
    return base, joint


def test_joint_logits_replace_both_siblings_base_logits():
    base, joint = _scorers()
    u = torch.randn(5, 29, generator=torch.Generator().manual_seed(4))
    logits, pairs = score_level(u, [[0, 1, 2], [3, 4]], base, joint)
    assert pairs == [(0, 1), (3, 4)]
    expected_base = manual_mlp(u, base)
    for a, b in pairs:
        out = manual_mlp(torch.cat([u[a], u[b], u[a] - u[b], u[b] - u[a]]), joint)
        torch.testing.assert_close(logits[a].double(), out[:4], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[b].double(), out[4:], atol=1e-5, rtol=1e-5)
        # replaced, not added to the base logits
        assert not torch.allclose(logits[a].double(), out[:4] + expected_base[a], atol=1e-3)
    # the odd one out keeps its base logits
    torch.testing.assert_close(logits[2].double(), expected_base[2], atol=1e-5, rtol=1e-5)
    assert logits.dtype == torch.float32


def test_independent_scoring_keeps_every_base_logit():
    base, _ = _scorers()
    u = torch.randn(4, 29, generator=torch.Generator().manual_seed(5))
    logits, pairs = score_level(u, [[0, 1, 2, 3]], base, None)
    assert pairs == []
    torch.testing.assert_close(logits.double(), manual_mlp(u, base), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_windows", [4, 3])
def test_scorers_are_29_16_k_and_116_64_2k(num_windows):
    wins = (4, 8, 16, 32)[-num_windows:]
    ctrl = controller(num_heads=4, max_seq_len=32, windows=wins)
    k = num_windows
    shapes = {name: tuple(b.shape) for name, b in ctrl.named_buffers() if "scorer" in name}
    assert shapes == {
        "base_scorer.weight0": (16, 29),
        "base_scorer.bias0": (16,),
        "base_scorer.weight1": (k, 16),
        "base_scorer.bias1": (k,),
        "joint_scorer.weight0": (64, 116),
        "joint_scorer.bias0": (64,),
        "joint_scorer.weight1": (2 * k, 64),
        "joint_scorer.bias1": (2 * k,),
    }
    # fixed seeded projections: buffers, never trainable parameters
    assert list(ctrl.parameters()) == []


def test_seeded_mlp_is_deterministic_bounded_and_leaves_the_global_rng_alone():
    rng_before = torch.random.get_rng_state()
    m1 = SeededMLP((29, 16, 4), torch.Generator().manual_seed(7))
    m2 = SeededMLP((29, 16, 4), torch.Generator().manual_seed(7))
    m3 = SeededMLP((29, 16, 4), torch.Generator().manual_seed(8))
    controller(num_heads=4)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    for name, buf in m1.named_buffers():
        assert torch.equal(buf, dict(m2.named_buffers())[name])
        assert not torch.equal(buf, dict(m3.named_buffers())[name])
    # PyTorch's default Linear init: uniform within 1 / sqrt(fan_in)
    for i, fan_in in enumerate((29, 16)):
        bound = 1 / math.sqrt(fan_in)
        for t in (getattr(m1, f"weight{i}"), getattr(m1, f"bias{i}")):
            assert float(t.abs().max()) <= bound
            assert float(t.abs().max()) > 0.5 * bound


# ---------------------------------------------------------------------- selection (5.7-5.8)


def _random_topology(num_heads: int, gen: torch.Generator) -> list[list[list[int]]]:
    """A random hierarchy: random partitions of each level's items, until one item is left."""
    levels = []
    n = num_heads
    while True:
        perm = torch.randperm(n, generator=gen).tolist()
        num_cuts = int(torch.randint(0, n, (1,), generator=gen))
        cuts = sorted(set(torch.randint(1, max(n, 2), (num_cuts,), generator=gen).tolist()))
        bounds = [0, *cuts, n]
        level = [sorted(perm[a:b]) for a, b in zip(bounds, bounds[1:])]
        levels.append(level)
        if len(level) == 1 or len(levels) == 5:
            return levels
        n = len(level)


def test_parent_clamp_never_lets_a_child_exceed_its_parent():
    gen = torch.Generator().manual_seed(6)
    for _ in range(200):
        topo = _random_topology(int(torch.randint(1, 9, (1,), generator=gen)), gen)
        logits = [torch.randn(len(level), 4, generator=gen) for level in topo]
        parents = parents_of(topo)
        raw, clamped = select_top_down(logits, parents)
        top = len(topo) - 1
        expected = [None] * len(topo)
        expected[top] = [int(z.argmax()) for z in logits[top]]
        for r in range(top - 1, -1, -1):
            expected[r] = [
                min(int(logits[r][i].argmax()), expected[r + 1][parents[r][i]])
                for i in range(len(topo[r]))
            ]
        for r in range(len(topo)):
            assert raw[r].tolist() == [int(z.argmax()) for z in logits[r]]
            assert clamped[r].tolist() == expected[r]
            if r < top:
                assert all(
                    clamped[r][i] <= clamped[r + 1][parents[r][i]] for i in range(len(topo[r]))
                )


def test_parent_clamp_is_a_min_not_a_copy_of_the_parent():
    topo = [[[0], [1]], [[0, 1]]]
    logits = [torch.tensor([[5.0, 0, 0, 0], [0, 0, 0, 5.0]]), torch.tensor([[0, 0, 5.0, 0]])]
    raw, clamped = select_top_down(logits, parents_of(topo))
    assert raw[0].tolist() == [0, 3]
    assert clamped[0].tolist() == [0, 2]  # the smaller child keeps its own choice
    assert clamped[1].tolist() == [2]


def test_without_parent_constraint_every_level_keeps_its_raw_argmax():
    topo = [[[0], [1]], [[0, 1]]]
    logits = [torch.tensor([[5.0, 0, 0, 0], [0, 0, 0, 5.0]]), torch.tensor([[5.0, 0, 0, 0]])]
    raw, clamped = select_top_down(logits, parents_of(topo), parent_constraint=False)
    assert clamped[0].tolist() == [0, 3]
    assert raw[0].tolist() == [0, 3]


def test_map_to_heads_gives_every_head_its_level0_groups_index():
    heads = map_to_heads([[1, 3], [0], [2]], torch.tensor([2, 0, 3]), 4)
    assert heads.tolist() == [0, 2, 3, 2]
    with pytest.raises(ValueError, match="cover"):
        map_to_heads([[0, 1], [3]], torch.tensor([1, 2]), 4)


def test_resolution_ema_with_paper_beta_never_changes_the_new_index():
    # 0.15 * |prev - new| <= 0.45 < 0.5: with four windows the paper's EMA is a no-op
    for prev, new in itertools.product(range(4), repeat=2):
        out = resolution_ema(torch.tensor([prev]), torch.tensor([new]), 0.15, 4)
        assert out.tolist() == [new]
        assert round(0.15 * prev + 0.85 * new + 1e-9) == new


def test_resolution_ema_with_large_beta_smooths_by_hand():
    def ema(prev, new, beta, k):
        return resolution_ema(torch.tensor([prev]), torch.tensor([new]), beta, k).item()

    # eight windows, beta .85: 0.85 * 7 = 5.95 -> 6; 0.15 * 7 = 1.05 -> 1; 0.85 * 4 = 3.4 -> 3
    assert ema(7, 0, 0.85, 8) == 6
    assert ema(0, 7, 0.85, 8) == 1
    assert ema(4, 0, 0.85, 8) == 3
    # four windows, beta .85: the previous index always wins (0.15 * 3 < 0.5)
    for prev, new in itertools.product(range(4), repeat=2):
        assert ema(prev, new, 0.85, 4) == prev
    # beta .5 rounds halves up: 1.5 -> 2, 0.5 -> 1, 2.5 -> 3
    assert ema(3, 0, 0.5, 4) == 2
    assert ema(0, 1, 0.5, 4) == 1
    assert ema(2, 3, 0.5, 4) == 3
    assert ema(3, 3, 0.5, 4) == 3


def test_execution_window_is_candidate_clamped_to_min_window_and_length():
    cands = (4, 8, 16, 32)
    idx = torch.tensor([0, 1, 2, 3])
    assert execution_windows(idx, cands, 4, 32) == (4, 8, 16, 32)
    assert execution_windows(idx, cands, 6, 32) == (6, 8, 16, 32)  # W_min lifts 4 to 6
    assert execution_windows(idx, cands, 4, 12) == (4, 8, 12, 12)  # T caps 16 and 32
    assert execution_windows(idx, cands, 6, 5) == (5, 5, 5, 5)  # T < W_min: T wins
    assert execution_windows(torch.tensor([-1, 9]), cands, 4, 32) == (4, 32)  # index range clamp
    assert all(isinstance(w, int) for w in execution_windows(idx, cands, 4, 32))


def test_simple_policy_index_is_floor_k_times_mean_of_entropy_and_usage():
    entropy = torch.tensor([0.1, 0.5, 0.9, 1.0, 0.0])
    usage = torch.tensor([0.1, 0.25, 0.6, 1.0, 0.0])
    # 4 * [.1, .375, .75, 1, 0] = [.4, 1.5, 3, 4, 0] -> [0, 1, 3, 3 (capped), 0]
    assert simple_policy_index(entropy, usage, 4).tolist() == [0, 1, 3, 3, 0]
