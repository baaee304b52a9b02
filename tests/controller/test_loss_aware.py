"""The recall suite's policies: loss_aware (aah.controller.loss_aware) and the full_heads layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from aah import regimes
from aah.controller.budget import budget_capacity, full_heads_choice, window_costs
from aah.controller.loss_aware import fisher_cost, window_output_change
from aah.model import GPT, GPTConfig
from aah.windows import causal_pairs

WINDOWS = (8, 16, 32, 64)
T = 64


def test_window_output_change_matches_reference_attention(ref_attention):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, T, 8) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped-query: 2 KV heads for 4 query heads
    pos = torch.tensor([5, 20, 40, 63])
    got = window_output_change(q, k, v, pos, WINDOWS)
    full = ref_attention(q, k, v, [T] * 4)
    for c, w in enumerate(WINDOWS):
        want = (ref_attention(q, k, v, [w] * 4) - full)[:, :, pos]
        torch.testing.assert_close(got[:, :, :, c].double(), want, atol=1e-5, rtol=1e-4)
    assert (got[:, :, 0, 1:] == 0).all()  # position 5 sees fewer than 8 keys: no cut at all


def test_fisher_cost_is_half_mean_squared_projection():
    torch.manual_seed(1)
    g = torch.randn(3, 2, 5, 4)
    d = torch.randn(3, 2, 5, 6, 4)
    want = torch.zeros(2, 6)
    for h in range(2):
        for c in range(6):
            want[h, c] = 0.5 * torch.stack([(g[b, h, s] @ d[b, h, s, c]) ** 2 for b in range(3) for s in range(5)]).mean()
    torch.testing.assert_close(fisher_cost(g, d), want)


@pytest.mark.parametrize("budget", [0.3, 0.45, 0.6, 1.0])
def test_full_heads_layout_fits_the_budget_and_fills_heads_in_order(budget):
    costs = window_costs([128, 256, 512, 1024], 1024)
    choice = full_heads_choice(costs, budget, 8, 1024)
    assert sum(costs[c] for c in choice) <= budget_capacity(budget, 8, 1024)
    assert choice == sorted(choice, reverse=True)  # earlier heads never get less than later ones
    # no head could take a larger window without breaking the budget (greedy is maximal)
    for c in choice:
        if c + 1 < len(costs):
            bigger = sum(costs[x] for x in choice) - costs[c] + costs[c + 1]
            assert bigger > budget_capacity(budget, 8, 1024)
    if budget == 0.45:  # the suite's setting: two full heads, six at T/8 (causal coverage 0.4257)
        assert choice == [3, 3, 0, 0, 0, 0, 0, 0]


def _model(regime: str, **overrides) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, n_layers=2, d_model=32, n_heads=4, max_seq_len=T)
    ctrl = regimes.get(regime, windows=WINDOWS, control_warmup=2, control_interval=2, **overrides)
    return GPT(cfg, ctrl)


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = a.argsort().argsort(), b.argsort().argsort()
    return float(np.corrcoef(ra, rb)[0, 1])


@pytest.mark.slow
def test_loss_aware_cost_ranks_windows_like_the_true_kl():
    """The empirical-Fisher cost of each (head, window) ranks the cuts as the KL divergence
    they really cause does (cut one head of one layer, all else full)."""
    model = _model("loss_aware", budget=0.45)
    gen = torch.Generator().manual_seed(3)
    # Text with structure: a random sequence repeated, so some heads must look far back.
    base = torch.randint(0, 32, (4, T // 4), generator=gen)
    x_all = torch.cat([base, base, base, base], dim=1)
    x, y = x_all[:, :-1], x_all[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(60):  # a short training run: the controller decides from step 2 on
        model.set_step(step)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ctrls = model.controllers()
    assert all(bool(c.loss_cost_ready) for c in ctrls)
    seq = x.shape[1]
    for c in ctrls:  # every decision respects the budget
        assert sum(causal_pairs(min(w, seq), seq) for w in c.current_windows(seq)) <= budget_capacity(0.45, 4, seq)
    # One fresh measurement under full windows, then the true KL of every single-head cut.
    for c in ctrls:
        c.pin_windows((T,) * 4)
    model.eval()
    with torch.no_grad():
        full_logp = F.log_softmax(model(x)[0].float(), -1)
    estimate, truth = [], []
    for c in ctrls:
        # Measure: prepare the output change on this layer, then read the gradient of the real loss.
        model.train()
        model.set_step(-1)  # no control step: windows stay pinned
        original = c.windows_for

        def windows_for(q, k, v, c=c, original=original):
            c.prepare_loss_cost(q, k, v)
            return original(q, k, v)

        c.windows_for = windows_for
        c.loss_cost_ready.fill_(False)
        _, loss = model(x, y)
        model.zero_grad()
        loss.backward()
        c.windows_for = original
        est = c.loss_cost.clone()
        model.eval()
        for h in range(4):
            for wi, w in enumerate(WINDOWS[:-1]):
                c.pin_windows(tuple(w if i == h else T for i in range(4)))
                with torch.no_grad():
                    cut_logp = F.log_softmax(model(x)[0].float(), -1)
                kl = (full_logp.exp() * (full_logp - cut_logp)).sum(-1).mean()
                truth.append(float(kl))
                estimate.append(float(est[h, wi]))
        c.pin_windows((T,) * 4)
    rho = _spearman(np.array(estimate), np.array(truth))
    assert rho > 0.8, rho
