"""The page layout of vLLM's CPU KV cache, found by writing two pages through vLLM's own cache
writer and reading them back (:class:`aah.vllm.paged.PagedKV`). Imports vLLM."""

from __future__ import annotations

import functools

import torch

from vllm import _custom_ops as ops

from .paged import PagedKV

__all__ = ["keys_transposed"]


@functools.lru_cache(maxsize=8)
def keys_transposed(isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> bool:
    """Check how vLLM's cache writer lays out keys for ``isa``: ``True`` when a page stores
    ``K^T`` per KV head, ``False`` when it stores ``K``; refuse any other layout."""
    g = torch.Generator().manual_seed(0)
    tokens = 2 * block_size
    cache = torch.zeros(3, 2, block_size, 2 * head_size, dtype=dtype)
    view = cache.view(3, 2, 2 * block_size, head_size)
    key_cache, value_cache = view.chunk(2, dim=2)
    key = torch.randn(tokens, 2, head_size, generator=g).to(dtype)
    value = torch.randn(tokens, 2, head_size, generator=g).to(dtype)
    slots = torch.arange(block_size, block_size + tokens)  # pages 1 and 2
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    blocks, offsets = slots // block_size, slots % block_size
    for transposed in (True, False):
        paged = PagedKV(key_cache, value_cache, transposed)
        ok = all(
            torch.equal(paged.gather(h, blocks, offsets)[0], key[:, h])
            and torch.equal(paged.gather(h, blocks, offsets)[1], value[:, h])
            for h in range(2)
        )
        if ok:
            return transposed
    raise ValueError(
        f"aah.vllm: vLLM's CPU attention stores keys for isa={isa!r} (dtype {dtype}) in a page layout "
        "aah.vllm does not read; serve in float32 (isa 'vec') or without AAH_WINDOWS"
    )
