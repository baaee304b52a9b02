"""Checks across sections: the block length against the model's, and the controller's windows,
budget and fixed window against the model's maximum length and heads."""

from __future__ import annotations

from ..controller.budget import check_budget, check_budget_layout
from ..controller.config import BUDGET_SCORINGS, ControllerConfig
from ..model import GPTConfig
from ..windows import candidate_windows
from .values import ConfigError, fail


def check_seq_len(seq_len: int, model_max_len: int | None) -> None:
    """``data.seq_len`` must fit ``model.max_seq_len`` when that is set."""
    if model_max_len is not None and seq_len > model_max_len:
        fail("data.seq_len", f"must be <= model.max_seq_len ({model_max_len}), got {seq_len}")


def check_controller(ctrl: ControllerConfig, gpt: GPTConfig, origin: str) -> None:
    """``ctrl``'s windows, budget and fixed window must fit ``gpt``, whose ``max_seq_len`` comes
    from the key ``origin``; errors name the ``aah`` key."""
    max_len = gpt.max_seq_len
    longest = f"the model's maximum length {max_len} ({origin})"
    if ctrl.windows is not None and any(w > max_len for w in ctrl.windows):
        fail("aah.windows", f"windows must be <= {longest}; got {list(ctrl.windows)}")
    if ctrl.min_window is not None and ctrl.min_window > max_len:
        fail("aah.min_window", f"must be <= {longest}, got {ctrl.min_window}")
    if ctrl.enabled and ctrl.scoring in BUDGET_SCORINGS:
        cands = ctrl.windows if ctrl.windows is not None else candidate_windows(max_len)
        try:
            check_budget(ctrl.budget, cands, max_len, ctrl.min_window, field="aah.budget")
            heads = (gpt.n_heads, gpt.kv_heads)
            check_budget_layout(ctrl.scoring, ctrl.budget_scope, ctrl.window_granularity, *heads, prefix="aah")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    count = len(ctrl.windows) if ctrl.windows is not None else 4
    if ctrl.enabled and ctrl.scoring == "fixed" and ctrl.fixed_window_index >= count:
        index = ctrl.fixed_window_index
        fail("aah.fixed_window_index", f"must index one of the {count} candidate windows (0..{count - 1}), got {index}")
