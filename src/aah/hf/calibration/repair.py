"""Widen the KV groups that carry retrieval together: a repair pass after the knapsack (ours).

The answer loss of :mod:`aah.hf.calibration.answer_loss` judges each knapsack item alone, every
other head at full attention. Two things escape it. Where several heads can each fetch a far
needle, none of them looks necessary alone, and the knapsack may window them all. And a context
read with windows everywhere may no longer carry what the answer needs (the prompt's opening
instruction, say), which a one-item measurement over a full-attention context never sees.

The repair measures with the whole model windowed:

1. the knapsack spends ``budget - reserve`` (:func:`aah.hf.calibration.policies.calibrate` with
   ``retrieval_reserve``);
2. each round reads every calibration sequence at the current windows into a cache (all
   layers windowed, sinks kept), then reads the positions that predict the answer again once
   per item not yet at the largest candidate, with that item widened to it: the drop of the
   answer tokens' NLL is the item's *joint gain*;
3. items with a positive gain are taken in decreasing gain per pair of causal coverage while
   they fit the round's share of the room left (round ``r`` of ``R`` spends ``1 / (R - r)`` of
   it; the best item is taken whenever it fits the room at all);
4. it stops after ``rounds`` rounds, or when no item fits or gains.

The windowed answer NLL is not compared with full attention's to stop early: averaged over
sequences it can be lower than full attention's while needles are lost (on SmolLM2 at T = 8192
the knapsack's windows at causal coverage 0.35 scored 0.61 nats per answer token against full
attention's 0.65, and lost every far pass key), so the reserve is spent on what gains.

The sequences are those of :func:`~aah.hf.calibration.answer_loss.calibration_sequences` with
``instruction=True``: their context opens with an instruction worded unlike the evaluation's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ...controller.budget import budget_capacity
from .._transformers import require
from .answer_loss import RetrievalSequence, answer_token_nll, window_probe

__all__ = ["RepairRound", "joint_answer_gain", "repair_windows"]


@dataclass(frozen=True)
class RepairRound:
    """One round of the repair: the windowed answer NLL it started from, what it widened."""

    answer_nll: float  # per answer token, every layer at the round's starting windows
    widened: tuple[tuple[int, int], ...]  # (layer, item) pairs widened to the largest candidate
    causal_coverage: float  # after the round, sinks counted


@torch.no_grad()
def joint_answer_gain(
    model: torch.nn.Module,
    sequences: Sequence[RetrievalSequence],
    windows: torch.Tensor,
    widen: Sequence[tuple[int, Sequence[int]]],
    widen_to: int,
    *,
    sink_tokens: int,
    chunk: int = 8,
    progress: bool = False,
) -> tuple[torch.Tensor, float]:
    """``(gain, nll)``: ``gain[v]`` the drop of the answer NLL per answer token when the heads of
    ``widen[v] = (layer, heads)`` take window ``widen_to`` at the answer positions, every layer
    at ``windows`` (L, H) elsewhere and in the context; ``nll`` the NLL per answer token at
    ``windows``. ``chunk`` variants share one batch over the context's cache."""
    dynamic_cache = require("transformers.cache_utils").DynamicCache
    num_layers = windows.shape[0]
    gains = torch.zeros(len(widen), dtype=torch.float64)
    windowed, answer_tokens = 0.0, 0
    with window_probe(model, sink_tokens) as set_windows, tqdm(
        total=len(sequences), desc="repair (joint answer gain)", disable=not progress
    ) as bar:
        for seq in sequences:
            ids = torch.tensor([seq.context + seq.question + seq.answer], dtype=torch.int64, device=model.device)
            read = ids.shape[1] - len(seq.answer) - 1
            inputs, answer = ids[:, read:-1], ids[0, read + 1 :]
            answer_tokens += len(seq.answer)
            set_windows({layer: windows[layer][None] for layer in range(num_layers)})
            cache = dynamic_cache()  # full layers: cut back after each answer (answer_loss.py)
            model(ids[:, :read], past_key_values=cache, use_cache=True, logits_to_keep=1)  # the cache alone counts
            base = float(answer_token_nll(model, cache, inputs, answer)[0])
            windowed += base
            for start in range(0, len(widen), chunk):
                part = widen[start : start + chunk]
                by_layer = {layer: windows[layer][None].repeat(len(part), 1) for layer in range(num_layers)}
                for row, (layer, heads) in enumerate(part):
                    by_layer[layer][row, list(heads)] = widen_to
                set_windows(by_layer)
                cache.batch_repeat_interleave(len(part))
                nll = answer_token_nll(model, cache, inputs.expand(len(part), -1), answer)
                cache.batch_select_indices(torch.tensor([0], device=model.device))
                gains[start : start + len(part)] += base - nll.double().cpu()
            bar.update()
    return gains / answer_tokens, windowed / answer_tokens


