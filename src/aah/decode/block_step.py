"""Which decode step a GPT block runs, and the compiled one (paper section 5.8).

:meth:`aah.model.Block.forward` hands every one-token step with a cache to :func:`block_step`.
It runs the whole block (norm, QKV projection, rotary embedding, ring write, each head's
window, output projection, residual, norm, MLP, residual) as one call of
:func:`aah.decode.ring_decode.decode_block` where that computes exactly what the modules
compute: evaluation mode without gradients, CPU in the cache's dtype (float32 or bfloat16),
the compiled step built, plain ``nn.Linear`` and ``nn.LayerNorm`` / ``nn.RMSNorm`` modules
whose tensors have that dtype, no forward hook and no autocast. Otherwise it returns ``None``
and the block runs its modules, whose attention reads the cache as
:meth:`aah.decode.cache.LayerKVCache.update_and_attend` decides. The cache layer records the
route (:attr:`~aah.decode.cache.LayerKVCache.route`).
"""

from __future__ import annotations

import torch
from torch import nn

from . import ring_decode
from .cache import LayerKVCache

__all__ = ["block_step"]


def block_step(block: nn.Module, x: torch.Tensor, cache: LayerKVCache) -> torch.Tensor | None:
    """The output (B, 1, d_model) of one decode step of ``block`` (an :class:`aah.model.Block`) for
    ``x`` (B, 1, d_model) through the compiled step, or ``None`` where the modules must run."""
    weights = _compiled_block(block, x, cache)
    if weights is None:
        return None
    attn = block._modules["attn"]
    cos, sin = (None, None) if attn.rotary is None else attn.rotary.tables()
    b = x.shape[0]
    y = cache.decode_block(x.view(b, -1), weights, cos, sin)
    if attn.last_windows != cache.windows:  # nn.Module.__setattr__ costs a few microseconds a step
        attn.last_windows = cache.windows
    return y.view(b, 1, -1)


def _compiled_block(block: nn.Module, x: torch.Tensor, cache: LayerKVCache) -> ring_decode.Block | None:
    """The block's tensors as :func:`aah.decode.ring_decode.decode_block` reads them, or ``None``."""
    if block.training or torch.is_grad_enabled() or cache.length == 0:
        return None
    if x.dtype not in (torch.float32, torch.bfloat16) or not cache.store.compiled_ready(x):
        return None
    # Read from the module dictionaries: a decode step pays for every nn.Module attribute lookup.
    mods = block._modules
    attn, mlp = mods["attn"], mods["mlp"]
    n1, n2 = mods["norm1"], mods["norm2"]
    qkv, out, up, down = attn._modules["qkv"], attn._modules["out"], mlp._modules["up"], mlp._modules["down"]
    if any(type(m) is not nn.Linear for m in (qkv, out, up, down)):
        return None  # a subclass or wrapper (a parametrization, an adapter) may compute something else
    if type(n1) not in (nn.LayerNorm, nn.RMSNorm) or type(n2) is not type(n1):
        return None
    extras = tuple(m for m in (attn.rotary, attn.aah_state, mods["dropout"]) if m is not None)
    if ring_decode.hooks_or_autocast(block, n1, attn, qkv, out, n2, mlp, up, down, *extras):
        return None
    norm = "layernorm" if type(n1) is nn.LayerNorm else "rmsnorm"
    # RMSNorm's default eps is that of the dtype it computes in (float32 for bfloat16 input).
    default_eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
    eps = (default_eps if n1.eps is None else n1.eps, default_eps if n2.eps is None else n2.eps)
    return ring_decode.Block.of(x.dtype, norm, eps, mlp.activation, norm1=n1, qkv=qkv, out=out, norm2=n2, up=up, down=down)
