"""When the controller acts, what it keeps, and what it never touches (paper 5.3, 5.7-5.8, 7.1)."""

from __future__ import annotations

import math

import torch

from aah import GPT, GPTConfig, regimes
from aah.controller import ControllerConfig, HeadController

H, T, D = 4, 32, 8
FULL = (T,) * H


# ---------------------------------------------------------------------- helpers


def controller(config: ControllerConfig | None = None, **overrides) -> HeadController:
    cfg = config or ControllerConfig()
    if overrides:
        cfg = cfg.replace(**overrides)
    return HeadController(H, cfg, max_seq_len=T)


def random_qkv(seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, H, T, D, generator=g) for _ in range(3))


def peaked_qkv():
    """Every query puts (almost) all its mass on itself: entropy ~0, long-range usage ~0."""
    q = torch.zeros(1, H, T, D)
    q[..., 0] = 50.0
    k = torch.zeros(1, H, T, D)
    k[..., 0] = torch.arange(T, dtype=torch.float32)
    v = torch.randn(1, H, T, D, generator=torch.Generator().manual_seed(0))
    return q, k, v


def uniform_qkv():
    """Zero queries attend uniformly: entropy 1 and long-range usage well above 1/2."""
    q = torch.zeros(1, H, T, D)
    g = torch.Generator().manual_seed(1)
    return q, torch.randn(1, H, T, D, generator=g), torch.randn(1, H, T, D, generator=g)


