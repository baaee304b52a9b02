"""A key/value cache for decoding whose memory and reads follow the per-head windows (paper section 5.8).

Windowed execution (section 5.8) means a head with window ``W`` never looks
further back than ``W - 1`` positions. During autoregressive decoding the cache
therefore only has to keep, per layer and per KV head, the last few keys and
values: a ring buffer in which absolute position ``p`` lives in slot
``p % C``, ``C = min(max W of the KV head's query heads, max_len)``. The rings
are a :class:`aah.decode.rings.RingStore` (the storage the Hugging Face bridge's
cache uses too), with no sink tokens.

Grouped-query attention: the query heads that share a KV head may have
different windows; each reads only its own window of the ring. (The controller
option ``window_granularity="kv_group"`` gives the query heads of a KV head one
shared window, so that no entry is kept for a subset of them.) Memory per layer
is ``sum over KV heads of C * head_dim * 2 (K and V) * batch * bytes per
element``; :meth:`WindowKVCache.full_memory_bytes` is what an ordinary cache of
``max_len`` entries per KV head would take.

The windows are read from the model once, when the cache is created (at
length ``max_len``), and frozen: decoding runs in evaluation mode, where the
head controller never changes its windows. A forward that finds the model's
windows changed since then raises an error instead of decoding with stale
windows.

The routes of a call through a layer (:attr:`LayerKVCache.route`), one per
kind of call and device:

* ``prefill`` (the cache is empty): the model's execution backend
  (:func:`aah.attend`), then the last ``C`` keys and values of each KV head go
  into its ring;
* ``compiled block`` (one new token, CPU, the compiled step built, evaluation
  mode without gradients, float32 or bfloat16 in the cache's dtype, plain
  modules): the whole block in one call (:mod:`aah.decode.block_step`);
* ``compiled attention`` (one new token on CPU in the cache's dtype where the
  block's modules must run: a hook, a module subclass, float64): the new key
  and value are written, then one call of
  :func:`aah.decode.ring_decode.ring_decode` reads every head's window;
* ``masked`` (several tokens after a prefix; one token on another device, in
  another dtype than the cache's, with a gradient, or without the compiled
  step): exact attention over the rings plus the new keys, masked by
  :func:`aah.windows.visible` at the position each slot holds; the new entries
  are written afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..backends import attend
from ..windows import window_tuple
from . import ring_decode
from .rings import RingStore, joined_route, kv_capacities

__all__ = ["LayerKVCache", "WindowKVCache", "kv_capacities"]


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class LayerKVCache:
    """Ring-buffer cache of one attention layer; see the module docstring.

    ``windows`` holds one window per query head (values above ``max_len`` are
    clamped to it).
    """

    def __init__(
        self,
        windows: Sequence[int],
        num_kv_heads: int,
        head_dim: int,
        *,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        self.max_len = _positive_int(max_len, "max_len")
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.head_dim = _positive_int(head_dim, "head_dim")
        self.windows = tuple(min(w, self.max_len) for w in window_tuple(windows))
        self.store = RingStore(self.windows, num_kv_heads, max_len=self.max_len)
        self.capacities = self.store.capacities
        self.num_heads = len(self.windows)
        self.num_kv_heads = num_kv_heads
        self.dtype = dtype
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.store.allocate(self.batch_size, head_dim, head_dim, dtype, self.device, ring_slots=self.max_len)
        self.length = 0

    @property
    def route(self) -> str | None:
        """How the last call ran: ``prefill``, ``compiled block``, ``compiled attention`` or ``masked``."""
        return self.store.route

    @property
    def route_reason(self) -> str | None:
        """Why the last call took no faster compiled route (:func:`aah.decode.route.choose_route`)."""
        return self.store.route_reason

    # ------------------------------------------------------------------ memory
    def memory_bytes(self) -> int:
        """Bytes held by the ring buffers (keys and values)."""
        return self.store.memory_bytes()

    def full_memory_bytes(self) -> int:
        """Bytes an ordinary cache of ``max_len`` entries per KV head would take."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * self.max_len * self.head_dim * 2 * self.batch_size * element

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept and overwritten later)."""
        self.length = 0
        self.store.clear()

    # ------------------------------------------------------------------ contents
    def cached(self, kv_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys (B, n, D), values (B, n, D) and absolute positions (n,) held for one KV head, oldest first."""
        if not 0 <= kv_head < self.num_kv_heads:
            raise ValueError(f"kv_head must be in [0, {self.num_kv_heads}), got {kv_head}")
        return self.store.held(kv_head)

    # ------------------------------------------------------------------ attention
    def check_step(self, batch_size: int, num_tokens: int) -> None:
        """Raise ``ValueError`` unless ``num_tokens`` more positions of ``batch_size`` rows fit."""
        if batch_size != self.batch_size:
            raise ValueError(f"the cache was created for batch size {self.batch_size}, got {batch_size}")
        if num_tokens < 1:
            raise ValueError("a cached forward needs at least one new token")
        if self.length + num_tokens > self.max_len:
            raise ValueError(
                f"decoding past the cache length: {self.length} cached + {num_tokens} new positions "
                f"> max_len {self.max_len}"
            )

    def update_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        backend: str = "dense",
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attend ``T`` new queries at positions ``length .. length + T - 1`` and cache their keys.

        ``q`` is (B, H, T, D) and ``k``, ``v`` are (B, H_kv, T, D), already
        position-encoded at those absolute positions. Returns (B, H, T, D).
        ``backend`` is used by the prefill only.
        """
        b, h, t, d = q.shape
        if h != self.num_heads or k.shape[1] != self.num_kv_heads or d != self.head_dim:
            raise ValueError(
                f"q {tuple(q.shape)} / k {tuple(k.shape)} do not match the cache "
                f"({self.num_heads} heads, {self.num_kv_heads} KV heads, head dim {self.head_dim})"
            )
        if k.shape != v.shape or k.shape[0] != b or k.shape[2] != t:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}")
        self.check_step(b, t)
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        y = self.store.attend_and_store(
            q, k, v, self.length, scale=scale,
            # The ordinary execution path, windows clamped to the prompt as the model does.
            prefill=lambda: attend(q, k, v, tuple(min(w, t) for w in self.windows), backend=backend, scale=scale),
            compute=torch.promote_types(q.dtype, torch.float32),  # masked scores in float32 at least
        )
        self.length += t
        return y

    def decode_block(
        self, x: torch.Tensor, block: ring_decode.Block, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> torch.Tensor:
        """One decode step of a whole pre-norm block whose attention reads this cache; returns (B, d_model).

        ``x`` (B, d_model) is the block's input at position ``length``; ``cos``,
        ``sin`` the rotary tables (``None``: none). One call of
        :func:`aah.decode.ring_decode.decode_block` (:mod:`aah.decode.block_step` decides when).
        """
        if x.dim() != 2:
            raise ValueError(f"x must be (batch, d_model), got {tuple(x.shape)}")
        self.check_step(x.shape[0], 1)
        if self.length == 0:
            raise ValueError("a compiled decode step continues a prefix: prefill the cache first")
        out = self.store.decode_block(x.detach(), block, cos, sin, self.length, 1.0 / math.sqrt(self.head_dim))
        self.length += 1
        return out


class WindowKVCache:
    """Per-window KV cache of a whole :class:`aah.GPT`: one :class:`LayerKVCache` per attention layer.

    Create it with ``GPT.new_cache`` and pass it as ``model(idx, cache=cache)``;
    each call continues the cached prefix.
    """

    def __init__(self, layers: Sequence[LayerKVCache]):
        if not layers:
            raise ValueError("a WindowKVCache needs at least one layer")
        first = layers[0]
        for layer in layers:
            if (layer.batch_size, layer.max_len) != (first.batch_size, first.max_len):
                raise ValueError("all layers of a cache must share batch size and max_len")
        self.layers = list(layers)

    # ------------------------------------------------------------------ state
    @property
    def length(self) -> int:
        """Positions cached so far: the absolute position of the next token."""
        return self.layers[0].length

    @property
    def max_len(self) -> int:
        return self.layers[0].max_len

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    @property
    def route(self) -> str:
        """How the last call ran through the layers (:attr:`LayerKVCache.route`, joined with ``+`` where they differ)."""
        return joined_route(layer.route for layer in self.layers)

    @property
    def windows(self) -> torch.Tensor:
        """Frozen windows, LongTensor (layers, query heads)."""
        return torch.tensor([layer.windows for layer in self.layers], dtype=torch.long)

    @property
    def capacities(self) -> torch.Tensor:
        """Ring-buffer lengths, LongTensor (layers, KV heads)."""
        return torch.tensor([layer.capacities for layer in self.layers], dtype=torch.long)

    def reset(self) -> None:
        """Empty the cache so that it can serve a new prompt of the same batch size."""
        for layer in self.layers:
            layer.reset()

    def check_step(self, batch_size: int, num_tokens: int) -> None:
        """Raise ``ValueError`` unless ``num_tokens`` more positions fit (checked before any layer runs)."""
        lengths = {layer.length for layer in self.layers}
        if len(lengths) != 1:
            raise ValueError(f"the cache layers disagree on the cached length ({sorted(lengths)}); reset it")
        self.layers[0].check_step(batch_size, num_tokens)

    # ------------------------------------------------------------------ memory
    def memory_bytes(self) -> int:
        """Bytes held by all ring buffers."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def full_memory_bytes(self) -> int:
        """Bytes an ordinary full cache of ``max_len`` positions would take."""
        return sum(layer.full_memory_bytes() for layer in self.layers)

    def __repr__(self) -> str:
        return (
            f"WindowKVCache(layers={len(self.layers)}, batch={self.batch_size}, length={self.length}, "
            f"max_len={self.max_len}, memory={self.memory_bytes()} of {self.full_memory_bytes()} bytes)"
        )
