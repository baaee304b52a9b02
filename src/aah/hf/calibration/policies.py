"""Choose per-head windows for a pretrained model on real calibration text, then freeze them.

Policies:

* ``aah_v3``: the project's own AAH-v3 controller (paper sections 5.3-5.8: features, feature
  EMA, hierarchy, joint sibling scorer, parent clamp, resolution EMA), one per layer, fed the
  model's real post-RoPE q/k/v. Every calibration batch is one control update; the windows
  after the last one are kept.
* ``uniform``: one window for every head: the largest whose causal coverage (sinks counted)
  stays within ``budget``.
* ``budgeted``: per head and candidate window, the *lost mass*: the attention probability
  the head's real softmax attention (post-RoPE q/k, sampled queries against their full
  causal context, :func:`aah.controller.lost_mass.lost_mass`) puts on keys outside the
  window and outside the sinks, averaged over the calibration batches. The windows that
  minimise the summed lost mass subject to causal coverage (sinks counted) ``<= budget``
  are then chosen by the exact multiple-choice knapsack of :mod:`aah.controller.budget`,
  per layer (``scope="layer"``) or for all layers at once (``scope="model"``).
  ``measure="kl"`` (an option of ours) puts the estimated KL divergence from the full
  model that each window adds (:mod:`aah.hf.calibration.window_kl`, one backward pass per batch)
  in the knapsack instead of the lost mass; it is in one unit across layers, so it is
  meant for ``scope="model"``. ``measure="kl_retrieval"`` adds to it, with weight
  ``retrieval_weight``, what each window costs on synthetic long-range retrieval: the rise of
  the answer tokens' loss on ``retrieval`` sequences (:mod:`aah.hf.calibration.answer_loss`),
  so the knapsack keeps the heads that must see far. With ``retrieval_reserve`` (ours) the
  knapsack leaves part of the budget to a repair pass (:mod:`aah.hf.calibration.repair`) that
  widens the KV groups that lower the answer loss most with the whole model windowed.

* ``duo`` (a baseline of DuoAttention's shape, Xiao et al., 2024): every item is either a
  *retrieval* item at the full length ``T`` or a *streaming* item at one short window
  ``duo_window`` (default 256), both with the file's sinks. The items are ranked by the
  project's retrieval measure: the rise of the answer loss on the synthetic ``retrieval``
  sequences when that item alone is cut to ``duo_window`` (:func:`measure_answer_loss` with
  the candidates ``(duo_window, T)``, the retrieval part of ``kl_retrieval``). The items
  ranked first get ``T`` while the model's causal coverage stays within ``budget``; see
  :func:`duo_windows`. DuoAttention itself learns a gate per KV head by optimisation (on
  synthetic passkey retrieval, blending each head's full and streaming attention outputs so that
  the model's hidden states stay those of full attention, with a penalty that drives the gates
  to streaming) and keeps the heads with the largest gates at a chosen share of retrieval
  heads; its streaming heads keep 64 sinks and 256 recent tokens (``sink_tokens=64``). Here no
  gate is trained: the ranking of the retrieval measure stands in for the gates, each item is
  judged alone with the rest at full attention, and the budget is a causal coverage rather
  than a share of heads.

With grouped-query attention the windows are decided per KV group by default
(``granularity="kv_group"``): the query heads that share a KV head share its window, so the
KV cache holds exactly what they read. ``aah_v3`` gives a group the largest window any of its
heads chose; ``budgeted`` makes each group one knapsack item whose cost counts all of its
query heads and whose lost mass is the sum over them; ``duo`` ranks and widens whole groups.
``granularity="layer"`` gives all the query heads of a layer one window: the layer is one item
(all its heads) of the same knapsack, ``aah_v3`` gives it the largest window of its heads. A
paged KV cache whose pages hold every KV head of a layer (vLLM's) keeps each layer's largest
window, so at this granularity the coverage the budget counts is also the KV memory it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from ...controller import HeadController
from ...controller.budget import budget_capacity, choose_windows
from ...controller.lost_mass import lost_mass
from ...controller.selection import share_within_kv_groups as share_row
from ...regimes import get as get_regime
from ...windows import candidate_windows, causal_coverage
from ..bridge.patch import recording
from ..bridge.spec import (
    attention_modules,
    kv_heads,
    layer_sinks,
    layer_sliding_window,
    layer_sliding_windows,
    uniform_window_for_budget,
    window_pairs,
)
from .answer_loss import measure_answer_loss
from .repair import repair_windows
from .window_kl import measure_window_kl

__all__ = [
    "POLICIES",
    "GRANULARITIES",
    "SCOPES",
    "MEASURES",
    "calibrate",
    "share_within_kv_groups",
    "measure_lost_mass",
    "budgeted_windows",
    "check_budgeted_budget",
    "check_choice",
    "check_policy_budget",
    "check_duo_window",
    "duo_windows",
    "duo_full_items",
    "DUO_WINDOW",
]

POLICIES = ("aah_v3", "uniform", "budgeted", "duo")
GRANULARITIES = ("head", "kv_group", "layer")
SCOPES = ("layer", "model")
MEASURES = ("lost_mass", "kl", "kl_retrieval")
#: The short window of policy ``duo``: DuoAttention's 256 recent tokens (its 64 sinks are ``sink_tokens=64``).
DUO_WINDOW = 256


def share_within_kv_groups(windows: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(L, H) windows where the query heads of each KV head take the largest window among them.

    The rule of ``window_granularity="kv_group"``, applied layer by layer (windows grow with
    the candidate index, so the largest window is the window of the largest index).
    """
    return torch.stack([share_row(row, num_kv_heads) for row in windows])


