"""The budgeted policies on a running model: budget honoured, lost mass kept, saved, solved exactly."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from aah import GPT, GPTConfig, regimes
from aah.config import ConfigError, load_config
from aah.controller import HeadController
from aah.controller import controller as controller_module
from aah.controller.budget import budget_capacity, window_costs
from aah.controller.budgeted import lost_mass_metrics
from aah.controller.lost_mass import lost_mass
from aah.windows import causal_coverage

VOCAB, LAYERS, D_MODEL, HEADS, T = 64, 2, 32, 4, 32
WINDOWS = (4, 8, 16, 32)


def small_model(regime: str, *, kv_heads: int | None = None, **overrides) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, n_layers=LAYERS, d_model=D_MODEL, n_heads=HEADS, max_seq_len=T,
                    n_kv_heads=kv_heads)
    settings = dict(control_warmup=1, control_interval=2, windows=WINDOWS)
    settings.update(overrides)
    return GPT(cfg, regimes.get(regime, **settings))


def run_steps(model: GPT, steps: int) -> None:
    model.train()
    for step in range(steps):
        model.set_step(step)
        idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(step))
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()


def brute_force_lost(lost: np.ndarray, capacity: int, costs: list[int]) -> float:
    best = np.inf
    for choice in itertools.product(range(lost.shape[1]), repeat=lost.shape[0]):
        if sum(costs[c] for c in choice) <= capacity:
            best = min(best, sum(lost[i, c] for i, c in enumerate(choice)))
    return best


def chosen_lost(ctrl: HeadController) -> float:
    idx = ctrl.resolution_index.cpu()
    return float(ctrl.lost_mass.double().gather(1, idx[:, None]).sum())


@pytest.mark.parametrize("budget", [0.3, 0.5, 0.8])
def test_budgeted_layer_windows_are_the_exact_optimum_within_budget(budget):
    model = small_model("budgeted", budget=budget)
    run_steps(model, 6)  # control updates at steps 1, 3, 5
    costs = window_costs(WINDOWS, T)
    for ctrl in model.controllers():
        assert int(ctrl.num_updates) == 3
        windows = ctrl.current_windows(T)
        assert causal_coverage(windows, T) <= budget + 1e-12
        expected = brute_force_lost(ctrl.lost_mass.double().numpy(), budget_capacity(budget, HEADS, T), costs)
        assert chosen_lost(ctrl) == pytest.approx(expected, abs=1e-9)


def test_lost_mass_is_an_ema_over_control_updates_and_free_in_between(monkeypatch):
    model = small_model("budgeted", budget=0.5, lost_mass_ema=0.75)
    calls = []
    seen: dict[int, list[torch.Tensor]] = {}

    def recording(q, k, windows, **kwargs):
        out = lost_mass(q, k, windows, **kwargs)
        seen.setdefault(len(calls) % LAYERS, []).append(out)  # layers run in order
        calls.append(len(calls))
        return out

    monkeypatch.setattr(controller_module, "measure_lost_mass", recording)
    run_steps(model, 5)  # steps 0 (warmup), 1 (update), 2 (between), 3 (update), 4 (between)
    assert len(calls) == 2 * LAYERS  # only on the two control updates
    for layer, ctrl in enumerate(model.controllers()):
        first, second = seen[layer]
        torch.testing.assert_close(ctrl.lost_mass, 0.75 * first + 0.25 * second)
        assert bool(ctrl.lost_mass_ready)


def test_every_controller_regime_records_lost_mass_and_it_is_saved_and_loaded():
    model = small_model("full_adaptive")
    run_steps(model, 4)
    state = model.state_dict()
    assert "blocks.0.attn.aah_state.lost_mass" in state
    assert "blocks.1.attn.aah_state.lost_mass_ready" in state
    fresh = small_model("full_adaptive")
    fresh.load_state_dict(state)
    for a, b in zip(model.controllers(), fresh.controllers()):
        torch.testing.assert_close(a.lost_mass, b.lost_mass)
        assert bool(b.lost_mass_ready)
    assert model.controllers()[0].lost_mass.shape == (HEADS, len(WINDOWS))


def test_budgeted_windows_survive_save_and_load_and_eval_changes_nothing():
    model = small_model("budgeted", budget=0.5)
    run_steps(model, 4)
    before = model.aah_windows().clone()
    fresh = small_model("budgeted", budget=0.5)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.aah_windows(), before)
    fresh.eval()
    fresh.set_step(5)
    with torch.no_grad():
        fresh(torch.zeros(1, T, dtype=torch.long))
    assert torch.equal(fresh.aah_windows(), before)


def test_model_scope_solves_once_for_all_layers():
    budget = 0.5
    model = small_model("budgeted", budget=budget, budget_scope="model")
    run_steps(model, 2)  # one control update at step 1: windows apply after its forward
    ctrls = model.controllers()
    assert all(int(c.num_updates) == 1 and not c.budget_pending for c in ctrls)
    windows = model.aah_windows(T)
    assert causal_coverage(windows, T) <= budget + 1e-12
    table = np.concatenate([c.lost_mass.double().numpy() for c in ctrls])
    expected = brute_force_lost(table, budget_capacity(budget, LAYERS * HEADS, T), window_costs(WINDOWS, T))
    assert sum(chosen_lost(c) for c in ctrls) == pytest.approx(expected, abs=1e-9)


def test_budgeted_grouped_honours_budget_and_parent_clamp():
    budget = 0.5
    model = small_model("budgeted_grouped", budget=budget)
    run_steps(model, 4)
    for ctrl in model.controllers():
        windows = ctrl.current_windows(T)
        assert causal_coverage(windows, T) <= budget + 1e-12
        topology = ctrl.cached_topology()
        assert topology and ctrl.levels_used() == len(topology)
        # The level-0 group is the unit of decision: its heads share one window. (The parent
        # clamp itself is checked on a hand-worked example below.)
        index = ctrl.resolution_index.tolist()
        for group in topology[0]:
            assert len({index[h] for h in group}) == 1


def test_budgeted_grouped_is_no_better_than_per_head_budgeted():
    # The per-head knapsack is the relaxation of the grouped one: on the same lost-mass table
    # it loses at most as much.
    model = small_model("budgeted_grouped", budget=0.5)
    run_steps(model, 4)
    costs = window_costs(WINDOWS, T)
    for ctrl in model.controllers():
        best = brute_force_lost(ctrl.lost_mass.double().numpy(), budget_capacity(0.5, HEADS, T), costs)
        assert chosen_lost(ctrl) >= best - 1e-9


def test_uniform_window_and_exact_mix():
    model = small_model("uniform_window", budget=0.5)
    run_steps(model, 2)
    costs = window_costs(WINDOWS, T)
    full = T * (T + 1) // 2
    largest = max(w for w, c in zip(WINDOWS, costs) if c / full <= 0.5)
    assert model.aah_windows(T).unique().tolist() == [largest]
    exact = small_model("uniform_window", budget=0.5, uniform_exact=True)
    run_steps(exact, 2)
    for row in exact.aah_windows(T).tolist():
        assert causal_coverage(row, T) <= 0.5
        bigger = [w for w in row if w > largest]
        assert row == bigger + [largest] * (HEADS - len(bigger))  # the first heads take the larger window
        if len(bigger) < HEADS:
            nxt = WINDOWS[WINDOWS.index(largest) + 1]
            assert causal_coverage([nxt] * (len(bigger) + 1) + [largest] * (HEADS - len(bigger) - 1), T) > 0.5


def test_kv_group_granularity_gives_one_window_per_kv_group():
    model = small_model("budgeted", kv_heads=2, budget=0.5, window_granularity="kv_group")
    run_steps(model, 2)
    costs = window_costs(WINDOWS, T)
    for ctrl in model.controllers():
        w = ctrl.current_windows(T)
        assert w[0] == w[1] and w[2] == w[3]
        assert causal_coverage(w, T) <= 0.5
        grouped = ctrl.lost_mass.double().view(2, 2, -1).sum(1).numpy()
        pair_costs = [2 * c for c in costs]
        expected = brute_force_lost(grouped, budget_capacity(0.5, HEADS, T), pair_costs)
        assert chosen_lost(ctrl) == pytest.approx(expected, abs=1e-9)


def test_budget_below_the_smallest_window_is_a_config_error(tmp_path):
    low = 0.1
    with pytest.raises(ValueError, match=r"0\.1 is below the causal coverage 0\.\d+ of the smallest window 4"):
        small_model("budgeted", budget=low)
    with pytest.raises(ValueError, match="budget"):
        regimes.get("budgeted", budget=1.5)
    with pytest.raises(ValueError, match="window_granularity"):
        regimes.get("budgeted", window_granularity="group")
    with pytest.raises(ConfigError, match=r"aah\.budget: 0\.05 is below the causal coverage 0\.2343 of the "
                                          r"smallest window 128"):
        load_config(Path("configs/cpu/budgeted.yaml"), ["aah.budget=0.05"])
    out = subprocess.run(
        [sys.executable, "-m", "aah.cli", "train", "configs/cpu/budgeted.yaml", "aah.budget=0.05",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "0.05" in out.stderr and "0.2343" in out.stderr and "Traceback" not in out.stderr


def test_budgeted_grouped_layout_errors_name_the_field_in_the_api_and_the_cli(tmp_path):
    with pytest.raises(ValueError, match=r"controller\.budget_scope: budgeted_grouped decides per layer.*'model'"):
        small_model("budgeted_grouped", budget=0.5, budget_scope="model")
    with pytest.raises(ValueError, match=r"controller\.window_granularity: .*4 heads, 2 KV heads"):
        small_model("budgeted_grouped", budget=0.5, window_granularity="kv_group", kv_heads=2)
    small_model("budgeted_grouped", budget=0.5, window_granularity="kv_group")  # MHA: one head per group
    small_model("budgeted", budget=0.5, window_granularity="kv_group", kv_heads=2)
    with pytest.raises(ConfigError, match=r"aah\.budget_scope: budgeted_grouped"):
        load_config(Path("configs/cpu/budgeted_grouped.yaml"), ["aah.budget_scope=model"])
    with pytest.raises(ConfigError, match=r"aah\.window_granularity: .*8 heads, 2 KV heads"):
        load_config(Path("configs/cpu/budgeted_grouped.yaml"), ["aah.window_granularity=kv_group",
                                                                "model.n_kv_heads=2"])
    out = subprocess.run(
        [sys.executable, "-m", "aah.cli", "train", "configs/cpu/budgeted_grouped.yaml", "aah.budget_scope=model",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "aah.budget_scope" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_lost_mass_metrics_average_the_tables_and_the_chosen_windows_by_hand():
    model = small_model("budgeted", budget=0.5)
    first, second = model.controllers()
    assert lost_mass_metrics([first, second]) == {}  # nothing measured yet
    first.lost_mass.copy_(torch.tensor([[0.8, 0.4, 0.2, 0.0]] * 2 + [[0.6, 0.2, 0.0, 0.0]] * 2))
    first.lost_mass_ready.fill_(True)
    assert lost_mass_metrics([first, second]) == {}  # one layer not measured yet
    second.lost_mass.copy_(torch.tensor([[0.4, 0.2, 0.1, 0.0]] * 4))
    second.lost_mass_ready.fill_(True)
    first.pin_windows((4, 8, 16, 32))  # candidate indices 0, 1, 2, 3
    metrics = lost_mass_metrics([first, second])  # the second layer has not decided: full windows
    assert metrics["lost_mass"] == [pytest.approx([0.7, 0.3, 0.1, 0.0]), pytest.approx([0.4, 0.2, 0.1, 0.0])]
    # layer 0 loses 0.8, 0.4, 0.0, 0.0 at windows 4, 8, 16, 32; layer 1 keeps every window full.
    assert metrics["lost_mass_chosen_per_layer"] == pytest.approx([0.3, 0.0])
    assert metrics["lost_mass_chosen"] == pytest.approx(0.15)


TEXT = "Now is the winter of our discontent made glorious summer by this sun of York. " * 40


@pytest.mark.slow
def test_torchrun_ranks_agree_on_model_scope_budget(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(TEXT + f" part {i}\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("{}\n")
    overrides = [
        "aah.regime=budgeted", "aah.budget=0.5", "aah.budget_scope=model",
        "model.n_layers=2", "model.d_model=32", "model.n_heads=4",
        f"data.corpus={corpus}", "data.seq_len=32", f"data.cache_dir={tmp_path / 'cache'}",
        "data.val_fraction=0.3", "train.max_steps=6", "train.batch_size=4", "train.checkpoint_every=0",
        "train.device=cpu", "aah.windows=[8,16,32]", "aah.control_warmup=2", "aah.control_interval=2",
        "eval.every=0", "log.every=1", "log.tensorboard=false", "log.progress=false",
    ]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(port), "-m", "aah.cli", "train", str(cfg), *overrides,
           "--out", str(tmp_path / "ddp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(x) for x in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in records if r["kind"] == "train"]
    assert all(r["ranks_agree"] for r in train_rows)
    assert train_rows[-1]["causal_coverage"] <= 0.5
    assert len(train_rows[-1]["lost_mass_chosen_per_layer"]) == 2


def test_grouped_knapsack_hand_example_shows_the_parent_clamp():
    # Two heads at T = 32; budget 0.62 allows 654 pairs: (32, 4) costs 650, (16, 16) costs 784.
    # Head 0 needs long range, head 1 needs none. Per head: head 0 gets 32, head 1 gets 4.
    # Grouped: the top group (both heads) can only afford 8 for each head, and the clamp keeps
    # both heads at <= 8 below it; head 0 takes 8, head 1 the cheaper 4.
    from aah.controller.budgeted import budget_head_index, grouped_budget_head_index

    cfg = regimes.get("budgeted_grouped", budget=0.62, windows=WINDOWS)
    ctrl = HeadController(2, cfg, max_seq_len=T)
    ctrl.lost_mass.copy_(torch.tensor([[0.9, 0.8, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    ctrl.lost_mass_ready.fill_(True)
    topology = (((0,), (1,)), ((0, 1),))
    assert grouped_budget_head_index(ctrl, topology).tolist() == [1, 0]
    assert budget_head_index(ctrl).tolist() == [3, 0]
