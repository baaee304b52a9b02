"""Sink tokens for the windowed backends: the few first keys merged into a window by log-sum-exp.

With ``S`` sink tokens (:mod:`aah.windows`) query ``i`` of a head with window
``W`` attends keys ``i - W < j <= i`` and also ``j < S, j <= i``. The window
part is what every backend already computes. Geometry here: the sinks that lie
outside the window, a small extra key block:

* only queries ``i >= W`` can see a sink outside their window (before that the
  window reaches key 0), and only sinks ``j < min(S, T - W)`` matter
  (:func:`sink_span`);
* query ``i`` sees extra sink ``j`` when ``j <= i - W``: exactly the sinks the
  window misses (:func:`aah.windows.cut_off`), so no key is counted twice.

The two parts are merged flash style. The forward keeps the window part's
output ``O_w`` and log-sum-exp ``L_w``, computes the sink part's ``O_s`` and
``L_s``, and returns ``O = e^(L_w - L) O_w + e^(L_s - L) O_s`` with
``L = log(e^L_w + e^L_s)``. The backward of each part, run with the merged
``O`` and ``L`` (softmax probabilities ``exp(scores - L)`` and
``delta = dO . O``), gives exactly that part's share of the gradients, so the
window kernels' own backward passes serve unchanged.

``S = 0`` never reaches this module: the backends keep their plain path.
"""

from __future__ import annotations

import torch

from ..windows import cut_off

__all__ = ["merge_sinks", "sink_backward", "sink_span"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def sink_span(window: int, seq_len: int, sink_tokens: int) -> int:
    """How many sink keys lie outside the window of some query: ``min(S, T - W)``, 0 if ``W >= T``."""
    if window >= seq_len:
        return 0
    return max(0, min(sink_tokens, seq_len - window))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def _sink_scores(q_tail: torch.Tensor, k_sink: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Masked scores (..., R, S') of queries ``W + r`` against the sinks ``j`` their window cuts off."""
    dtype = _compute_dtype(q_tail.dtype)
    scores = torch.matmul(q_tail.to(dtype), k_sink.to(dtype).transpose(-1, -2)) * scale
    q_pos = torch.arange(window, window + scores.shape[-2], device=scores.device)[:, None]
    missed = cut_off(q_pos, torch.arange(scores.shape[-1], device=scores.device), window)
    return scores.masked_fill_(~missed, float("-inf"))


def merge_sinks(
    q_tail: torch.Tensor,
    k_sink: torch.Tensor,
    v_sink: torch.Tensor,
    scale: float,
    out_w: torch.Tensor,
    lse_w: torch.Tensor,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window output and log-sum-exp of queries ``[W, T)`` merged with their sink part.

    ``q_tail`` (..., R, D) holds queries ``W, W + 1, ...`` (``W = window``); ``k_sink``, ``v_sink``
    (..., S', D) the sink keys (broadcast over the leading dims); ``out_w``
    (..., R, D) and ``lse_w`` (..., R) the window part of those rows. Returns the
    merged ``(out, lse)``, ``out`` in the dtype of ``out_w``, ``lse`` in the
    dtype of ``lse_w``. Every row sees key 0 in its window or its sinks, so both
    stay finite.
    """
    if _fusable(q_tail, k_sink, out_w):
        out_s, lse_s = _fused_sink_part(q_tail, k_sink, v_sink, scale)
        lse = torch.logaddexp(lse_w.to(lse_s.dtype), lse_s)
        # O = e^(L_s - L) O_s + e^(L_w - L) O_w, in the fused kernel's own output buffer.
        out = out_s.mul_(torch.exp(lse_s - lse).to(out_s.dtype)[..., None])
        out.addcmul_(out_w, torch.exp(lse_w.to(lse.dtype) - lse).to(out.dtype)[..., None])
        return out, lse.to(lse_w.dtype)
    scores = _sink_scores(q_tail, k_sink, scale, window)
    lse_s = torch.logsumexp(scores, dim=-1)
    lse = torch.logaddexp(lse_w.to(lse_s.dtype), lse_s)
    out_s = torch.matmul(torch.exp(scores - lse[..., None]), v_sink.to(scores.dtype))
    out = out_w.to(scores.dtype) * torch.exp(lse_w.to(lse.dtype) - lse)[..., None] + out_s
    return out.to(out_w.dtype), lse.to(lse_w.dtype)


def _fusable(q_tail: torch.Tensor, k_sink: torch.Tensor, out_w: torch.Tensor) -> bool:
    """Whether the sink part can run through PyTorch's fused CPU kernel: (N, R, D) rows over
    (N, S', D) sinks, in float32 or float64 (half precision keeps the float32 merge below)."""
    return (q_tail.device.type == "cpu" and q_tail.dim() == 3 and k_sink.shape[:-2] == q_tail.shape[:-2]
            and q_tail.dtype == k_sink.dtype == out_w.dtype and q_tail.dtype in (torch.float32, torch.float64))


def _fused_sink_part(q_tail, k_sink, v_sink, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sink part's output (N, R, D) and log-sum-exp (N, R) through the fused CPU kernel.

    Row ``r`` is query ``W + r``, which misses sink ``j`` when ``j <= r`` (:func:`cut_off` with
    the window's own ``W``), so one additive mask (R, S') serves every window."""
    rows, sinks = q_tail.shape[-2], k_sink.shape[-2]
    ahead = torch.ones(rows, sinks, dtype=torch.bool, device=q_tail.device).triu_(1)
    mask = torch.zeros(rows, sinks, dtype=q_tail.dtype, device=q_tail.device).masked_fill_(ahead, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_tail[None], k_sink[None], v_sink[None], 0.0, False, attn_mask=mask[None, None], scale=scale,
    )
    return out[0], lse[0].to(q_tail.dtype)


def sink_backward(
    q_tail: torch.Tensor,
    k_sink: torch.Tensor,
    v_sink: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sink part's gradients ``(dq_tail, dk_sink, dv_sink)`` given the merged ``out`` and ``lse``.

    ``dk_sink`` and ``dv_sink`` keep the leading dims of ``q_tail`` (sum them
    over any dims ``k_sink`` was broadcast along); all three are in the compute
    dtype (float32 for half-precision inputs).
    """
    dtype = _compute_dtype(q_tail.dtype)
    scores = _sink_scores(q_tail, k_sink, scale, window)
    probs = torch.exp(scores - lse.to(dtype)[..., None])
    grad, out = grad.to(dtype), out.to(dtype)
    delta = (grad * out).sum(-1, keepdim=True)
    dscores = (torch.matmul(grad, v_sink.to(dtype).transpose(-1, -2)) - delta) * probs
    dq = torch.matmul(dscores, k_sink.to(dtype)) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), q_tail.to(dtype)) * scale
    dv = torch.matmul(probs.transpose(-1, -2), grad)
    return dq, dk, dv