def family_qkv(scales):
    """Zero queries, keys scaled per head, values shared: after z-scoring across heads only
    the key statistics differ, by the sign of (scale - mean scale)."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(1, 1, T, D, generator=g)
    k = base * torch.tensor(scales, dtype=torch.float32).view(1, H, 1, 1)
    v = torch.randn(1, 1, T, D, generator=g).expand(1, H, T, D)
    return torch.zeros(1, H, T, D), k, v


def run(ctrl: HeadController, step: int, qkv) -> tuple[int, ...]:
    ctrl.set_step(step)
    return ctrl.windows_for(*qkv)


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def count_updates(ctrl: HeadController) -> list[int]:
    calls: list[int] = []
    original = ctrl.control_update

    def spy(q, k, v):
        calls.append(ctrl.step)
        return original(q, k, v)

    ctrl.control_update = spy
    return calls


# ---------------------------------------------------------------------- schedule


def test_windows_stay_full_during_warmup():
    ctrl = controller(control_warmup=5, control_interval=2, scoring="fixed", fixed_window_index=0)
    for step in range(5):
        assert run(ctrl, step, random_qkv(step)) == FULL
    assert int(ctrl.num_updates) == 0
    assert not bool(ctrl.feature_ema_ready)
    # the first control step acts at once
    assert run(ctrl, 5, random_qkv(5)) == (4,) * H


def test_updates_happen_exactly_at_warmup_plus_multiples_of_interval():
    ctrl = controller(control_warmup=3, control_interval=4)
    calls = count_updates(ctrl)
    counts = []
    for step in range(20):
        run(ctrl, step, random_qkv(step))
        counts.append(int(ctrl.num_updates))
    assert calls == [3, 7, 11, 15, 19]
    assert counts == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5]
    assert int(ctrl.last_update_step) == 19


def test_cached_windows_are_reused_between_updates():
    # Simple policy: an update reads the diagnostics stored at the previous update. Feeding
    # the opposite kind of attention in between would change the windows if anything ran.
    ctrl = controller(
        regimes.get("simple_policy"), control_warmup=2, control_interval=3, diagnostics_context="full"
    )
    assert run(ctrl, 2, peaked_qkv()) == FULL  # first update: no diagnostics yet, full window
    state = snapshot(ctrl)
    for step in (3, 4):
        assert run(ctrl, step, uniform_qkv()) == FULL
    assert_same_state(state, snapshot(ctrl))
    assert run(ctrl, 5, uniform_qkv()) == (4,) * H  # peaked diagnostics: index 0
    state = snapshot(ctrl)
    for step in (6, 7):
        assert run(ctrl, step, peaked_qkv()) == (4,) * H
    assert_same_state(state, snapshot(ctrl))
    assert run(ctrl, 8, peaked_qkv()) == FULL  # uniform diagnostics: index 3
    assert int(ctrl.num_updates) == 3


def test_repeated_forwards_in_one_step_update_once():
    ctrl = controller(regimes.get("simple_policy"), control_warmup=0, control_interval=5)
    calls = count_updates(ctrl)
    assert run(ctrl, 0, peaked_qkv()) == FULL
    diag = ctrl.last_diagnostics.clone()
    # gradient accumulation: more micro-batches of the same step, different data
    for _ in range(3):
        assert ctrl.windows_for(*uniform_qkv()) == FULL
    assert calls == [0]
    assert int(ctrl.num_updates) == 1
    assert torch.equal(ctrl.last_diagnostics, diag)


def test_unset_step_never_updates():
    ctrl = controller(control_warmup=0, control_interval=1)
    fresh = snapshot(ctrl)
    assert ctrl.step == -1
    for seed in range(3):
        assert ctrl.windows_for(*random_qkv(seed)) == FULL
    assert_same_state(fresh, snapshot(ctrl))
    after_warmup = controller(control_warmup=2, topology="freeze_after_warmup")
    fresh = snapshot(after_warmup)
    after_warmup.windows_for(*random_qkv(0))
    assert_same_state(fresh, snapshot(after_warmup))


def test_evaluation_forwards_never_change_controller_state():
    cfg = GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=H, max_seq_len=T)
    torch.manual_seed(0)
    model = GPT(cfg, regimes.get("full_adaptive", control_warmup=1, control_interval=1))
    idx = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(0))
    model.set_step(1)
    model(idx)  # one real update so there is state to protect
    model.set_step(2)  # an update step
    model.eval()
    before = snapshot(model)
    with torch.no_grad():
        for seed in range(3):
            model(torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(seed + 1)))
    assert_same_state(before, snapshot(model))
    # the same step in training mode does act
    model.train()
    model(idx)
    assert all(int(c.num_updates) == 2 for c in model.controllers())


# ---------------------------------------------------------------------- topology policies


def policy_controller(topology: str, **overrides) -> HeadController:
    # feature EMA 0: the topology follows the current observation only; standardised features
    # so that the key scales of family_qkv decide level 0
    return controller(
        regimes.get("full_adaptive"),
        topology=topology,
        feature_ema=0.0,
        standardize_features=overrides.pop("standardize_features", True),
        control_warmup=overrides.pop("control_warmup", 0),
        control_interval=overrides.pop("control_interval", 1),
        **overrides,
    )


A, B = (1.0, 1.0, 3.0, 3.0), (1.0, 3.0, 1.0, 3.0)
GROUPS_A, GROUPS_B = ((0, 1), (2, 3)), ((0, 2), (1, 3))


def test_adaptive_topology_is_rebuilt_from_new_features():
    ctrl = policy_controller("adaptive")
    run(ctrl, 0, family_qkv(A))
    assert ctrl.cached_topology()[0] == GROUPS_A
    run(ctrl, 1, family_qkv(B))
    assert ctrl.cached_topology()[0] == GROUPS_B
    assert ctrl.last_decision.topology[0] == GROUPS_B


def test_frozen_topology_keeps_its_first_build():
    ctrl = policy_controller("frozen")
    run(ctrl, 0, family_qkv(A))
    first = ctrl.cached_topology()
    assert first[0] == GROUPS_A
    for step in (1, 2):
        run(ctrl, step, family_qkv(B))
        assert ctrl.cached_topology() == first
    assert int(ctrl.num_updates) == 3  # decisions still happen


def test_reuse_level0_keeps_level0_and_regrows_the_upper_levels():
    ctrl = policy_controller("reuse_level0")
    run(ctrl, 0, family_qkv(A))
    first = ctrl.cached_topology()
    # groups with key scales 1 and 3 differ in norm: they never merge
    assert first == (GROUPS_A, ((0,), (1,)), ((0,), (1,)), ((0,), (1,)))
    run(ctrl, 1, family_qkv(B))
    # level 0 kept although B would regroup; now both groups average scales 1 and 3, so their
    # features are identical and would merge into one parent: the reference stops before that
    # single-item level (upper_level_collapsed), our switch keeps it
    assert ctrl.cached_topology() == (GROUPS_A,)
    assert ctrl.last_stop_reason == "upper_level_collapsed"
    kept = policy_controller("reuse_level0", keep_collapsed_top=True)
    run(kept, 0, family_qkv(A))
    run(kept, 1, family_qkv(B))
    assert kept.cached_topology() == (GROUPS_A, ((0, 1),))


def test_freeze_after_warmup_observes_during_warmup_then_stops_rebuilding():
    ctrl = policy_controller("freeze_after_warmup", control_warmup=4, control_interval=2)
    assert run(ctrl, 0, family_qkv(A)) == FULL
    assert ctrl.cached_topology()[0] == GROUPS_A
    assert int(ctrl.num_updates) == 0
    assert run(ctrl, 1, family_qkv(B)) == FULL
    assert ctrl.cached_topology()[0] == GROUPS_A  # not an observation step
    assert run(ctrl, 2, family_qkv(B)) == FULL
    assert ctrl.cached_topology()[0] == GROUPS_B  # rebuilt while warming up
    run(ctrl, 4, family_qkv(A))
    assert int(ctrl.num_updates) == 1
    assert ctrl.cached_topology()[0] == GROUPS_B  # frozen from the warmup's end
    run(ctrl, 6, family_qkv(A))
    assert ctrl.cached_topology()[0] == GROUPS_B


# ---------------------------------------------------------------------- control regimes


def test_control_off_never_changes_windows():
    ctrl = controller(regimes.get("control_off"), control_warmup=0, control_interval=1)
    fresh = snapshot(ctrl)
    for step in range(6):
        assert run(ctrl, step, random_qkv(step)) == FULL
    assert_same_state(fresh, snapshot(ctrl))


def test_fixed_window_gives_every_head_the_chosen_candidate_after_warmup():
    ctrl = controller(regimes.get("fixed_window"), control_warmup=2, control_interval=1)
    assert [run(ctrl, s, random_qkv(s)) for s in range(2)] == [FULL, FULL]
    for step in range(2, 5):
        assert run(ctrl, step, random_qkv(step)) == (8,) * H  # candidate 1 of (4, 8, 16, 32)
    assert ctrl.resolution_index.tolist() == [1] * H


def test_simple_policy_keeps_the_full_window_until_diagnostics_exist():
    ctrl = controller(
        regimes.get("simple_policy"), control_warmup=0, control_interval=1, diagnostics_context="full"
    )
    assert not bool(ctrl.has_diagnostics)
    assert run(ctrl, 0, peaked_qkv()) == FULL
    assert bool(ctrl.has_diagnostics)
    assert run(ctrl, 1, uniform_qkv()) == (4,) * H
    # uniform rows: entropy 1, usage = mean over queries 4..31 of (i - 3) / (i + 1);
    # floor(4 * (1 + usage) / 2) = 3
    usage = sum((i - 3) / (i + 1) for i in range(4, 32)) / 28
    assert int(4 * (1 + usage) / 2) == 3
    torch.testing.assert_close(ctrl.last_diagnostics[:, 2], torch.full((H,), usage))
    assert run(ctrl, 2, peaked_qkv()) == FULL


def test_shuffle_post_select_permutes_the_per_head_indices():
    ctrl = controller(regimes.get("simple_policy"), shuffle_post_select=True)
    # entropy = usage = d gives index floor(4 d): heads ask for 0, 1, 2, 3
    demand = torch.tensor([0.1, 0.3, 0.6, 0.9])
    ctrl.last_diagnostics.copy_(torch.stack([demand, torch.ones(H), demand], dim=1))
    ctrl.has_diagnostics.fill_(True)
    seen = set()
    for n in range(6):
        ctrl.num_updates.fill_(n)
        dec = ctrl.decide()
        idx = dec.head_index.tolist()
        assert sorted(idx) == [0, 1, 2, 3]
        assert dec.windows == tuple((4, 8, 16, 32)[i] for i in idx)
        seen.add(tuple(idx))
    assert len(seen) > 1


def test_shuffle_post_select_keeps_the_multiset_of_joint_decisions():
    feats = torch.rand(H, 9, generator=torch.Generator().manual_seed(5)) * torch.arange(1, 5).view(
        H, 1
    )
    plain = controller(regimes.get("full_adaptive"))
    shuffled = controller(regimes.get("full_adaptive_shuffle_post_select"))
    a, b = plain.decide(feats), shuffled.decide(feats)
    assert a.topology == b.topology
    assert sorted(a.head_index.tolist()) == sorted(b.head_index.tolist())


# ---------------------------------------------------------------------- decide()


def test_decide_is_pure():
    ctrl = controller(control_warmup=0, control_interval=1)
    for step in range(3):
        run(ctrl, step, random_qkv(step))
    before = snapshot(ctrl)
    cache = dict(ctrl._window_cache)
    feats = torch.rand(H, 9, generator=torch.Generator().manual_seed(9))
    ctrl.decide()
    ctrl.decide(feats)
    assert_same_state(before, snapshot(ctrl))
    assert ctrl._window_cache == cache
    assert ctrl.current_windows(T) == tuple(before["windows"].tolist())


def _expected_logits(ctrl: HeadController, dec) -> list[torch.Tensor]:
    """Per level: base MLP logits, replaced by the joint MLP for consecutive sibling pairs."""

    def mlp(x, m):
        h = x.double() @ m.weight0.double().T + m.bias0.double()
        h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
        return h @ m.weight1.double().T + m.bias1.double()

    out = []
    topo = dec.topology
    for r, lvl in enumerate(dec.levels):
        u = lvl.inputs
        z = mlp(u, ctrl.base_scorer)
        families = (
            [list(range(len(topo[r])))] if r == len(topo) - 1 else [list(c) for c in topo[r + 1]]
        )
        for fam in families:
            for i in range(0, len(fam) - 1, 2):
                a, b = fam[i], fam[i + 1]
                j = mlp(torch.cat([u[a], u[b], u[a] - u[b], u[b] - u[a]]), ctrl.joint_scorer)
                z[a], z[b] = j[:4], j[4:]
        out.append(z)
    return out


def test_decide_exposes_every_levels_groups_parents_and_indices():
    g = torch.Generator().manual_seed(12)
    ctrl = HeadController(8, ControllerConfig(), max_seq_len=64)
    feats = torch.rand(8, 9, generator=g) * torch.tensor([1, 1, 1, 1, 4, 4, 4, 4.0]).view(8, 1)
    dec = ctrl.decide(feats)
    topo = dec.topology
    assert len(dec.levels) == len(topo) == dec.levels_used
    expected_logits = _expected_logits(ctrl, dec)
    top = len(topo) - 1
    for r, lvl in enumerate(dec.levels):
        assert lvl.items == topo[r]
        if r == top:
            assert lvl.parents is None
        else:
            assert lvl.parents == [
                next(p for p, ch in enumerate(topo[r + 1]) if i in ch) for i in range(len(topo[r]))
            ]
        torch.testing.assert_close(lvl.logits.double(), expected_logits[r], atol=1e-5, rtol=1e-5)
        assert lvl.raw_index.tolist() == lvl.logits.argmax(dim=-1).tolist()
        if r == top:
            assert lvl.index.tolist() == lvl.raw_index.tolist()
        else:
            parent_index = dec.levels[r + 1].index
            assert lvl.index.tolist() == [
                min(int(lvl.raw_index[i]), int(parent_index[p])) for i, p in enumerate(lvl.parents)
            ]
    head = [None] * 8
    for gidx, heads in enumerate(topo[0]):
        for h in heads:
            head[h] = int(dec.levels[0].index[gidx])
    assert dec.head_index.tolist() == head
    # full-window start and beta .15: the smoothed index is the new one
    assert dec.smoothed_index.tolist() == head
    cands = (8, 16, 32, 64)
    assert dec.windows == tuple(cands[c] for c in head)


def test_commit_executes_the_decision_that_decide_returned():
    ctrl = controller(control_warmup=0, control_interval=1)
    qkv = random_qkv(3)
    expected = ctrl.decide(ctrl.observe(*qkv).clone())  # observe on a twin to know the features
    twin = controller(control_warmup=0, control_interval=1)
    assert run(twin, 0, qkv) == expected.windows
    assert twin.windows.tolist() == list(expected.windows)
    assert twin.resolution_index.tolist() == expected.smoothed_index.tolist()


# ---------------------------------------------------------------------- checkpointed state


CFG = GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=H, max_seq_len=T, backend="dense")


def _adaptive_model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG, regimes.get("full_adaptive", control_warmup=1, control_interval=2))


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(100 + step))


def _steps(model: GPT, steps) -> list[list[list[int]]]:
    out = []
    with torch.no_grad():
        for step in steps:
            model.set_step(step)
            model(_batch(step))
            out.append(model.aah_windows().tolist())
    return out


def test_controller_state_survives_a_state_dict_round_trip():
    trained = _adaptive_model(0)
    _steps(trained, range(5))  # updates at 1 and 3
    state = {k: v.clone() for k, v in trained.state_dict().items()}
    restored = _adaptive_model(0)
    restored.aah_windows()  # fill the window cache before loading
    restored.load_state_dict(state)
    assert torch.equal(restored.aah_windows(), trained.aah_windows())
    for a, b in zip(trained.controllers(), restored.controllers()):
        assert_same_state(snapshot(a), snapshot(b))
        assert a.cached_topology() == b.cached_topology()
    # the restored controller knows it already acted at step 3
    restored.set_step(3)
    with torch.no_grad():
        restored(_batch(3))
    assert [int(c.num_updates) for c in restored.controllers()] == [2, 2]
    # and it goes on exactly like the original
    assert _steps(restored, range(5, 10)) == _steps(trained, range(5, 10))
    for a, b in zip(trained.controllers(), restored.controllers()):
        assert_same_state(snapshot(a), snapshot(b))


def test_controller_state_lives_under_aah_state_keys():
    model = _adaptive_model(0)
    params = dict(model.named_parameters(remove_duplicate=False))
    extra = [k for k in model.state_dict() if k not in params]
    assert extra, "the controllers keep buffers"
    assert all(".aah_state." in k for k in extra)
    for i, ctrl in enumerate(model.controllers()):
        for name in ctrl.state_dict():
            assert f"blocks.{i}.attn.aah_state.{name}" in model.state_dict()
    expected = {
        "feature_ema",
        "feature_ema_ready",
        "last_diagnostics",
        "has_diagnostics",
        "topology",
        "resolution_index",
        "windows",
        "last_update_step",
        "num_updates",
        "candidate_windows",
    }
    assert expected <= set(model.controllers()[0].state_dict())


def test_warmup_runs_full_attention_even_with_a_short_candidate_list():
    ctrl = HeadController(H, ControllerConfig(windows=(4, 8, 16)), max_seq_len=T)
    ctrl.set_step(0)
    assert ctrl.windows_for(*random_qkv(0)) == FULL
