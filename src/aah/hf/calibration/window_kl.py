"""What each head's window costs the model: an estimate of the KL divergence it adds, from one
backward pass.

The lost mass (:mod:`aah.controller.lost_mass`) says how much attention a window cuts off,
not what cutting it off does to the model: a head may spread a little mass far away that
the next layers depend on, or a lot that they ignore, and lost masses of different layers
are not in one unit. This measure is in the unit of the language-model loss.

For query head ``h`` of layer ``l`` and candidate window ``W``, let ``o_t`` be the head's
output at position ``t`` under full causal attention and ``o_t(W)`` its output when the head
sees only its window and sinks (the probabilities renormalised over what stays visible),
``d_t = o_t(W) - o_t``. Giving this one head the window ``W`` moves the model's next-token
distributions away from the full model's by, to second order,

    KL(l, h, W) = 1/2 sum_t  E_y[(g_t . d_t)^2] / N,      g_t = d log p(y) / d o_t,

the Fisher information of the model's own predictions (labels ``y`` sampled from the full
model's next-token distribution, one sample per position, one ordinary backward pass), taken
block-diagonal over positions and heads. ``N`` is the number of predicted tokens. The sum over
positions is estimated from ``num_queries`` evenly spaced positions, scaled by
``T / num_queries``. The full window costs exactly 0, a head whose output the model ignores
costs 0 at every window, and estimates of different heads add up, so one table serves a
knapsack over a layer or over the whole model; the sum of a choice estimates the mean KL
per token, which is the log of the perplexity ratio it adds when the text is the model's own.

The first-order term (``g . d`` with the text's real next tokens as labels) was tried first
and is not usable: on SmolLM2 at T = 4096 it summed to a *negative* loss change for uniform
windows that raise perplexity by 2 to 4 % (docs/hf.md).

The model's weights are frozen during the measurement (no weight gradients are computed);
only the activations carry gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ...controller.features import sample_query_positions
from ...windows import visible
from ..bridge.patch import recording
from ..bridge.spec import attention_modules, layer_sinks, layer_sliding_window
from ..evaluation.compare import (
    HEAD_CHUNK_ROWS,
    check_chunk_rows,
    check_head,
    final_hidden,
    head_logits,
)

__all__ = ["window_output_change", "measure_window_kl"]


@torch.no_grad()
def window_output_change(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    windows: Sequence[int],
    *,
    scale: float,
    sink_tokens: int = 0,
    context: int | None = None,
) -> torch.Tensor:
    """(B, H, S, K, D) change of each head's output at ``positions`` under each candidate window.

    ``q`` is (B, H, T, D); ``k`` and ``v`` are (B, H_kv, T, D) (grouped-query attention: query
    head ``h`` reads KV head ``h // (H / H_kv)``). Entry ``[..., s, c, :]`` is
    ``o(W_c) - o`` for the query at ``positions[s]``: the output when the query sees keys
    ``j`` with ``i - W_c < j <= i`` or ``j < sink_tokens``, minus the output over its whole
    causal context; exactly 0 where the window cuts nothing. ``context`` is the layer's own
    window where it has one (a sliding layer): both outputs then see only keys at distance
    ``< context``. Computed in float32, whatever the model's dtype.
    """
    b, h, seq_len, d = q.shape
    kv = k.shape[1]
    group = h // kv
    pos = positions.to(q.device)
    qs = q[:, :, pos].float().reshape(b, kv, group, len(pos), d)
    keys = torch.arange(seq_len, device=q.device)
    scores = torch.einsum("bngsd,bntd->bngst", qs, k.float()) * scale
    hidden = ~visible(pos[:, None], keys[None, :], seq_len if context is None else int(context))  # (S, T)
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    values = v.float()
    full = torch.einsum("bngst,bntd->bngsd", probs, values)
    changes = []
    for w in windows:
        keep = visible(pos[:, None], keys[None, :], int(w), sink_tokens)
        kept = probs * keep.to(probs.dtype)
        windowed = torch.einsum("bngst,bntd->bngsd", kept, values) / kept.sum(-1, keepdim=True)
        cuts = (~hidden & ~keep).any(-1)[:, None]  # (S, 1): exactly 0 where nothing is cut
        changes.append(torch.where(cuts, windowed - full, torch.zeros((), dtype=full.dtype)))
    return torch.stack(changes, dim=-2).reshape(b, h, len(pos), len(windows), d)


@contextmanager
def _activation_gradients_only(model: torch.nn.Module):
    """Freeze every weight and let the input embeddings carry gradient instead."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    handle = model.get_input_embeddings().register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))
    try:
        with torch.enable_grad():
            yield
    finally:
        handle.remove()
        for p, flag in flags:
            p.requires_grad_(flag)


def _backward_next_token_loss(
    model: torch.nn.Module, batch: torch.Tensor, labels: torch.Tensor | None, generator: torch.Generator,
    chunk_rows: int,
) -> None:
    """Backpropagate the summed negative log-likelihood of ``labels`` (B, T - 1), by default next
    tokens sampled from the model's own predictions, into the model's activations.

    The forward computes the logits of the last position only; the LM head then reads the final
    hidden states ``chunk_rows`` rows at a time (:func:`aah.hf.evaluation.compare.head_logits`),
    each chunk's loss backpropagated into those hidden states before the next chunk's logits exist,
    and the hidden states' gradient runs through the rest of the model once. The labels are drawn
    row after row as one draw over every row would draw them."""
    with final_hidden(model) as captured:
        own_last = model(batch, use_cache=False, logits_to_keep=1).logits[:, -1]
    hidden = captured[-1]
    rows = hidden.detach().requires_grad_(True)
    with torch.no_grad():
        check_head(model, head_logits(model, rows[:, -1]), own_last.detach())
    predicted = batch.shape[1] - 1
    for b in range(batch.shape[0]):
        for start in range(0, predicted, chunk_rows):
            stop = min(predicted, start + chunk_rows)
            logits = head_logits(model, rows[b, start:stop])
            if labels is None:
                with torch.no_grad():
                    target = torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator)[:, 0]
            else:
                target = labels[b, start:stop]
            F.cross_entropy(logits, target.to(logits.device), reduction="sum").backward()
    hidden.backward(rows.grad)


