import pytest
import torch

from aah.windows import acr, band_mask, candidate_windows, causal_coverage


def test_band_mask_matches_hand_worked_example():
    mask = band_mask(torch.tensor([1, 2, 10]), 4)
    eye = torch.eye(4, dtype=torch.bool)
    assert torch.equal(mask[0], eye)
    two = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(mask[1], two)
    assert torch.equal(mask[2], torch.ones(4, 4, dtype=torch.bool).tril())


def test_acr_and_causal_coverage_paper_ladder():
    w = torch.tensor([512, 1024, 2048, 4096])
    assert acr(w, 4096) == pytest.approx(0.46875)
    # sum_i min(i+1, W) per head over T(T+1)/2, computed by hand-written loop
    t = 4096
    pairs = sum(sum(min(i + 1, x) for i in range(t)) for x in w.tolist())
    assert causal_coverage(w, t) == pytest.approx(pairs / (4 * t * (t + 1) / 2))
    assert causal_coverage(w, t) == pytest.approx(0.6054, abs=1e-4)


def test_coverage_counts_mask_entries():
    w = torch.tensor([1, 3, 7, 100])
    t = 9
    m = band_mask(w, t)
    assert causal_coverage(w, t) == pytest.approx(m.sum().item() / (4 * t * (t + 1) / 2))


def test_layer_by_head_windows_average_over_everything():
    w = torch.tensor([[4, 8], [8, 8]])
    assert acr(w, 8) == pytest.approx((0.5 + 1 + 1 + 1) / 4)


def test_full_windows_give_unit_coverage():
    assert acr([16, 99], 16) == 1.0
    assert causal_coverage([16, 99], 16) == 1.0


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.tensor([0, 4]), "positive"),
        (torch.tensor([-3]), "positive"),
        (torch.tensor([1.0, 2.0]), "integer dtype"),
        (torch.ones(2, 2, 2, dtype=torch.long), "1-D"),
        (torch.tensor([], dtype=torch.long), "empty"),
    ],
)
def test_bad_windows_are_rejected_with_a_reason(bad, match):
    with pytest.raises(ValueError, match=match):
        acr(bad, 8)


def test_bad_seq_len_is_rejected():
    with pytest.raises(ValueError, match="seq_len"):
        causal_coverage([2], 0)


def test_candidate_ladder():
    assert candidate_windows(4096) == (512, 1024, 2048, 4096)
    assert candidate_windows(1024) == (128, 256, 512, 1024)
    with pytest.raises(ValueError):
        candidate_windows(4, num=4)


def test_sink_tokens_hand_worked_mask():
    # W = 2, S = 1, T = 5: every row sees its last two keys and key 0.
    mask = band_mask([2], 5, sink_tokens=1)[0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 0, 1, 1, 0],
            [1, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("window,sinks,t", [(1, 1, 6), (2, 3, 9), (4, 2, 4), (3, 10, 7), (5, 0, 12), (1, 4, 30)])
def test_sink_coverage_counts_the_mask(window, sinks, t):
    # An independent count: loop over every (i, j) pair with the convention written out.
    allowed = sum(1 for i in range(t) for j in range(i + 1) if i - window < j or j < sinks)
    assert causal_coverage([window], t, sink_tokens=sinks) == pytest.approx(allowed / (t * (t + 1) / 2))
    assert band_mask([window], t, sink_tokens=sinks).sum().item() == allowed
    assert acr([window], t, sink_tokens=sinks) == pytest.approx(min(window + sinks, t) / t)


def test_sink_tokens_must_be_non_negative_ints():
    with pytest.raises(ValueError, match="sink_tokens"):
        band_mask([2], 4, sink_tokens=-1)
    with pytest.raises(ValueError, match="sink_tokens"):
        causal_coverage([2], 4, sink_tokens=1.5)


def test_visible_by_hand():
    from aah.windows import visible

    keys = torch.arange(8)
    assert visible(5, keys, 3).nonzero().flatten().tolist() == [3, 4, 5]  # i - W < j <= i
    assert visible(5, keys, 3, sinks=2).nonzero().flatten().tolist() == [0, 1, 3, 4, 5]
    # Left padding before position 1: the sinks are the first two real tokens, padding never read.
    assert visible(5, keys, 3, sinks=2, first_real=1).nonzero().flatten().tolist() == [1, 2, 3, 4, 5]
    assert visible(5, keys, 9, first_real=2).nonzero().flatten().tolist() == [2, 3, 4, 5]
    # Per-row first_real and per-head windows broadcast: (rows, heads, keys).
    rows = visible(4, keys[None, None, :], torch.tensor([[1], [2]])[None], 1, torch.tensor([0, 3])[:, None, None])
    assert rows.shape == (2, 2, 8)
    assert rows[0, 0].nonzero().flatten().tolist() == [0, 4] and rows[1, 1].nonzero().flatten().tolist() == [3, 4]


def test_cut_off_by_hand():
    from aah.windows import cut_off

    keys = torch.arange(8)
    assert cut_off(5, keys, 3).nonzero().flatten().tolist() == [0, 1, 2]  # j <= i - W
    assert cut_off(5, keys, 3, sinks=2).nonzero().flatten().tolist() == [2]  # sinks are never cut
    assert not cut_off(5, keys, 6).any() and not cut_off(2, keys, 3).any()  # the window reaches key 0
    assert cut_off(5, keys, 1).nonzero().flatten().tolist() == [0, 1, 2, 3, 4]  # all but the query itself
    # (query, key) grids and per-head windows broadcast: (heads, queries, keys).
    grid = cut_off(torch.tensor([3, 4])[:, None], keys[None, :4], torch.tensor([1, 2])[:, None, None])
    assert grid.tolist() == [
        [[True, True, True, False], [True, True, True, True]],
        [[True, True, False, False], [True, True, True, False]],
    ]


def test_visible_among_a_padded_packed_row_by_hand():
    from aah.windows import visible_among

    doc = torch.tensor([-1, 0, 0, 0, 1, 1])  # position 0 is padding, then two documents
    seen = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0) & torch.ones(6, 6, dtype=torch.bool).tril()
    rows = visible_among(seen[None], [2, 1], sinks=1).int().tolist()
    assert rows[0] == [  # W = 2, one sink per document
        [1, 0, 0, 0, 0, 0],  # padding sees nothing and is given key 0
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],  # its window {2, 3} and its document's first token
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]
    assert rows[1] == [  # W = 1
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 1, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]
    assert visible_among(seen[None], [2])[0, 3].int().tolist() == [0, 0, 1, 1, 0, 0]  # no sinks


def test_layer_rule_by_hand():
    from aah.windows import layer_rule

    assert layer_rule([4, 16, 64], 2, None) == ((4, 16, 64), 2)
    assert layer_rule([4, 16, 64], 2, 0) == ((4, 16, 64), 2)  # <= 0: the layer has no window of its own
    assert layer_rule([4, 16, 64], 2, 16) == ((4, 16, 16), 0)  # capped, and no sinks beyond the window


def test_kv_group_reach_by_hand():
    from aah.windows import kv_group_reach

    assert kv_group_reach([4, 8, 4, 32], 2) == (8, 32)
    assert kv_group_reach([4, 8, 4, 32], 4) == (4, 8, 4, 32)
    assert kv_group_reach([3, 1, 2], 1) == (3,)
    with pytest.raises(ValueError, match="cannot be split"):
        kv_group_reach([4, 8, 4, 32], 3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_group_reach([4, 8], 0)
