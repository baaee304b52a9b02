"""What each ablation changes against the regime it ablates (paper 7.1, Tables 3, 5 and 8).

Every test builds the ablation and its parent on the same features and shows the one
difference, so that it fails if the ablation stops doing what its name says.
"""

from __future__ import annotations

import math

import pytest
import torch

from aah import regimes
from aah.controller import ControllerConfig, HeadController, derive_seed
from aah.controller.hierarchy import random_bipartition
from aah.controller.scoring import enrich

K = 4  # candidate windows (4, 8, 16, 32)


def controller(name: str, num_heads: int = 4, layer_idx: int = 0, **overrides) -> HeadController:
    cfg = regimes.get(name, control_warmup=0, control_interval=1, **overrides)
    return HeadController(num_heads, cfg, max_seq_len=32, layer_idx=layer_idx)


def manual_mlp(x: torch.Tensor, mlp) -> torch.Tensor:
    """Linear -> exact GELU -> Linear in float64 from the module's buffers."""
    h = x.double() @ mlp.weight0.double().T + mlp.bias0.double()
    h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    return h @ mlp.weight1.double().T + mlp.bias1.double()


def forbid_joint(ctrl: HeadController) -> None:
    def fail(*_args, **_kwargs):
        raise AssertionError("the joint sibling scorer must not run")

    ctrl.joint_scorer.forward = fail


def random_features(num_heads: int, seed: int) -> torch.Tensor:
    return torch.rand(num_heads, 9, generator=torch.Generator().manual_seed(seed)) * 4


def two_families(num_heads: int = 4) -> torch.Tensor:
    """Heads 0..n/2-1 at 0deg with norm 1, the rest at 60deg with norm 10 (columns 0-1).

    Raw cosine .5 < .72 gives two level-0 groups; the norm gap keeps them from merging above, so
    [2,2,2,2] grows four levels with single-child parents.
    """
    feats = torch.zeros(num_heads, 9)
    half = num_heads // 2
    feats[:half, 0] = 1.0
    feats[half:, 0] = 10 * math.cos(math.radians(60))
    feats[half:, 1] = 10 * math.sin(math.radians(60))
    return feats


# ---------------------------------------------------------------------- grouping off


@pytest.mark.parametrize("seed", range(3))
def test_grouping_off_scores_every_head_alone_with_the_base_scorer_and_no_clamp(seed):
    feats = random_features(6, seed)
    ctrl = controller("grouping_off", num_heads=6)
    forbid_joint(ctrl)
    dec = ctrl.decide(feats)
    assert dec.topology == (tuple((h,) for h in range(6)),)  # per-head items, one level
    (level,) = dec.levels
    assert level.pairs == [] and level.parents is None
    assert torch.equal(level.index, level.raw_index)
    # independent reference: u = [g, eta=0, g - g (top: no parent), g - mean(g), 1/6]
    u = torch.cat(
        [feats, torch.zeros(6, 1), torch.zeros(6, 9), feats - feats.mean(0), torch.full((6, 1), 1 / 6)], dim=1
    )
    expected = manual_mlp(u, ctrl.base_scorer)
    torch.testing.assert_close(level.logits.double(), expected, atol=1e-5, rtol=1e-5)
    assert dec.head_index.tolist() == expected.argmax(-1).tolist()
    # its parent package groups heads and scores sibling pairs jointly on the same features
    full = controller("full_adaptive", num_heads=6).decide(feats)
    assert len(full.topology[0]) < 6
    assert any(lvl.pairs for lvl in full.levels)


def test_grouping_off_never_clamps_even_when_given_a_parent():
    # the regime's setting itself: parent_constraint off, so a deeper shape would not clamp
    cfg = regimes.get("grouping_off")
    assert (cfg.grouping, cfg.scoring, cfg.parent_constraint, cfg.num_levels) == ("per_head", "independent", False, 1)
    assert cfg.max_level0_groups is None


# ---------------------------------------------------------------------- fixed random grouping


@pytest.mark.parametrize("name", ["fixed_random_grouping", "fixed_random_grouping_deep"])
def test_random_grouping_is_seeded_balanced_and_blind_to_features(name):
    tops = []
    for seed in range(4):
        ctrl = controller(name, num_heads=12, seed=seed)
        level0 = {ctrl.build_topology(random_features(12, s))[0] for s in range(5)}
        assert len(level0) == 1  # the same split whatever the features
        (groups,) = level0
        assert sorted(len(g) for g in groups) == [6, 6]  # balanced
        assert sorted(h for g in groups for h in g) == list(range(12))
        # the same seed gives the same split in a fresh controller
        assert controller(name, num_heads=12, seed=seed).build_topology(random_features(12, 99))[0] == groups
        tops.append(groups)
    assert len(set(tops)) > 1  # and different seeds give different splits
    odd = controller(name, num_heads=7).build_topology(random_features(7, 0))[0]
    assert sorted(len(g) for g in odd) == [3, 4]


