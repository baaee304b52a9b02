"""What a head's window costs the training loss: the ``loss_aware`` policy's measurement.

The lost mass (:mod:`.lost_mass`) says how much attention a window cuts off, not
what the cut does to the loss. This measures it in the unit of the loss, during
training, from the gradient the training step computes anyway.

For head ``h`` and candidate ``W``, let ``o_t`` be the head's output at position
``t`` over its whole causal context and ``o_t(W)`` its output when it sees only
keys at distance ``< W`` (the probabilities renormalised over those keys), and
``d_t = o_t(W) - o_t``. With ``g_t`` the gradient of the summed next-token
log-loss of the block with respect to ``o_t``, the cost of the cut is the
Fisher (second-order) estimate of the loss it adds, per predicted token::

    cost(h, W) = 1/2 * mean over sampled t and the batch of (g_t . d_t)^2

the estimate of :mod:`aah.hf.calibration.window_kl` (which applies it to a pretrained
model), with one difference that makes it free in training: ``g_t`` is the
gradient of the training loss on the real next tokens (the *empirical* Fisher)
rather than of labels sampled from the model, so no extra backward pass is run.
``d`` is computed in the forward of a control step at the sampled query
positions of the diagnostics (section 5.3); the gradient at those positions is
read by a hook on the head outputs during that step's backward. The table is an
EMA over control steps (``lost_mass_ema``), and the windows are the
multiple-choice knapsack of :mod:`.budget` over it, exactly as ``budgeted``
does with the lost mass.

The gradient of a mean loss carries a factor ``1 / (B T)`` (and ``1 / accum``
under gradient accumulation); the hook multiplies by ``B T``, so the table is in
loss units per token up to the accumulation factor, which scales every head of
every layer alike and so changes no choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..windows import cut_off, visible
from .features import expand_kv, sample_query_positions

__all__ = ["window_output_change", "fisher_cost"]


@torch.no_grad()
def window_output_change(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, windows: Sequence[int],
    *, scale: float | None = None,
) -> torch.Tensor:
    """(B, H, S, K, D) float32: ``o(W_k) - o`` of each head at ``positions`` for each window.

    ``q`` is (B, H, T, D), ``k`` and ``v`` (B, H_kv, T, D) (grouped-query
    attention repeats KV heads). Exactly 0 where a window cuts nothing.
    """
    b, h, seq_len, d = q.shape
    scale = d**-0.5 if scale is None else scale
    pos = positions.to(q.device)
    kf = expand_kv(k.detach().float(), h)
    vf = expand_kv(v.detach().float(), h)
    scores = torch.matmul(q.detach().float()[:, :, pos], kf.transpose(-1, -2)) * scale  # (B, H, S, T)
    keys = torch.arange(seq_len, device=q.device)
    probs = scores.masked_fill(~visible(pos[:, None], keys, seq_len), float("-inf")).softmax(-1)  # W = T: causal
    full = torch.matmul(probs, vf)  # (B, H, S, D)
    out = []
    for w in windows:
        kept = probs * visible(pos[:, None], keys, int(w)).to(probs.dtype)
        windowed = torch.matmul(kept, vf) / kept.sum(-1, keepdim=True)
        out.append(windowed - full)
    change = torch.stack(out, dim=3)
    cuts = cut_off(pos[:, None], keys, torch.tensor([int(w) for w in windows], device=q.device)[:, None, None]).any(-1)
    return change * cuts.t().to(change.dtype)[None, None, :, :, None]


def fisher_cost(grad: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
    """(H, K) float32 cost ``1/2 mean_{b,s} (g . d)^2`` from gradients (B, H, S, D) and changes (B, H, S, K, D)."""
    dots = torch.einsum("bhsd,bhskd->bhsk", grad.float(), change.float())
    return 0.5 * dots.square().mean(dim=(0, 2))


def sampled_positions(seq_len: int, num_queries: int, start: int) -> torch.Tensor:
    """The query positions a control step measures (those of the diagnostics, section 5.3)."""
    return sample_query_positions(seq_len, num_queries, start=start)