def repair_windows(
    model: torch.nn.Module,
    sequences: Sequence[RetrievalSequence],
    windows: torch.Tensor,
    *,
    budget: float,
    seq_len: int,
    candidates: Sequence[int],
    head_costs: Sequence[Sequence[int]],
    items: Sequence[Sequence[int]],
    sink_tokens: int,
    rounds: int = 3,
    full_nll: float | None = None,
    progress: bool = False,
) -> tuple[torch.Tensor, list[RepairRound]]:
    """Widen items of ``windows`` (L, H) to ``candidates[-1]`` by joint answer gain until the causal
    coverage reaches ``budget`` (see the module docstring); returns the windows and the rounds.

    ``head_costs[layer][k]`` is the (query, key) pairs one head of ``layer`` executes at
    candidate ``k``, sinks counted; ``items`` the query heads of each item of a layer;
    ``full_nll`` full attention's answer NLL per answer token, shown beside the windowed one.
    """
    if rounds < 1:
        raise ValueError(f"repair rounds must be >= 1, got {rounds}")
    num_layers, num_heads = windows.shape
    index = {int(c): k for k, c in enumerate(candidates)}
    unknown = sorted({int(w) for w in windows.flatten().tolist()} - set(index))
    if unknown:
        raise ValueError(f"windows {unknown} are not among the candidates {list(candidates)}")
    capacity = budget_capacity(budget, num_layers * num_heads, seq_len)
    total = num_layers * num_heads * seq_len * (seq_len + 1) // 2
    windows = windows.clone()
    widest = int(candidates[-1])

    def cost(layer: int, item: int, window: int) -> int:
        return len(items[item]) * int(head_costs[layer][index[window]])

    def spent() -> int:
        return sum(int(head_costs[l][index[int(windows[l, h])]]) for l in range(num_layers) for h in range(num_heads))

    log: list[RepairRound] = []
    for r in range(rounds):
        room = capacity - spent()
        delta = {
            (l, i): cost(l, i, widest) - cost(l, i, int(windows[l, heads[0]]))
            for l in range(num_layers)
            for i, heads in enumerate(items)
            if int(windows[l, heads[0]]) < widest
        }
        open_items = [v for v, d in delta.items() if d <= room]
        if not open_items:
            break
        gain, nll = joint_answer_gain(
            model, sequences, windows, [(l, items[i]) for l, i in open_items], widest,
            sink_tokens=sink_tokens, progress=progress,
        )
        share = room // (rounds - r)
        # A widening a layer's own sliding window makes free (delta 0) counts as one pair.
        order = sorted(range(len(open_items)), key=lambda v: -float(gain[v]) / max(delta[open_items[v]], 1))
        taken, used = [], 0
        for v in order:
            if gain[v] <= 0:
                break
            d = delta[open_items[v]]
            if used + d <= share or (not taken and d <= room):
                taken.append(open_items[v])
                used += d
        for l, i in taken:
            windows[l, list(items[i])] = widest
        log.append(RepairRound(nll, tuple(taken), spent() / total))
        if progress:
            names = ", ".join(f"layer {l} item {i}" for l, i in taken) or "nothing"
            tqdm.write(f"repair round {r + 1}: windowed answer NLL {nll:.4f}/token"
                       + (f" (full {full_nll:.4f})" if full_nll is not None else "")
                       + f"; widened {names}; causal coverage {spent() / total:.4f}")
        if not taken:
            break
    return windows, log