def measure_window_kl(
    model: torch.nn.Module,
    batches: Sequence[torch.Tensor],
    candidates: Sequence[int],
    *,
    sink_tokens: int,
    num_queries: int = 512,
    seed: int = 0,
    labels: Sequence[torch.Tensor] | None = None,
    progress: bool = False,
    chunk_rows: int = HEAD_CHUNK_ROWS,
) -> torch.Tensor:
    """(L, H, K) estimated KL per predicted token that each query head adds at each candidate window.

    ``batches`` are token ids (B, T). The labels are sampled from the full model's predictions
    with a generator seeded by ``seed``, unless ``labels`` gives them, one (B, T - 1) tensor
    per batch (the text's own next tokens give the empirical Fisher instead). The model must
    be unpatched; it runs at full attention, each layer within its own sliding window if it has
    one (where the patched layer keeps no sinks, see :meth:`~aah.hf.bridge.spec.LayerWindows.build`).
    The LM head computes ``chunk_rows`` rows of logits at a time (:func:`_backward_next_token_loss`):
    a block's logits never exist at once.
    """
    check_chunk_rows(chunk_rows)
    modules = attention_modules(model)
    seq_len = int(batches[0].shape[-1])
    positions = sample_query_positions(seq_len, num_queries, 0)
    weight = seq_len / len(positions)
    totals = torch.zeros(len(modules), model.config.num_attention_heads, len(candidates), dtype=torch.float64)
    changes: list[torch.Tensor | None] = [None] * len(modules)

    def on_qkv(layer: int, module) -> Callable:
        context = layer_sliding_window(model, module)
        sinks = layer_sinks(sink_tokens, context)

        def record(q, k, v) -> None:
            scale = getattr(module, "scaling", None) or q.shape[-1] ** -0.5
            changes[layer] = window_output_change(
                q.detach(), k.detach(), v.detach(), positions, candidates, scale=scale, sink_tokens=sinks,
                context=context,
            )

        return record

    def on_output(layer: int) -> Callable:
        def record(out: torch.Tensor) -> None:
            def accumulate(grad: torch.Tensor) -> None:
                g = grad[:, :, positions.to(grad.device)].float()  # (B, H, S, D)
                dot = torch.einsum("bhsd,bhskd->bhsk", g, changes[layer]).double()
                totals[layer] += 0.5 * weight * dot.square().sum((0, 2)).cpu()
                changes[layer] = None

            if out.requires_grad:
                out.register_hook(accumulate)

        return record

    generator = torch.Generator().manual_seed(seed)
    tokens = 0
    recorders = [on_qkv(i, m) for i, m in enumerate(modules)]
    output_recorders = [on_output(i) for i in range(len(modules))]
    with _activation_gradients_only(model), recording(model, modules, recorders, seq_len, output_recorders):
        for i, batch in enumerate(tqdm(batches, desc="calibrate budgeted (kl)", disable=not progress)):
            _backward_next_token_loss(model, batch.to(model.device), None if labels is None else labels[i], generator,
                                      chunk_rows)
            tokens += batch.shape[0] * (seq_len - 1)
    return (totals / tokens).float()
