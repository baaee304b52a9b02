"""A transformers KV cache that keeps, per KV head, only its window and its sink tokens.

Built on transformers' cache-layer API (``CacheLayerMixin``): one :class:`WindowCacheLayer`
per decoder layer inside a plain ``transformers.Cache``. The query heads that read one KV
head share a buffer of ``S + C`` slots, where ``S`` is the number of sink tokens and ``C`` the
largest window among those query heads: slots ``0..S-1`` hold each row's sink tokens (its
first ``S`` real tokens, so left padding is respected), and the other ``C`` slots are a ring
over every position. A key inside a head's window is read from the ring; a sink outside it
from its sink slot, so no key is counted twice. With one window per KV group
(``kv_group`` granularity) the buffer holds exactly what the heads read, so KV memory follows
the windows (paper section 5.10's ACR, counted with sinks).

A decode step with a full ring and one window per group needs no mask at all (softmax does
not care about key order): once the sinks have left every window it is one fused SDPA call
over the buffer. Every other call
(chunked prefill after a prefix, mixed windows in a group, padding) attends over the buffer
plus the new tokens with an exact position mask, then stores the new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ._transformers import require
from .patching import LayerWindows, attend_without_cache, first_real_position, layer_specs
from .windowed_kv import WindowedKV

__all__ = ["WindowCacheLayer", "new_cache", "cache_memory_bytes"]

_transformers_cache = require("transformers.cache_utils")


@dataclass
class _Group:
    """KV heads that share one buffer capacity, and the query heads that read them."""

    capacity: int  # ring slots after the sinks
    kv_heads: list[int]
    query_heads: list[int]
    query_windows: tuple[int, ...]
    keys: torch.Tensor | None = None  # (B, len(kv_heads), S + capacity, D)
    values: torch.Tensor | None = None
    ring_positions: torch.Tensor | None = field(default=None)  # (capacity,), -1 where empty


class WindowCacheLayer(_transformers_cache.CacheLayerMixin):
    """One layer's per-head-window cache; see the module docstring for the layout."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, windows: tuple[int, ...], sink_tokens: int, num_kv_heads: int):
        super().__init__()
        heads = len(windows)
        if num_kv_heads < 1 or heads % num_kv_heads:
            raise ValueError(f"{heads} query heads cannot share {num_kv_heads} KV heads")
        rep = heads // num_kv_heads
        by_capacity: dict[int, list[int]] = {}
        for kv in range(num_kv_heads):
            by_capacity.setdefault(max(windows[kv * rep:(kv + 1) * rep]), []).append(kv)
        self.groups = []
        for capacity, kv_heads in sorted(by_capacity.items()):
            query_heads = [kv * rep + r for kv in kv_heads for r in range(rep)]
            self.groups.append(_Group(capacity, kv_heads, query_heads, tuple(windows[h] for h in query_heads)))
        self.windows = tuple(windows)
        self.sink_tokens = sink_tokens
        self.num_kv_heads = num_kv_heads
        self.cumulative_length = 0
        self.sink_start: torch.Tensor | None = None  # (B,) first real position of each row

    # -- transformers' cache-layer API ------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, dim = key_states.shape
        if kv_heads != self.num_kv_heads:
            raise ValueError(f"the cache was built for {self.num_kv_heads} KV heads, the model gives {kv_heads}")
        self.dtype, self.device = key_states.dtype, key_states.device
        for g in self.groups:
            slots = self.sink_tokens + g.capacity
            g.keys = key_states.new_zeros(batch, len(g.kv_heads), slots, dim)
            g.values = value_states.new_zeros(batch, len(g.kv_heads), slots, value_states.shape[-1])
            g.ring_positions = torch.full((g.capacity,), -1, dtype=torch.long, device=self.device)
        self.sink_start = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pending = WindowedKV(self, key_states, value_states, self.cumulative_length)
        self.cumulative_length += key_states.shape[-2]
        return pending, pending

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask covers absolute positions 0..t-1; attend() picks the columns it keeps.
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for g in self.groups:
            if g.keys is not None:
                g.keys.zero_()
                g.values.zero_()
                g.ring_positions.fill_(-1)
        if self.sink_start is not None:
            self.sink_start.zero_()
        self.cumulative_length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for g in self.groups:
            if g.keys is not None:
                g.keys = g.keys.index_select(0, beam_idx.to(g.keys.device))
                g.values = g.values.index_select(0, beam_idx.to(g.values.device))
        if self.sink_start is not None:
            self.sink_start = self.sink_start.index_select(0, beam_idx.to(self.sink_start.device))

    def memory_bytes(self) -> int:
        """Bytes held by this layer's key and value buffers."""
        return sum(
            t.numel() * t.element_size() for g in self.groups for t in (g.keys, g.values) if t is not None
        )

    # -- attention ------------------------------------------------------------------------

    def attend(
        self,
        query: torch.Tensor,
        pending: WindowedKV,
        attention_mask: torch.Tensor | None,
        scaling: float | None,
        spec: LayerWindows,
    ) -> torch.Tensor:
        """Attend ``query`` (B, H, T_new, D) over the cached window plus the new tokens; store them."""
        if spec.windows != self.windows or spec.sink_tokens != self.sink_tokens:
            raise ValueError(
                "this cache was built for other windows than the model now runs; "
                "build a new one with aah.hf.new_cache(model)"
            )
        if pending.start == 0:
            if attention_mask is not None:
                self.sink_start = first_real_position(attention_mask).to(self.sink_start.device)
            out = attend_without_cache(query, pending.keys, pending.values, attention_mask, scaling, spec)
            self._store(pending.keys, pending.values, 0)
            return out
        if self._can_decode_unmasked(query, pending, attention_mask):
            self._store(pending.keys, pending.values, pending.start)
            return self._decode_unmasked(query, scaling)
        out = self._attend_masked(query, pending, attention_mask, scaling)
        self._store(pending.keys, pending.values, pending.start)
        return out

    def _can_decode_unmasked(self, query, pending: WindowedKV, attention_mask) -> bool:
        """One new token, no padding, one window per group, rings full and sinks out of every window."""
        if query.shape[2] != 1 or attention_mask is not None:
            return False
        pos = pending.start
        return all(
            pos - g.capacity + 1 >= self.sink_tokens and all(w == g.capacity for w in g.query_windows)
            for g in self.groups
        )

    def _decode_unmasked(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        if len(self.groups) == 1:
            g = self.groups[0]
            return F.scaled_dot_product_attention(
                query, g.keys, g.values, scale=scaling, enable_gqa=query.shape[1] != g.keys.shape[1]
            )
        out = torch.empty_like(query)
        for g in self.groups:
            q = query[:, g.query_heads]
            out[:, g.query_heads] = F.scaled_dot_product_attention(
                q, g.keys, g.values, scale=scaling, enable_gqa=q.shape[1] != g.keys.shape[1]
            )
        return out

    def _sink_positions(self) -> torch.Tensor:
        """(B, S) position held by each sink slot of each row."""
        return self.sink_start[:, None] + torch.arange(self.sink_tokens, device=self.sink_start.device)

    def _attend_masked(
        self,
        query: torch.Tensor,
        pending: WindowedKV,
        attention_mask: torch.Tensor | None,
        scaling: float | None,
    ) -> torch.Tensor:
        batch, new = query.shape[0], pending.keys.shape[2]
        device, sinks = query.device, self.sink_tokens
        qpos = torch.arange(pending.start, pending.start + new, device=device)
        sink_pos = self._sink_positions()  # (B, S)
        visible = None
        if attention_mask is not None:
            visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        out = torch.empty_like(query)
        for g in self.groups:
            keys = torch.cat([g.keys, pending.keys[:, g.kv_heads]], dim=2)
            values = torch.cat([g.values, pending.values[:, g.kv_heads]], dim=2)
            # Positions of every key column, per row: sink slots, ring slots, new tokens.
            kpos = torch.cat([sink_pos, g.ring_positions.expand(batch, -1), qpos.expand(batch, -1)], dim=1)
            dist = qpos[None, :, None] - kpos[:, None, :]  # (B, T_new, K)
            windows = torch.tensor(g.query_windows, device=device)[None, :, None, None]
            in_window = dist[:, None] < windows  # (B, heads, T_new, K)
            stored_sink = (sink_pos < pending.start)[:, None, None, :]  # sink slots written before
            sink_slot_ok = stored_sink & ~in_window[..., :sinks]  # a sink outside the window
            ring_ok = (g.ring_positions >= 0)[None, None, None, :] & in_window[..., sinks:sinks + g.capacity]
            new_is_sink = (qpos[None] >= self.sink_start[:, None]) & (qpos[None] < self.sink_start[:, None] + sinks)
            new_ok = in_window[..., sinks + g.capacity:] | new_is_sink[:, None, None, :]
            allowed = torch.cat([sink_slot_ok, ring_ok, new_ok], dim=-1) & (dist >= 0)[:, None]
            if visible is not None:
                allowed = allowed & visible.gather(-1, kpos.clamp(min=0)[:, None, None, :].expand(-1, 1, new, -1))
            allowed = allowed | (~allowed.any(-1, keepdim=True) & (dist == 0)[:, None])
            q = query[:, g.query_heads]
            out[:, g.query_heads] = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=allowed, scale=scaling, enable_gqa=q.shape[1] != keys.shape[1]
            )
        return out

    def _store(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Write positions ``start..`` into each row's sink slots and into the rings."""
        batch, _, new, dim = keys.shape
        sinks = self.sink_tokens
        sink_pos = self._sink_positions() if sinks else None
        for g in self.groups:
            k, v = keys[:, g.kv_heads], values[:, g.kv_heads]
            if sinks:
                fresh = (sink_pos >= start) & (sink_pos < start + new)  # (B, S)
                if bool(fresh.any()):
                    index = (sink_pos - start).clamp(0, new - 1)[:, None, :, None].expand(-1, k.shape[1], -1, dim)
                    take = fresh[:, None, :, None]
                    g.keys[:, :, :sinks] = torch.where(take, k.gather(2, index), g.keys[:, :, :sinks])
                    g.values[:, :, :sinks] = torch.where(take, v.gather(2, index), g.values[:, :, :sinks])
            first = max(start, start + new - g.capacity)  # older ones would be overwritten at once
            pos = torch.arange(first, start + new, device=g.ring_positions.device)
            slots = pos % g.capacity
            g.keys[:, :, sinks + slots] = k[:, :, first - start:]
            g.values[:, :, sinks + slots] = v[:, :, first - start:]
            g.ring_positions[slots] = pos


def new_cache(model: torch.nn.Module):
    """A ``transformers.Cache`` of :class:`WindowCacheLayer`, one per layer of a patched model."""
    specs = layer_specs(model)
    config = model.config
    num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    layers = [WindowCacheLayer(spec.windows, spec.sink_tokens, num_kv) for spec in specs]
    return _transformers_cache.Cache(layers=layers)


def cache_memory_bytes(cache) -> int:
    """KV bytes held by ``cache``: a window cache, or any transformers cache with keys/values."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, WindowCacheLayer):
            total += layer.memory_bytes()
        else:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total