def resolve_candidates(seq_len: int, candidates: Sequence[int] | None) -> tuple[int, ...]:
    """The candidate windows, increasing and within ``[1, seq_len]`` (default: the ladder T/8 .. T)."""
    if candidates is None:
        return candidate_windows(seq_len)
    cands = tuple(int(c) for c in candidates)
    if not cands or any(b <= a for a, b in zip(cands, cands[1:])) or cands[0] < 1 or cands[-1] > seq_len:
        raise ValueError(f"candidates must be increasing windows in [1, {seq_len}], got {list(cands)}")
    return cands


def check_budgeted_budget(
    budget: float | None, candidates: Sequence[int], seq_len: int, *, sink_tokens: int, policy: str = "budgeted"
) -> float:
    """``budget`` as a float, or ``ValueError``: missing, outside (0, 1], or below the smallest
    feasible causal coverage (every head at the smallest candidate, sinks counted). ``policy``
    is the policy the message names."""
    if budget is None:
        raise ValueError(f"policy {policy!r} needs a budget (target causal coverage in (0, 1])")
    cheapest = min(window_pairs(candidates, seq_len, sink_tokens))
    # A layer (or model) of H heads fits iff floor(b H full) >= H cheapest iff floor(b full) >= cheapest.
    if budget_capacity(budget, 1, seq_len) < cheapest:
        smallest = causal_coverage([min(candidates)], seq_len, sink_tokens=sink_tokens)
        raise ValueError(
            f"budget {budget:g} is below the smallest feasible causal coverage {smallest:.4f} "
            f"(every head at window {min(candidates)} with {sink_tokens} sink tokens at length {seq_len})"
        )
    return float(budget)


def check_policy_budget(
    policy: str, budget: float | None, seq_len: int, *, sink_tokens: int, candidates: Sequence[int] | None = None,
    duo_window: int | None = None,
) -> None:
    """``ValueError`` when ``policy`` needs a budget and ``budget`` is missing or infeasible (for
    ``duo``, also when ``duo_window``, default :data:`DUO_WINDOW`, is not in ``[1, seq_len)``)."""
    if policy == "uniform":
        if budget is None:
            raise ValueError("policy 'uniform' needs a budget (target causal coverage in (0, 1])")
        uniform_window_for_budget(budget, seq_len, sink_tokens=sink_tokens)
    elif policy == "budgeted":
        check_budgeted_budget(budget, resolve_candidates(seq_len, candidates), seq_len, sink_tokens=sink_tokens)
    elif policy == "duo":
        window = check_duo_window(DUO_WINDOW if duo_window is None else duo_window, seq_len)
        # The least feasible budget: every item at the short window.
        check_budgeted_budget(budget, [window], seq_len, sink_tokens=sink_tokens, policy="duo")


