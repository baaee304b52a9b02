"""Causal attention (geometry ``j <= i``) cut in halves, so that few causal heads keep every CPU thread busy.

Windowed execution (AAH-v3 paper, section 5.8) leaves small causal calls: a
lone full-window head, or the causal prefix of a window group with one head
(:mod:`aah.backends.strips`). PyTorch's fused CPU attention kernel spreads a
call over its threads by (batch, head) items in the backward pass and by
contiguous runs of (item, query block) in the forward pass, so a call with
fewer items than threads, or a count that does not divide evenly, leaves a
thread idle while the other works, and a causal triangle puts its long rows
on one thread.

A causal head of length ``T = 2h`` is exactly

* the causal triangles of positions ``[0, h)`` and ``[h, 2h)``: one causal call
  with the head seen as two heads of length ``h`` (a view, no copy);
* the square of queries ``[h, 2h)`` against keys ``[0, h)``: one non-causal call,
  its queries cut into two heads of ``h / 2`` rows that read the same keys (a
  stride-0 view, no copy).

Every call then has an even number of equal items. The two parts of the rows
``[h, 2h)`` are merged by their log-sum-exps, and each part's backward runs
with the merged output and log-sum-exp, which gives exactly that part's share
of the gradients (the rule :mod:`aah.backends.sinks` uses too). The parts
compute ``h (h + 1) + h^2 = T (T + 1) / 2`` score entries: the causal triangle,
no more, so executed coverage does not change.

When to cut (:func:`cut_in_halves`): with more than one thread, when the item
count does not divide evenly over the threads, for ``T`` divisible by 4 and at
least 2048 score rows in all. Measured forward plus backward at 2 threads,
fp32, head dim 32, in one process: one head of ``T = 4096`` 0.75x the time of
the uncut call, three heads of 4096 0.88x, five heads of 512 0.85x, one head of
2048 0.97x; two heads of 4096 (already even) 1.04x, so even counts stay whole.
"""

from __future__ import annotations

import torch

from .base import expand_kv
from .sdpa import causal_sdpa

__all__ = ["balanced_causal", "causal_backward", "causal_forward", "cut_in_halves"]

_aten = torch.ops.aten
_MIN_ROWS = 2048


def cut_in_halves(items: int, seq_len: int, threads: int | None = None) -> bool:
    """Whether ``items`` causal heads of length ``seq_len`` run faster cut in halves (module docstring)."""
    if threads is None:
        threads = torch.get_num_threads()
    return threads > 1 and items % threads != 0 and seq_len % 4 == 0 and items * seq_len >= _MIN_ROWS


def _kernel(q, k, v, causal: bool, scale: float):
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _kernel_backward(grad, q, k, v, out, lse, causal: bool, scale: float):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _halves(x: torch.Tensor) -> torch.Tensor:
    """(N, 2h, D) as (N, 2, h, D): positions ``[0, h)`` and ``[h, 2h)`` as two heads."""
    return x.unflatten(1, (2, x.shape[1] // 2))


def _square(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Queries ``[h, 2h)`` as two heads of ``h / 2`` rows, each against keys and values ``[0, h)``."""
    n, t, d = q.shape
    h = t // 2
    q_sq = q[:, h:].unflatten(1, (2, h // 2))
    k_sq, v_sq = (x[:, :h].unsqueeze(1).expand(n, 2, h, d) for x in (k, v))
    return q_sq, k_sq, v_sq


def causal_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, halves: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``q``, ``k``, ``v`` (N, T, D): output (N, T, D) and log-sum-exp (N, T).

    ``halves`` runs the cut of the module docstring (``T`` divisible by 4),
    else one fused causal call.
    """
    if not halves:
        out, lse = _kernel(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), True, scale)
        return out.squeeze(1), lse.squeeze(1)
    n, t, d = q.shape
    h = t // 2
    out_tri, lse_tri = _kernel(_halves(q), _halves(k), _halves(v), True, scale)  # (N, 2, h, D), (N, 2, h)
    out_sq, lse_sq = _kernel(*_square(q, k, v), False, scale)
    lse_sq = lse_sq.reshape(n, h)
    lse_late = torch.logaddexp(lse_tri[:, 1], lse_sq)
    acc = lse_late.dtype
    late = (out_tri[:, 1].to(acc) * torch.exp(lse_tri[:, 1] - lse_late)[..., None]
            + out_sq.reshape(n, h, d).to(acc) * torch.exp(lse_sq - lse_late)[..., None])
    out = torch.cat([out_tri[:, 0], late.to(q.dtype)], 1)
    lse = torch.cat([lse_tri[:, 0], lse_late], 1)
    return out, lse


def causal_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, scale: float, halves: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (N, T, D) of q, k, v for :func:`causal_forward`'s ``out`` and ``lse``, same ``halves``."""
    if not halves:
        dq, dk, dv = _kernel_backward(
            grad.unsqueeze(1), q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), out.unsqueeze(1),
            lse.unsqueeze(1), True, scale,
        )
        return dq.squeeze(1), dk.squeeze(1), dv.squeeze(1)
    n, t, d = q.shape
    h = t // 2
    dq, dk, dv = (
        x.reshape(n, t, d)
        for x in _kernel_backward(
            _halves(grad), _halves(q), _halves(k), _halves(v), _halves(out), _halves(lse), True, scale
        )
    )
    q_sq, k_sq, v_sq = _square(q, k, v)
    late = slice(h, t)
    dq_sq, dk_sq, dv_sq = _kernel_backward(
        grad[:, late].unflatten(1, (2, h // 2)), q_sq, k_sq, v_sq,
        out[:, late].unflatten(1, (2, h // 2)), lse[:, late].unflatten(1, (2, h // 2)), False, scale,
    )
    dq[:, late] += dq_sq.reshape(n, h, d)
    dk[:, :h] += dk_sq.sum(1)
    dv[:, :h] += dv_sq.sum(1)
    return dq, dk, dv


class _HalvedCausal(torch.autograd.Function):
    """Causal attention of (N, T, D) through :func:`causal_forward` cut in halves."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = causal_forward(q, k, v, scale, halves=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = causal_backward(grad_out.contiguous(), q, k, v, out, lse, ctx.scale, halves=True)
        return dq, dk, dv, None


def balanced_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Full causal attention of ``q`` (B, H, T, D) over ``k``, ``v`` (B, H_kv, T, D), CPU.

    Cut in halves where :func:`cut_in_halves` says it pays, else causal SDPA.
    """
    b, h, t, d = q.shape
    if not cut_in_halves(b * h, t):
        return causal_sdpa(q, k, v, scale)
    k, v = expand_kv(k, h), expand_kv(v, h)
    out = _HalvedCausal.apply(q.reshape(b * h, t, d), k.reshape(b * h, t, d), v.reshape(b * h, t, d), scale)
    return out.view(b, h, t, d)
