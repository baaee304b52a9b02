"""The compiled decode step of a GPT block: its weights, mapped for the kernel (paper section 5.8).

:meth:`aah.model.Block.forward` hands every one-token step with a cache to :func:`block_step`,
which asks :func:`aah.decode.route.choose_route` for the route. Where it is ``compiled block``
the whole block (norm, QKV projection, rotary embedding, ring write, each head's window, output
projection, residual, norm, MLP, residual) runs as one call of
:func:`aah.decode.ring_decode.decode_block`; otherwise the block runs its modules, whose
attention reads the cache by the same decision. This module only maps the block's weights (and
says when they cannot be mapped: a subclass or wrapper of ``nn.Linear`` or of the norms, or a
dtype the block kernel does not take). The cache layer records the route and why
(:attr:`~aah.decode.cache.LayerKVCache.route`).
"""

from __future__ import annotations

import torch
from torch import nn

from . import ring_decode
from .cache import LayerKVCache
from .route import BLOCK, choose_route, layer_reason

__all__ = ["block_step", "block_weights"]


def block_step(block: nn.Module, x: torch.Tensor, cache: LayerKVCache) -> torch.Tensor | None:
    """The output (B, 1, d_model) of one decode step of ``block`` (an :class:`aah.model.Block`) for
    ``x`` (B, 1, d_model) through the compiled step, or ``None`` where the modules must run."""
    route = choose_route(cache.store, x, start=cache.length, tokens=x.shape[1],
                         layer=lambda: layer_reason(block) or block_weights(block, x.dtype))
    if route.name != BLOCK:
        cache.store.note_layer_reason(route.reason)
        return None
    attn = block.attn
    cos, sin = (None, None) if attn.rotary is None else attn.rotary.tables()
    b = x.shape[0]
    y = cache.decode_block(x.view(b, -1), route.block, cos, sin)
    if attn.last_windows != cache.windows:  # nn.Module.__setattr__ costs a few microseconds a step
        attn.last_windows = cache.windows
    return y.view(b, 1, -1)


def block_weights(block: nn.Module, dtype: torch.dtype) -> ring_decode.Block | str:
    """The block's tensors as :func:`aah.decode.ring_decode.decode_block` reads them, or why not."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the block kernel computes in float32 or bfloat16, this step is {dtype}"
    attn, mlp, n1, n2 = block.attn, block.mlp, block.norm1, block.norm2
    if any(type(m) is not nn.Linear for m in (attn.qkv, attn.out, mlp.up, mlp.down)):
        return "a projection is not a plain nn.Linear"  # a parametrization or adapter may compute something else
    if type(n1) not in (nn.LayerNorm, nn.RMSNorm) or type(n2) is not type(n1):
        return "the norms are not plain nn.LayerNorm or nn.RMSNorm"
    norm = "layernorm" if type(n1) is nn.LayerNorm else "rmsnorm"
    # RMSNorm's default eps is that of the dtype it computes in (float32 for bfloat16 input).
    default_eps = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
    eps = (default_eps if n1.eps is None else n1.eps, default_eps if n2.eps is None else n2.eps)
    weights = ring_decode.Block.of(dtype, norm, eps, mlp.activation, norm1=n1, qkv=attn.qkv, out=attn.out,
                                   norm2=n2, up=mlp.up, down=mlp.down)
    return f"the block's weights are not contiguous {dtype} tensors" if weights is None else weights
