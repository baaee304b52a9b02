"""A transformers KV cache that keeps, per KV head, only its window and its sink tokens.

Built on transformers' cache-layer API (``CacheLayerMixin``): one :class:`WindowCacheLayer`
per decoder layer inside a plain ``transformers.Cache``. The query heads that read one KV
head share a buffer of ``S + C`` slots, where ``S`` is the number of sink tokens and ``C`` the
largest window among those query heads (capped by ``max_cache_len`` when given): slots ``0..S-1`` hold each row's sink tokens (its first ``S`` real
tokens, so left padding is respected), and the other slots are a ring over every position
(position ``p`` in slot ``p mod C``). A key inside a head's window is read from the ring; a
sink outside it from its sink slot, so no key is counted twice. With one window per KV group
(``kv_group`` granularity) the buffer holds exactly what the heads read, so KV memory follows
the windows (paper section 5.10's ACR, counted with sinks).

Memory is bounded by what is stored: the ring grows with the tokens seen up to ``C`` (a
window at or above the context costs what a dynamic cache costs), never beyond.

A decode step with a full ring and one window per group needs no mask at all (softmax does
not care about key order): once the sinks have left every window it is one fused SDPA call
over the buffer. Every other call (chunked prefill after a prefix, mixed windows in a group,
padding) attends over the buffer plus the new tokens with an exact position mask, then stores
the new tokens.

``crop`` (assisted decoding, prompt lookup) is exact: while transformers has past recording on
(``activate_past_recording``, which assisted decoding calls), each write records what it
overwrites, and ``crop`` puts it back; a cache made with ``crop_limit > 0`` records the last
``crop_limit`` positions always. A crop that reaches back further, or into a write an earlier
crop cut in two, raises ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ._transformers import require
from .patching import LayerWindows, attend_without_cache, layer_specs, visible_keys
from .windowed_kv import Pending, WindowedKV

__all__ = ["WindowCacheLayer", "new_cache", "cache_memory_bytes"]

_transformers_cache = require("transformers.cache_utils")

@dataclass
class _Undo:
    """One write to one group's ring, as far as ``crop`` may take it back.

    Positions ``start..end-1`` were written. ``slots``/``old_*`` hold what the slots of the
    undoable positions (those at or after ``end - crop_limit``) held before; ``skipped_*`` the
    positions of the write itself that never reached the ring (a write longer than the ring)
    but that a crop back into the write needs again.
    """

    start: int
    end: int
    slots: torch.Tensor  # (n,) ring slots of positions end-n..end-1
    old_positions: torch.Tensor  # (n,) what those slots held before (-1: empty)
    old_keys: torch.Tensor | None  # (B, kv, n, D); None when every slot was empty
    old_values: torch.Tensor | None
    skipped_start: int = 0  # positions skipped_start.. of the write, kept for a crop
    skipped_keys: torch.Tensor | None = None  # (B, kv, m, D)
    skipped_values: torch.Tensor | None = None


@dataclass
class _Group:
    """KV heads that share one buffer capacity, and the query heads that read them."""

    capacity: int  # ring slots after the sinks, at most
    kv_heads: list[int]
    query_heads: list[int]
    query_windows: tuple[int, ...]
    keys: torch.Tensor | None = None  # (B, len(kv_heads), S + allocated, D)
    values: torch.Tensor | None = None
    ring_positions: torch.Tensor | None = field(default=None)  # (allocated,), -1 where empty
    undo: list[_Undo] = field(default_factory=list)

    @property
    def allocated(self) -> int:
        return 0 if self.ring_positions is None else int(self.ring_positions.numel())


class WindowCacheLayer(_transformers_cache.CacheLayerMixin):
    """One layer's per-head-window cache; see the module docstring for the layout."""

    is_sliding = False
    is_compileable = False

    def __init__(
        self,
        windows: tuple[int, ...],
        sink_tokens: int,
        num_kv_heads: int,
        *,
        max_cache_len: int | None = None,
        crop_limit: int = 0,
    ):
        super().__init__()
        heads = len(windows)
        if num_kv_heads < 1 or heads % num_kv_heads:
            raise ValueError(f"{heads} query heads cannot share {num_kv_heads} KV heads")
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len must be >= 1, got {max_cache_len}")
        if crop_limit < 0:
            raise ValueError(f"crop_limit must be >= 0, got {crop_limit}")
        rep = heads // num_kv_heads
        by_capacity: dict[int, list[int]] = {}
        for kv in range(num_kv_heads):
            capacity = max(windows[kv * rep:(kv + 1) * rep])
            if max_cache_len is not None:
                capacity = min(capacity, max_cache_len)
            by_capacity.setdefault(capacity, []).append(kv)
        self.groups = []
        for capacity, kv_heads in sorted(by_capacity.items()):
            query_heads = [kv * rep + r for kv in kv_heads for r in range(rep)]
            self.groups.append(_Group(capacity, kv_heads, query_heads, tuple(windows[h] for h in query_heads)))
        self.windows = tuple(windows)
        self.sink_tokens = sink_tokens
        self.num_kv_heads = num_kv_heads
        self.max_cache_len = max_cache_len
        self.crop_limit = crop_limit
        self.record_past = False  # transformers' flag: record every write until the next crop
        self.cumulative_length = 0
        self._crop_floor = 0  # no crop may reach below this position (an earlier crop cut a write there)
        self.sink_start: torch.Tensor | None = None  # (B,) first real position of each row

    # -- transformers' cache-layer API ------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, dim = key_states.shape
        if kv_heads != self.num_kv_heads:
            raise ValueError(f"the cache was built for {self.num_kv_heads} KV heads, the model gives {kv_heads}")
        self.dtype, self.device = key_states.dtype, key_states.device
        for g in self.groups:
            g.keys = key_states.new_zeros(batch, len(g.kv_heads), self.sink_tokens, dim)
            g.values = value_states.new_zeros(batch, len(g.kv_heads), self.sink_tokens, value_states.shape[-1])
            g.ring_positions = torch.full((0,), -1, dtype=torch.long, device=self.device)
            g.undo = []
        self.sink_start = torch.zeros(batch, dtype=torch.long, device=self.device)
        self._crop_floor = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Returns the new keys and values as :class:`WindowedKV` tensors, which the ``"aah"``
        attention reads; the layer stores them while it attends."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.sink_start.shape[0]:
            raise ValueError(
                f"this window cache holds a batch of {self.sink_start.shape[0]} rows, the model gives "
                f"{key_states.shape[0]}; call cache.reset() before a batch of another size"
            )
        pending = Pending(self, key_states, value_states, self.cumulative_length)
        self.cumulative_length += key_states.shape[-2]
        return WindowedKV.wrap(key_states, pending), WindowedKV.wrap(value_states, pending)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask covers absolute positions 0..t-1; attend() picks the columns it keeps.
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Forget every token and the batch size (the next update may bring another)."""
        for g in self.groups:
            g.keys = g.values = g.ring_positions = None
            g.undo = []
        self.sink_start = None
        self.cumulative_length = 0
        self._crop_floor = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def _select_rows(self, select) -> None:
        if not self.is_initialized:
            return
        for g in self.groups:
            g.keys, g.values = select(g.keys), select(g.values)
            for record in g.undo:
                for name in ("old_keys", "old_values", "skipped_keys", "skipped_values"):
                    if getattr(record, name) is not None:
                        setattr(record, name, select(getattr(record, name)))
        self.sink_start = select(self.sink_start)

    @property
    def is_croppable(self) -> bool:  # noqa: D102 - transformers' flag
        return self.crop_limit > 0 or self.record_past

    def activate_past_recording(self) -> None:
        """Record every write from now on, so that ``crop`` can take back a whole write (transformers
        calls this before assisted decoding and prompt lookup)."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last ``-tokens_to_remove`` positions (a negative count, as transformers'
        layers take it; 0 does nothing); exact, or ``ValueError`` when that reaches back further
        than the last ``crop_limit`` positions."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        target = self.cumulative_length + tokens_to_remove
        if target >= self.cumulative_length or not self.is_initialized:
            return
        if target < 0:
            raise ValueError(f"cannot crop {-tokens_to_remove} of {self.cumulative_length} tokens")
        reach = self.cumulative_length - self.crop_limit
        if self.record_past and self.groups[0].undo:
            reach = min(reach, self.groups[0].undo[-1].start)
        if target < max(reach, self._crop_floor):
            raise ValueError(
                f"this window cache can take back its positions only down to {max(reach, self._crop_floor)} "
                f"(the last write while transformers records the past, the last {self.crop_limit} positions "
                f"by crop_limit of aah.hf.new_cache, and never into a write an earlier crop cut); "
                f"cropping {self.cumulative_length} tokens to {target} needs more"
            )
        for g in self.groups:
            self._undo_to(g, target)
        self.cumulative_length = target

    def _undo_to(self, g: _Group, target: int) -> None:
        """Put the ring back as it was after position ``target - 1`` was written."""
        sinks = self.sink_tokens
        while g.undo and g.undo[-1].end > target:
            r = g.undo.pop()
            drop = max(0, target - (r.end - r.slots.numel()))  # written slots of positions < target stay
            slots = r.slots[drop:]
            g.ring_positions[slots] = r.old_positions[drop:]
            if r.old_keys is not None:
                g.keys[:, :, sinks + slots] = r.old_keys[:, :, drop:]
                g.values[:, :, sinks + slots] = r.old_values[:, :, drop:]
            if r.start >= target:
                continue
            self._crop_floor = max(self._crop_floor, target)  # the rest of this write is not recorded
            if r.skipped_keys is not None:  # positions of this write that the ring never held
                lo = max(r.skipped_start, target - g.capacity)
                hi = min(target, r.skipped_start + r.skipped_keys.shape[2])
                if hi > lo:
                    pos = torch.arange(lo, hi, device=g.ring_positions.device)
                    back = sinks + pos % g.capacity
                    g.keys[:, :, back] = r.skipped_keys[:, :, lo - r.skipped_start:hi - r.skipped_start]
                    g.values[:, :, back] = r.skipped_values[:, :, lo - r.skipped_start:hi - r.skipped_start]
                    g.ring_positions[pos % g.capacity] = pos
            break

    def memory_bytes(self) -> int:
        """Bytes held by this layer's key and value buffers (records for ``crop`` included)."""
        tensors = [t for g in self.groups for t in (g.keys, g.values) if t is not None]
        tensors += [
            t for g in self.groups for r in g.undo
            for t in (r.old_keys, r.old_values, r.skipped_keys, r.skipped_values) if t is not None
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- attention ------------------------------------------------------------------------

    def attend(
        self,
        query: torch.Tensor,
        pending: Pending,
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
        if attention_mask is not None and self.sink_tokens:
            self._find_sinks(pending.start, attention_mask)
        if pending.start == 0:
            out = attend_without_cache(query, pending.keys, pending.values, attention_mask, scaling, spec)
            self._store(pending.keys, pending.values, 0)
            return out
        if self._can_decode_unmasked(query, pending, attention_mask):
            self._store(pending.keys, pending.values, pending.start)
            return self._decode_unmasked(query, scaling)
        out = self._attend_masked(query, pending, attention_mask, scaling)
        self._store(pending.keys, pending.values, pending.start)
        return out

    def _find_sinks(self, start: int, attention_mask: torch.Tensor) -> None:
        """Rows with no real token stored yet (all of them in the first call; a row whose earlier
        calls held only padding) take their first real token, where their sinks start, from the
        last row of this call's mask."""
        unknown = self.sink_start >= start
        if not bool(unknown.any()):
            return
        kv_len = attention_mask.shape[-1]
        row = visible_keys(1, kv_len, attention_mask[:, :, -1:], self.sink_start.device)[:, 0, 0]
        first = torch.where(row, torch.arange(kv_len, device=row.device), kv_len).amin(dim=-1)
        self.sink_start = torch.where(unknown, first, self.sink_start)

    def _can_decode_unmasked(self, query, pending: Pending, attention_mask) -> bool:
        """One new token, no padding, one window per group, rings full and sinks out of every window."""
        if query.shape[2] != 1 or attention_mask is not None:
            return False
        pos = pending.start
        return all(
            pos - g.capacity + 1 >= self.sink_tokens and all(w >= g.capacity for w in g.query_windows)
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
        pending: Pending,
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
            ring_ok = (g.ring_positions >= 0)[None, None, None, :] & in_window[..., sinks:sinks + g.allocated]
            new_is_sink = (qpos[None] >= self.sink_start[:, None]) & (qpos[None] < self.sink_start[:, None] + sinks)
            new_ok = in_window[..., sinks + g.allocated:] | new_is_sink[:, None, None, :]
            allowed = torch.cat([sink_slot_ok, ring_ok, new_ok], dim=-1) & (dist >= 0)[:, None]
            if visible is not None:
                columns = kpos.clamp(0, visible.shape[-1] - 1)[:, None, None, :].expand(-1, 1, new, -1)
                allowed = allowed & visible.gather(-1, columns)
            allowed = allowed | (~allowed.any(-1, keepdim=True) & (dist == 0)[:, None])
            q = query[:, g.query_heads]
            out[:, g.query_heads] = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=allowed, scale=scaling, enable_gqa=q.shape[1] != keys.shape[1]
            )
        return out

    def _grow(self, g: _Group, needed: int) -> None:
        """Make room for ``needed`` ring slots (at most the capacity): positions below the
        capacity sit in slot = position, so the stored prefix is copied as it is."""
        size = min(g.capacity, needed)
        extra = size - g.allocated
        if extra <= 0:
            return
        batch, kv, _, dim = g.keys.shape
        g.keys = torch.cat([g.keys, g.keys.new_zeros(batch, kv, extra, dim)], dim=2)
        g.values = torch.cat([g.values, g.values.new_zeros(batch, kv, extra, g.values.shape[-1])], dim=2)
        g.ring_positions = torch.cat([g.ring_positions, g.ring_positions.new_full((extra,), -1)])

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
            if self.max_cache_len is not None and start + new > self.max_cache_len and g.capacity < max(g.query_windows):
                raise ValueError(
                    f"this window cache holds at most max_cache_len={self.max_cache_len} positions, and "
                    f"{start + new} would push keys out of windows of up to {max(g.query_windows)}; "
                    "build it with a larger max_cache_len (aah.hf.new_cache)"
                )
            self._grow(g, start + new)
            first = max(start, start + new - g.capacity)  # older ones would be overwritten at once
            pos = torch.arange(first, start + new, device=g.ring_positions.device)
            slots = pos % g.capacity
            if self.crop_limit or self.record_past:
                self._record(g, start, start + new, first, slots, k, v)
            g.keys[:, :, sinks + slots] = k[:, :, first - start:]
            g.values[:, :, sinks + slots] = v[:, :, first - start:]
            g.ring_positions[slots] = pos

    def _record(self, g: _Group, start: int, end: int, first: int, slots, k, v) -> None:
        """Keep what the write of positions ``start..end-1`` overwrites, for its last
        ``crop_limit`` positions, and the positions it skips that a crop back into it needs."""
        limit, sinks = self.crop_limit, self.sink_tokens
        n = slots.numel() if self.record_past else min(slots.numel(), limit)
        slots = slots[slots.numel() - n:]
        old = g.ring_positions[slots].clone()
        held = bool((old >= 0).any())
        record = _Undo(
            start, end, slots, old,
            g.keys[:, :, sinks + slots].clone() if held else None,
            g.values[:, :, sinks + slots].clone() if held else None,
        )
        skipped_start = start if self.record_past else max(start, end - limit - g.capacity)
        if first > skipped_start:  # the write was longer than the ring
            record.skipped_start = skipped_start
            record.skipped_keys = k[:, :, skipped_start - start:first - start].clone()
            record.skipped_values = v[:, :, skipped_start - start:first - start].clone()
        while g.undo and g.undo[0].end <= end - limit:
            g.undo.pop(0)
        g.undo.append(record)


def new_cache(model: torch.nn.Module, *, max_cache_len: int | None = None, crop_limit: int = 0):
    """A ``transformers.Cache`` of :class:`WindowCacheLayer`, one per layer of a patched model.

    Each ring grows with the tokens seen up to its largest window (or ``max_cache_len``, when
    given: a cache that would then lose keys inside a window raises ``ValueError`` instead), so
    windows at or above the context cost what a dynamic cache costs. ``crop_limit`` is how many
    of the last positions ``crop`` can always take back exactly.
    """
    specs = layer_specs(model)
    config = model.config
    num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    layers = [
        WindowCacheLayer(spec.windows, spec.sink_tokens, num_kv, max_cache_len=max_cache_len, crop_limit=crop_limit)
        for spec in specs
    ]
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