def test_random_bipartition_is_a_seeded_permutation_split():
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    perm = torch.randperm(10, generator=gen()).tolist()
    expected = sorted([sorted(perm[:5]), sorted(perm[5:])], key=lambda g: g[0])
    assert random_bipartition(10, gen()) == expected


def test_feature_grouping_follows_features_where_random_grouping_does_not():
    a, b = two_families(4), two_families(4)[[0, 2, 1, 3]]  # families (0,1 | 2,3) then (0,2 | 1,3)
    feature = controller("shallow_freeze")
    assert feature.build_topology(a)[0] == ((0, 1), (2, 3))
    assert feature.build_topology(b)[0] == ((0, 2), (1, 3))
    rand = controller("fixed_random_grouping")
    assert rand.build_topology(a)[0] == rand.build_topology(b)[0]


def test_table8_random_grouping_keeps_its_split_and_grows_upper_levels():
    ctrl = controller("fixed_random_grouping_deep", num_heads=4)
    topo = ctrl.build_topology(two_families(4))
    gen = torch.Generator().manual_seed(derive_seed(0, "random_grouping", 0))
    assert topo[0] == tuple(tuple(g) for g in random_bipartition(4, gen))
    assert 1 <= len(topo) <= 4
    shallow = controller("fixed_random_grouping", num_heads=4).build_topology(two_families(4))
    assert shallow == (topo[0],)  # Table 5's row stops at one level


# ---------------------------------------------------------------------- independent scoring


def test_independent_scoring_leaves_the_joint_scorer_unused_and_logits_equal_base_logits():
    feats = two_families(4)
    ind = controller("independent_scoring")
    forbid_joint(ind)
    dec = ind.decide(feats)
    joint = controller("full_adaptive").decide(feats)
    assert dec.topology == joint.topology and len(dec.topology) == 4
    replaced = False
    for lvl, jl in zip(dec.levels, joint.levels):
        assert lvl.pairs == []
        torch.testing.assert_close(lvl.logits.double(), manual_mlp(lvl.inputs, ind.base_scorer), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lvl.inputs, jl.inputs)  # same enriched inputs
        for a, b in jl.pairs:
            replaced = True
            assert not torch.allclose(jl.logits[a], lvl.logits[a])  # full adaptive replaced them
            assert not torch.allclose(jl.logits[b], lvl.logits[b])
    assert replaced


# ---------------------------------------------------------------------- parent constraint


def rigged(ctrl: HeadController) -> HeadController:
    """Scorers whose logits depend only on the level coordinate eta (input column 9).

    logits = [10, 0, 0, -10] * gelu(eta) + [0, 0, 0, 1]: level 0 (eta 0) picks index 3 (the full
    window), every upper level (eta > 0) picks index 0. The joint scorer does the same for both
    siblings (eta of u_a is its column 9 as well).
    """
    slope = torch.tensor([10.0, 0.0, 0.0, -10.0])
    for mlp, k in ((ctrl.base_scorer, K), (ctrl.joint_scorer, 2 * K)):
        mlp.weight0.zero_()
        mlp.bias0.zero_()
        mlp.weight0[0, 9] = 1.0
        mlp.weight1.zero_()
        mlp.weight1[:, 0] = slope.repeat(k // K)
        mlp.bias1.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]).repeat(k // K))
    return ctrl


def test_without_the_parent_constraint_a_child_exceeds_its_parents_index():
    feats = two_families(4)
    free = rigged(controller("no_parent_constraint")).decide(feats)
    clamped = rigged(controller("full_adaptive")).decide(feats)
    for dec in (free, clamped):
        assert dec.topology == (((0, 1), (2, 3)), ((0,), (1,)), ((0,), (1,)), ((0,), (1,)))
        assert dec.levels[0].raw_index.tolist() == [3, 3]
        assert all(lvl.raw_index.tolist() == [0, 0] for lvl in dec.levels[1:])
    # no clamp: the level-0 groups keep index 3 above their parents' 0
    assert free.levels[0].index.tolist() == [3, 3]
    assert free.levels[1].index.tolist() == [0, 0]
    assert free.head_index.tolist() == [3, 3, 3, 3]
    # with the paper's clamp min(c_raw, c_parent) they cannot
    assert clamped.levels[0].index.tolist() == [0, 0]
    assert clamped.head_index.tolist() == [0, 0, 0, 0]


def test_no_parent_constraint_is_full_adaptive_with_only_the_clamp_off():
    assert regimes.get("no_parent_constraint") == regimes.get("full_adaptive").replace(parent_constraint=False)
    assert regimes.get("independent_scoring") == regimes.get("full_adaptive").replace(scoring="independent")
    assert regimes.get("grouping_off") == ControllerConfig(
        grouping="per_head", hierarchy=(2,), scoring="independent", parent_constraint=False
    )


def test_enrich_reference_matches_the_controllers_inputs():
    # guards the hand-written reference above: eta, zero parent difference and size at the top
    feats = random_features(3, 7)
    u = enrich(feats, None, torch.full((3,), 1 / 3), 0.0)
    ctrl = controller("grouping_off", num_heads=3)
    torch.testing.assert_close(ctrl.decide(feats).levels[0].inputs, u)
