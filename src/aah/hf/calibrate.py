"""Choose per-head windows for a pretrained model on real calibration text, then freeze them.

Policies:

* ``aah_v3``: the project's own AAH-v3 controller (paper sections 5.3-5.8: features, feature
  EMA, hierarchy, joint sibling scorer, parent clamp, resolution EMA), one per layer, fed the
  model's real post-RoPE q/k/v. Every calibration batch is one control update; the windows
  after the last one are kept.
* ``uniform``: one window for every head: the largest whose causal coverage (sinks counted)
  stays within ``budget``.

With grouped-query attention the windows are decided per KV group by default
(``granularity="kv_group"``): the query heads that share a KV head share its window, the
largest any of them chose, so the KV cache holds exactly what they read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from tqdm.auto import tqdm

from ..controller import HeadController
from ..controller.selection import share_within_kv_groups as share_row
from ..regimes import get as get_regime
from ..windows import candidate_windows, causal_coverage
from .patching import RECORDER_ATTR, attention_modules, patch, unpatch

__all__ = ["POLICIES", "GRANULARITIES", "calibrate", "uniform_window_for_budget", "share_within_kv_groups"]

POLICIES = ("aah_v3", "uniform")
GRANULARITIES = ("head", "kv_group")


def uniform_window_for_budget(budget: float, seq_len: int, *, sink_tokens: int = 0) -> int:
    """The largest window ``W`` whose causal coverage at ``seq_len`` (with sinks) is ``<= budget``."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    smallest = causal_coverage([1], seq_len, sink_tokens=sink_tokens)
    if budget < smallest:
        raise ValueError(
            f"budget {budget} is below the causal coverage of a window of 1 with {sink_tokens} "
            f"sink tokens at length {seq_len} ({smallest:.4f})"
        )
    lo, hi = 1, seq_len  # coverage grows with W: find the last W within the budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if causal_coverage([mid], seq_len, sink_tokens=sink_tokens) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def share_within_kv_groups(windows: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(L, H) windows where the query heads of each KV head take the largest window among them.

    The rule of ``window_granularity="kv_group"``, applied layer by layer (windows grow with
    the candidate index, so the largest window is the window of the largest index).
    """
    return torch.stack([share_row(row, num_kv_heads) for row in windows])


def _num_kv_heads(model) -> int:
    config = model.config
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


@torch.no_grad()
def calibrate(
    model: torch.nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    policy: str,
    budget: float | None = None,
    sink_tokens: int = 4,
    granularity: str = "kv_group",
    candidates: Sequence[int] | None = None,
    seed: int = 0,
    progress: bool = False,
) -> torch.Tensor:
    """(num_layers, num_query_heads) windows for ``model`` chosen by ``policy``.

    ``batches`` are token id tensors (B, T) of one length T. ``candidates`` default to the
    paper's ladder ``T/8, T/4, T/2, T``. The model is left unpatched.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}; got {granularity!r}")
    batches = list(batches)
    if not batches:
        raise ValueError("calibration needs at least one batch")
    seq_len = int(batches[0].shape[-1])
    if any(int(b.shape[-1]) != seq_len for b in batches):
        raise ValueError("every calibration batch must have the same length")
    modules = attention_modules(model)
    heads = model.config.num_attention_heads
    if policy == "uniform":
        if budget is None:
            raise ValueError("policy 'uniform' needs a budget (target causal coverage in (0, 1])")
        window = uniform_window_for_budget(budget, seq_len, sink_tokens=sink_tokens)
        return torch.full((len(modules), heads), window, dtype=torch.int64)
    windows = _run_aah_v3(model, modules, batches, heads, seq_len, candidates, seed, progress)
    if granularity == "kv_group":
        windows = share_within_kv_groups(windows, _num_kv_heads(model))
    return windows


def _run_aah_v3(model, modules, batches, heads, seq_len, candidates, seed, progress) -> torch.Tensor:
    cands = tuple(int(c) for c in candidates) if candidates is not None else candidate_windows(seq_len)
    config = get_regime("full_adaptive", seed=seed).replace(windows=cands, control_warmup=0, control_interval=1)
    controllers = [
        HeadController(heads, config, max_seq_len=seq_len, layer_idx=i).train() for i in range(len(modules))
    ]
    was_patched = hasattr(model, "_aah_previous_attn_implementation")
    if was_patched:
        raise ValueError("calibrate a model that is not patched (aah.hf.unpatch it first)")
    patch(model, torch.full((len(modules), heads), seq_len), sink_tokens=0)
    try:
        for step, batch in enumerate(tqdm(batches, desc="calibrate aah_v3", disable=not progress)):
            for module, controller in zip(modules, controllers):
                controller.set_step(step)
                setattr(module, RECORDER_ATTR, controller.control_update)
            model(batch.to(model.device), use_cache=False)
    finally:
        for module in modules:
            if hasattr(module, RECORDER_ATTR):
                delattr(module, RECORDER_ATTR)
        unpatch(model)
    return torch.tensor([c.current_windows(seq_len) for c in controllers], dtype=torch.int64)
