"""The far-cost warm-up trigger (aah.controller.warmup): hand-set cost tables decide when control starts."""

import pytest
import torch

from aah.controller.config import ControllerConfig
from aah.controller.controller import HeadController
from aah.controller.warmup import far_cost, settle_warmup
from aah.model import GPT, GPTConfig
from aah.regimes import get as get_regime


def _controller(threshold=0.15, cap=None, warmup=10, layer=0, patience=0):
    cfg = get_regime("loss_aware").replace(
        windows=(4, 8, 16), budget=0.5, control_warmup=warmup, control_interval=5,
        warmup_trigger="far_cost", far_cost_threshold=threshold, warmup_max_steps=cap,
        far_cost_patience=patience,
    )
    return HeadController(4, cfg, max_seq_len=16, layer_idx=layer)


def _set_costs(ctrl, far):
    ctrl.loss_cost.zero_()
    ctrl.loss_cost[:, -2] = torch.tensor(far)
    ctrl.loss_cost_ready.fill_(True)


def test_far_cost_is_the_largest_head_cost_at_the_second_largest_window():
    ctrl = _controller()
    assert far_cost(ctrl) == 0.0  # nothing measured yet
    _set_costs(ctrl, [0.01, 0.30, 0.02, 0.0])
    ctrl.loss_cost[0, 0] = 5.0  # the smallest window's cost is not the far cost
    assert far_cost(ctrl) == pytest.approx(0.30)


def test_warmup_ends_for_all_layers_when_one_layer_crosses_the_threshold_on_the_grid():
    a, b = _controller(layer=0), _controller(layer=1)
    _set_costs(a, [0.01, 0.02, 0.0, 0.0])
    _set_costs(b, [0.01, 0.02, 0.0, 0.0])
    assert settle_warmup([a, b], 10) is None  # below threshold
    assert a.warmup_steps is None and not a.control_due()
    _set_costs(b, [0.0, 0.2, 0.0, 0.0])
    assert settle_warmup([a, b], 12) is None  # off the control grid (10, 15, ...)
    assert settle_warmup([a, b], 15) == 15
    assert a.warmup_steps == b.warmup_steps == 15
    a.set_step(15)
    assert a.control_due()
    a.set_step(17)
    assert not a.control_due()
    a.set_step(20)
    assert a.control_due()
    assert settle_warmup([a, b], 20) is None  # ended once


def test_the_cap_ends_the_warmup_without_any_cost():
    ctrl = _controller(cap=23)
    assert settle_warmup([ctrl], 22) is None
    assert settle_warmup([ctrl], 23) == 23
    assert ctrl.warmup_steps == 23


def test_the_steps_trigger_keeps_the_reference_schedule():
    cfg = get_regime("loss_aware").replace(windows=(4, 8, 16), budget=0.5, control_warmup=10, control_interval=5)
    ctrl = HeadController(4, cfg, max_seq_len=16)
    assert ctrl.warmup_steps == 10 and "warmup_end" not in ctrl.state_dict()
    assert settle_warmup([ctrl], 10) is None


@pytest.mark.parametrize("changes, field", [
    ({"warmup_trigger": "loss"}, "warmup_trigger"),
    ({"warmup_trigger": "far_cost", "scoring": "budgeted", "budget": 0.5}, "warmup_trigger"),
    ({"warmup_trigger": "far_cost", "far_cost_threshold": 0.0}, "far_cost_threshold"),
    ({"warmup_trigger": "far_cost", "warmup_max_steps": 5}, "warmup_max_steps"),
    ({"warmup_trigger": "far_cost", "far_cost_patience": -5}, "far_cost_patience"),
    ({"warmup_trigger": "far_cost", "far_cost_patience": 2.5}, "far_cost_patience"),
])
def test_bad_settings_name_the_field(changes, field):
    base = {"scoring": "loss_aware", "grouping": "per_head", "budget": 0.5, "control_warmup": 10}
    with pytest.raises(ValueError, match=f"controller.{field}"):
        ControllerConfig(**{**base, **changes})


def test_training_measures_costs_during_the_warmup_and_then_controls():
    torch.manual_seed(0)
    cfg = get_regime("loss_aware").replace(
        windows=(4, 8, 16), budget=0.5, control_warmup=2, control_interval=2,
        warmup_trigger="far_cost", far_cost_threshold=1e-12, warmup_max_steps=40,
    )
    model = GPT(GPTConfig(vocab_size=32, max_seq_len=16, n_layers=2, n_heads=4, d_model=32), controller=cfg)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ended = None
    for step in range(12):
        got = model.set_step(step)
        ended = got if got is not None else ended
        x = torch.randint(0, 32, (2, 16))
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ended is None:  # still warming up: windows full, costs measured
            assert model.aah_windows().eq(16).all()
    ctrls = model.controllers()
    assert all(bool(c.loss_cost_ready) for c in ctrls)
    assert ended == 4  # step 2 measured, its backward folded the cost; step 4 read it and ended the warm-up
    assert all(c.is_decided for c in ctrls)
    assert model.state_dict()["blocks.0.attn.aah_state.warmup_end"].item() == 4


def test_patience_ignores_a_spike_and_waits_for_a_cost_that_stays_up():
    ctrl = _controller(warmup=10, patience=10)  # two grid intervals of 5 steps
    _set_costs(ctrl, [0.3, 0.0, 0.0, 0.0])
    assert settle_warmup([ctrl], 10) is None  # the run starts here
    _set_costs(ctrl, [0.1, 0.0, 0.0, 0.0])
    assert settle_warmup([ctrl], 15) is None  # a one-measurement spike: the run is broken
    assert int(ctrl.far_cost_since) == -1
    _set_costs(ctrl, [0.2, 0.0, 0.0, 0.0])
    assert settle_warmup([ctrl], 20) is None
    assert settle_warmup([ctrl], 25) is None  # 5 steps above
    assert settle_warmup([ctrl], 30) == 30  # 10 steps above
    assert ctrl.warmup_steps == 30


def test_a_far_cost_checkpoint_from_before_the_patience_still_loads():
    ctrl = _controller(patience=10)
    _set_costs(ctrl, [0.3, 0.0, 0.0, 0.0])
    settle_warmup([ctrl], 10)
    assert int(ctrl.far_cost_since) == 10
    old = {k: v for k, v in _controller().state_dict().items() if k != "far_cost_since"}
    old["warmup_end"] = torch.tensor(25)
    ctrl.load_state_dict(old)  # strict: the missing buffer is filled in, not reported
    assert int(ctrl.far_cost_since) == -1
    assert int(ctrl.warmup_end) == 25