def check_duo_window(window: int, seq_len: int) -> int:
    """``window`` when it is an integer in ``[1, seq_len)`` (shorter than full attention), else ``ValueError``."""
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < seq_len:
        raise ValueError(f"duo_window must be an integer in [1, {seq_len}) (below the sequence length), "
                         f"got {window!r}")
    return window


def check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    """``ValueError`` naming ``name`` and the allowed values when ``value`` is not one of them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _items(num_heads: int, num_kv_heads: int, granularity: str) -> list[list[int]]:
    """The query heads of each knapsack item of one layer: single heads, KV groups or the whole layer."""
    check_choice("granularity", granularity, GRANULARITIES)
    if granularity == "head":
        return [[h] for h in range(num_heads)]
    if granularity == "layer":
        return [list(range(num_heads))]
    per = num_heads // num_kv_heads
    return [list(range(g * per, (g + 1) * per)) for g in range(num_kv_heads)]


def budgeted_windows(
    lost: torch.Tensor,
    candidates: Sequence[int],
    budget: float,
    seq_len: int,
    *,
    sink_tokens: int,
    num_kv_heads: int | None = None,
    granularity: str = "kv_group",
    scope: str = "layer",
    layer_windows: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """(L, H) windows minimising the summed ``lost`` with causal coverage ``<= budget``.

    ``lost`` is an (L, H, K) table of what each window loses: the lost mass of
    :func:`measure_lost_mass` or the loss estimate of
    :func:`~aah.hf.calibration.window_kl.measure_window_kl`. Every item (a head, a KV group of
    ``H / num_kv_heads`` heads, or with ``granularity="layer"`` all ``H`` heads of a layer) takes
    one candidate; the knapsack is solved
    per layer or, with ``scope="model"``, once over all layers. ``layer_windows`` gives each
    layer's own sliding window (``None``: none), so a window is costed as that layer runs it
    (see :func:`_window_pairs`): the coverage spent is the executed one, which
    :func:`~aah.hf.bridge.spec.executed_coverage` reports.
    """
    check_choice("scope", scope, SCOPES)
    num_layers, num_heads, k = lost.shape
    if k != len(candidates):
        raise ValueError(f"lost has {k} windows but there are {len(candidates)} candidates")
    check_budgeted_budget(budget, candidates, seq_len, sink_tokens=sink_tokens)
    items = _items(num_heads, num_kv_heads or num_heads, granularity)
    layer_windows = [None] * num_layers if layer_windows is None else list(layer_windows)
    if len(layer_windows) != num_layers:
        raise ValueError(f"layer_windows must name {num_layers} layers, got {len(layer_windows)}")
    costs = [window_pairs(candidates, seq_len, sink_tokens, lw) for lw in layer_windows]
    item_lost = [torch.stack([lost[layer, heads].double().sum(0) for heads in items]) for layer in range(num_layers)]
    sizes = [len(heads) for heads in items]
    if scope == "model":
        rows = [layer_costs for layer_costs in costs for _ in items]
        flat = choose_windows(torch.cat(item_lost), rows, budget, seq_len, sizes=sizes * num_layers)
        choices = [flat[i * len(items) : (i + 1) * len(items)] for i in range(num_layers)]
    else:
        choices = [
            choose_windows(table, layer_costs, budget, seq_len, sizes=sizes)
            for table, layer_costs in zip(item_lost, costs)
        ]
    out = torch.empty(num_layers, num_heads, dtype=torch.int64)
    for layer, choice in enumerate(choices):
        for heads, c in zip(items, choice):
            out[layer, heads] = int(candidates[c])
    return out


def duo_windows(
    rise: torch.Tensor,
    window: int,
    budget: float,
    seq_len: int,
    *,
    sink_tokens: int,
    num_kv_heads: int | None = None,
    granularity: str = "kv_group",
    layer_windows: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """(L, H) windows of policy ``duo``: ``seq_len`` for the items ranked first, ``window`` for the rest.

    ``rise`` (L, H) is what the short window costs each query head: the answer-loss rise of
    :func:`~aah.hf.calibration.answer_loss.measure_answer_loss` at ``window``, shared among an
    item's heads, so an item's score is the sum over its heads. The items (KV groups of
    ``H / num_kv_heads`` heads, or single heads) are ranked by decreasing score, ties broken by
    the lower layer, then the lower index. Every item starts at ``window``; in ranking order each
    item gets ``seq_len`` if the causal coverage of the whole model (sinks counted, each layer's
    own sliding window applied as in :func:`budgeted_windows`) stays ``<= budget`` with it, and
    keeps ``window`` otherwise. Where every item costs the same (no layer has its own sliding
    window) the items at ``seq_len`` are thus the top ``m`` of the ranking, ``m`` the most the
    budget allows (DuoAttention's "the top heads are retrieval heads"); where items cost
    differently, one that does not fit is passed over and a cheaper one after it may still fit.
    """
    num_layers, num_heads = rise.shape
    window = check_duo_window(window, seq_len)
    check_budgeted_budget(budget, [window], seq_len, sink_tokens=sink_tokens, policy="duo")
    if not bool(torch.isfinite(rise).all()):
        raise ValueError("the retrieval measure has non-finite entries; cannot rank the items")
    items = _items(num_heads, num_kv_heads or num_heads, granularity)
    layer_windows = [None] * num_layers if layer_windows is None else list(layer_windows)
    if len(layer_windows) != num_layers:
        raise ValueError(f"layer_windows must name {num_layers} layers, got {len(layer_windows)}")
    costs = [window_pairs((window, seq_len), seq_len, sink_tokens, lw) for lw in layer_windows]
    capacity = budget_capacity(budget, num_layers * num_heads, seq_len)
    used = sum(len(heads) * costs[layer][0] for layer in range(num_layers) for heads in items)
    if used > capacity:  # not reached: a sliding layer only lowers the short window's cost
        raise ValueError(f"budget {budget:g} is below the coverage of every item at window {window}")
    scores = {(layer, i): float(rise[layer, heads].double().sum()) for layer in range(num_layers)
              for i, heads in enumerate(items)}
    out = torch.full((num_layers, num_heads), window, dtype=torch.int64)
    for layer, i in sorted(scores, key=lambda key: (-scores[key], key)):
        extra = len(items[i]) * (costs[layer][1] - costs[layer][0])
        if used + extra <= capacity:
            used += extra
            out[layer, items[i]] = seq_len
    return out


def duo_full_items(
    windows: torch.Tensor, seq_len: int, *, num_kv_heads: int | None = None, granularity: str = "kv_group"
) -> list[list[int]]:
    """``[layer, item]`` of every item whose window reaches ``seq_len`` (the retrieval items of a
    ``duo`` file), by layer then index; an item is a KV group or, at ``granularity="head"``, a head
    (at ``granularity="layer"`` the layer, item 0)."""
    num_layers, num_heads = windows.shape
    items = _items(num_heads, num_kv_heads or num_heads, granularity)
    return [[layer, i] for layer in range(num_layers) for i, heads in enumerate(items)
            if int(windows[layer, heads].min()) >= seq_len]


@torch.no_grad()
def measure_lost_mass(
    model: torch.nn.Module,
    batches: Sequence[torch.Tensor],
    candidates: Sequence[int],
    *,
    sink_tokens: int,
    progress: bool = False,
) -> torch.Tensor:
    """(L, H, K) lost mass of every query head at every candidate, averaged over ``batches``.

    Each layer's real post-RoPE q/k (its own softmax scale) go to
    :func:`aah.controller.lost_mass.lost_mass`; mass on the sinks is not lost. A layer with
    its own sliding window is measured within it, without sinks (what the patched layer runs).
    """
    modules = attention_modules(model)
    totals: list[torch.Tensor | None] = [None] * len(modules)

    def recorder(layer: int, module) -> Callable:
        context = layer_sliding_window(model, module)
        sinks = layer_sinks(sink_tokens, context)

        def record(q, k, v) -> None:
            current = lost_mass(
                q, k, candidates, scale=getattr(module, "scaling", None), sink_tokens=sinks, context=context
            )
            totals[layer] = current if totals[layer] is None else totals[layer] + current

        return record

    seq_len = int(batches[0].shape[-1])
    with recording(model, modules, [recorder(i, m) for i, m in enumerate(modules)], seq_len):
        for batch in tqdm(batches, desc="calibrate budgeted", disable=not progress):
            model(batch.to(model.device), use_cache=False, logits_to_keep=1)  # the logits go unused
    return torch.stack([t.cpu() for t in totals]) / len(batches)


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
    scope: str = "layer",
    measure: str = "lost_mass",
    retrieval: Sequence | None = None,
    retrieval_weight: float = 1.0,
    retrieval_reserve: float = 0.0,
    repair_rounds: int = 3,
    duo_window: int | None = None,
) -> torch.Tensor:
    """(num_layers, num_query_heads) windows for ``model`` chosen by ``policy``.

    ``batches`` are token id tensors (B, T) of one length T. ``candidates`` default to the
    paper's ladder ``T/8, T/4, T/2, T``. ``scope`` (``layer`` or ``model``) is where the
    ``budgeted`` policy spends its budget and ``measure`` (``lost_mass`` or ``kl``) what it
    minimises. ``measure="kl_retrieval"`` needs ``retrieval``, the sequences of
    :func:`aah.hf.calibration.answer_loss.calibration_sequences`, whose answer loss it adds to the
    KL estimate times ``retrieval_weight``. With ``retrieval_reserve`` > 0 the knapsack spends
    ``budget - retrieval_reserve`` and the repair pass of :mod:`aah.hf.calibration.repair` spends
    the rest in ``repair_rounds`` rounds on the items that most lower the answer loss of the
    whole windowed model. Policy ``duo`` needs ``budget`` and ``retrieval`` too, and gives each
    item ``T`` or ``duo_window`` (default :data:`DUO_WINDOW`, in ``[1, T)``) by
    :func:`duo_windows`; ``batches`` give it only ``T``. The model is left unpatched.
    """
    check_choice("policy", policy, POLICIES)
    check_choice("granularity", granularity, GRANULARITIES)
    batches = list(batches)
    if not batches:
        raise ValueError("calibration needs at least one batch")
    seq_len = int(batches[0].shape[-1])
    if any(int(b.shape[-1]) != seq_len for b in batches):
        raise ValueError("every calibration batch must have the same length")
    modules = attention_modules(model)
    heads = model.config.num_attention_heads
    if duo_window is not None and policy != "duo":
        raise ValueError(f"duo_window needs policy 'duo', got {policy!r}")
    check_policy_budget(policy, budget, seq_len, sink_tokens=sink_tokens, candidates=candidates,
                        duo_window=duo_window)
    if retrieval_reserve and policy != "budgeted":
        raise ValueError(f"retrieval_reserve needs policy 'budgeted' (measure 'kl_retrieval'), got {policy!r}")
    if policy == "duo":
        return _run_duo(model, budget, seq_len, DUO_WINDOW if duo_window is None else duo_window, sink_tokens,
                        granularity, retrieval, progress)
    if policy == "uniform":
        window = uniform_window_for_budget(
            budget, seq_len, sink_tokens=sink_tokens, layer_windows=layer_sliding_windows(model)
        )
        return torch.full((len(modules), heads), window, dtype=torch.int64)
    if policy == "budgeted":
        return _run_budgeted(
            model, batches, budget, seq_len, candidates, sink_tokens, granularity, scope, measure, seed, progress,
            retrieval, retrieval_weight, retrieval_reserve, repair_rounds,
        )
    windows = _run_aah_v3(model, modules, batches, heads, seq_len, candidates, seed, progress)
    if granularity in ("kv_group", "layer"):
        # One group of all the heads is the layer: each layer takes its largest window.
        windows = share_within_kv_groups(windows, kv_heads(model) if granularity == "kv_group" else 1)
    return windows


def _run_budgeted(
    model, batches, budget, seq_len, candidates, sink_tokens, granularity, scope, measure, seed, progress,
    retrieval=None, retrieval_weight=1.0, retrieval_reserve=0.0, repair_rounds=3,
):
    """Measure what each window loses, then solve (and repair); bad arguments fail before any forward pass."""
    check_choice("scope", scope, SCOPES)
    check_choice("measure", measure, MEASURES)
    cands = resolve_candidates(seq_len, candidates)
    if measure == "kl_retrieval" and not retrieval:
        raise ValueError("measure 'kl_retrieval' needs retrieval sequences (calibration_sequences)")
    if measure == "kl_retrieval" and not retrieval_weight >= 0:
        raise ValueError(f"retrieval_weight must be >= 0, got {retrieval_weight}")
    knapsack_budget = _knapsack_budget(budget, retrieval_reserve, repair_rounds, measure, cands, seq_len, sink_tokens)
    items = _items(model.config.num_attention_heads, kv_heads(model), granularity)
    full_nll: list[float] = []
    if measure in ("kl", "kl_retrieval"):
        lost = measure_window_kl(model, batches, cands, sink_tokens=sink_tokens, seed=seed, progress=progress)
        if measure == "kl_retrieval":
            answer = measure_answer_loss(model, retrieval, cands, sink_tokens=sink_tokens, items=items,
                                         progress=progress, full_nll=full_nll)
            lost = lost + retrieval_weight * answer
    else:
        lost = measure_lost_mass(model, batches, cands, sink_tokens=sink_tokens, progress=progress)
    layer_windows = layer_sliding_windows(model)
    windows = budgeted_windows(
        lost, cands, knapsack_budget, seq_len, sink_tokens=sink_tokens, num_kv_heads=kv_heads(model),
        granularity=granularity, scope=scope, layer_windows=layer_windows,
    )
    if retrieval_reserve > 0:
        windows, _ = repair_windows(
            model, retrieval, windows, budget=budget, seq_len=seq_len, candidates=cands,
            head_costs=[window_pairs(cands, seq_len, sink_tokens, lw) for lw in layer_windows], items=items,
            sink_tokens=sink_tokens, rounds=repair_rounds,
            full_nll=sum(full_nll) / sum(len(seq.answer) for seq in retrieval), progress=progress,
        )
    return windows


def _run_duo(model, budget, seq_len, window, sink_tokens, granularity, retrieval, progress) -> torch.Tensor:
    """Rank the items by the answer loss at ``window`` (each alone, the rest at full attention), then choose."""
    if not retrieval:
        raise ValueError("policy 'duo' needs retrieval sequences (calibration_sequences)")
    items = _items(model.config.num_attention_heads, kv_heads(model), granularity)
    # The column of T is full attention for every sequence of at most T tokens: no rise.
    answer = measure_answer_loss(model, retrieval, (window, seq_len), sink_tokens=sink_tokens, items=items,
                                 progress=progress)
    return duo_windows(
        answer[..., 0] - answer[..., 1], window, budget, seq_len, sink_tokens=sink_tokens,
        num_kv_heads=kv_heads(model), granularity=granularity, layer_windows=layer_sliding_windows(model),
    )


def _knapsack_budget(
    budget: float, reserve: float, rounds: int, measure: str, candidates: Sequence[int], seq_len: int,
    sink_tokens: int,
) -> float:
    """The budget left to the knapsack once the repair's ``reserve`` is set aside, or ``ValueError``."""
    if not 0.0 <= reserve < 1.0:
        raise ValueError(f"retrieval_reserve must be in [0, 1), got {reserve}")
    if reserve == 0:
        return budget
    if measure != "kl_retrieval":
        raise ValueError(f"retrieval_reserve needs measure 'kl_retrieval', got {measure!r}")
    if rounds < 1:
        raise ValueError(f"repair_rounds must be >= 1, got {rounds}")
    left = budget - reserve
    if left <= 0:
        raise ValueError(f"retrieval_reserve {reserve:g} must be below the budget {budget:g}")
    try:
        return check_budgeted_budget(left, candidates, seq_len, sink_tokens=sink_tokens)
    except ValueError as exc:
        raise ValueError(f"retrieval_reserve {reserve:g} leaves the knapsack {left:g} of budget {budget:g}: "
                         f"{exc}") from None


def _run_aah_v3(model, modules, batches, heads, seq_len, candidates, seed, progress) -> torch.Tensor:
    cands = resolve_candidates(seq_len, candidates)
    config = get_regime("full_adaptive", seed=seed).replace(windows=cands, control_warmup=0, control_interval=1)
    controllers = [
        HeadController(heads, config, max_seq_len=seq_len, layer_idx=i).train() for i in range(len(modules))
    ]
    with recording(model, modules, [c.control_update for c in controllers], seq_len):
        for step, batch in enumerate(tqdm(batches, desc="calibrate aah_v3", disable=not progress)):
            for controller in controllers:
                controller.set_step(step)
            model(batch.to(model.device), use_cache=False)
    return torch.tensor([c.current_windows(seq_len) for c in controllers], dtype=torch.int64)
