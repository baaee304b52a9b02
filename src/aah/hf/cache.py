"""A transformers KV cache that keeps, per KV head, only its window and its sink tokens.

Built on transformers' cache-layer API (``CacheLayerMixin``): one :class:`WindowCacheLayer`
per decoder layer inside a plain ``transformers.Cache``. The query heads that read one KV
head share ``S + C`` slots, where ``S`` is the number of sink tokens and ``C`` the largest
window among those query heads (capped by ``max_cache_len`` when given): slots ``0..S-1`` hold
each row's sink tokens (its first ``S`` real tokens, so left padding is respected), and the
other slots are a ring over every position (position ``p`` in slot ``p mod C``). A key inside a
head's window is read from the ring; a sink outside it from its sink slot, so no key is counted
twice (the rule of :func:`aah.windows.visible`). With one window per KV group (``kv_group``
granularity) the slots hold exactly what the heads read, so KV memory follows the windows
(paper section 5.10's ACR, counted with sinks).

All KV heads of a layer live in one pair of flat buffers (B, slots, D), KV heads of equal
capacity side by side; this is the layout the compiled decode steps of :mod:`aah.decode.ring_decode`
read (:meth:`WindowCacheLayer.ring_index`). A ring grows with the tokens seen, by at least an
eighth of its size at a time, up to ``C`` (a window at or above the context costs what a
dynamic cache costs), never beyond.

The routes of a call (:attr:`WindowCacheLayer.route`):

* ``compiled block``: a one-token step of a Llama, Mistral or Qwen2 layer without padding on
  CPU runs the whole decoder layer in one compiled call (:mod:`aah.hf.block_step`);
* ``compiled attention``: any other one-token step without padding on CPU runs the layer's
  modules, and its attention reads each head's window and the sinks before it from the flat
  buffers in one call (:func:`aah.decode.ring_decode.ring_decode`);
* ``masked``: everything else (chunked prefill after a prefix, padding, other devices, no
  compiler) attends over the slots plus the new tokens with an exact position mask, then
  stores the new tokens; ``prefill``: the first call, which the model's backends run.

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

from ..decode import ring_decode
from ..windows import visible
from ._transformers import require
from .patching import SPEC_ATTR, LayerWindows, attend_without_cache, layer_specs, visible_keys
from .windowed_kv import Pending, WindowedKV

__all__ = ["GROWTH", "WindowCacheLayer", "cache_memory_bytes", "cache_route", "new_cache"]

#: A ring that must grow grows by at least ``1 / GROWTH`` of its size (up to its capacity), so
#: that decoding while long rings fill copies the buffers rarely.
GROWTH = 8

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
    keys: torch.Tensor | None = None  # (B, len(kv_heads), S + allocated, D), a view of the layer's flat buffer
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
        self.windows_tensor = torch.tensor(self.windows, dtype=torch.long)  # as the compiled steps read them
        self.sink_tokens = sink_tokens
        self.num_kv_heads = num_kv_heads
        self.max_cache_len = max_cache_len
        self.crop_limit = crop_limit
        self.record_past = False  # transformers' flag: record every write until the next crop
        self.cumulative_length = 0
        self._crop_floor = 0  # no crop may reach below this position (an earlier crop cut a write there)
        self.sink_start: torch.Tensor | None = None  # (B,) first real position of each row
        # Every group's sink slots and ring side by side (groups in order, KV heads in order
        # within a group): (B, slots, D); each group's keys/values are views of them.
        self.flat_keys: torch.Tensor | None = None
        self.flat_values: torch.Tensor | None = None
        self._ring_index: tuple[torch.Tensor, ...] | None = None  # see ring_index()
        #: How the last call attended: "prefill" (no cache yet), "masked" (a chunk, padding, or no
        #: compiled step), "compiled attention" (one token, the attention compiled) or "compiled
        #: block" (one token, the whole decoder layer compiled, :mod:`aah.hf.block_step`).
        self.route: str | None = None

    # -- transformers' cache-layer API ------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, dim = key_states.shape
        if kv_heads != self.num_kv_heads:
            raise ValueError(f"the cache was built for {self.num_kv_heads} KV heads, the model gives {kv_heads}")
        self.dtype, self.device = key_states.dtype, key_states.device
        for g in self.groups:
            g.keys = g.values = None
            g.ring_positions = torch.full((0,), -1, dtype=torch.long, device=self.device)
            g.undo = []
        self._lay_out(batch, dim, value_states.shape[-1], [0] * len(self.groups))
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
        self.flat_keys = self.flat_values = self._ring_index = None
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
        self.flat_keys, self.flat_values = select(self.flat_keys), select(self.flat_values)
        self._views()
        for g in self.groups:
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
        tensors = [t for t in (self.flat_keys, self.flat_values) if t is not None]
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
            self.route = "prefill"
            out = attend_without_cache(query, pending.keys, pending.values, attention_mask, scaling, spec)
            self._store(pending.keys, pending.values, 0)
            return out
        if self._can_decode_compiled(query, pending, attention_mask):
            self.route = "compiled attention"
            self._store(pending.keys, pending.values, pending.start)
            return self._decode_compiled(query, scaling, pending.start + 1)
        self.route = "masked"
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

    def _compiled_ready(self, x: torch.Tensor) -> bool:
        """Whether the compiled steps can read this cache for ``x``: on CPU in the cache's dtype,
        every row starting at position 0 (no padding seen, so the sinks are positions 0..S-1),
        the extension built."""
        return (
            x.device.type == "cpu" and x.dtype == self.dtype and not bool(self.sink_start.any())
            and ring_decode.load() is not None
        )

    def _can_decode_compiled(self, query, pending: Pending, attention_mask) -> bool:
        """One new token without a padding mask, no gradient, and :meth:`_compiled_ready`."""
        return (
            query.shape[2] == 1 and attention_mask is None and not query.requires_grad
            and self._compiled_ready(query)
        )

    def _decode_compiled(self, query: torch.Tensor, scaling: float | None, length: int) -> torch.Tensor:
        """Each head's window and the sinks before it, read from the flat buffers in one call of
        :func:`aah.decode.ring_decode.ring_decode` (rows start at position 0: no padding)."""
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        ring_start, allocated, _ = self.ring_index()
        out = ring_decode.ring_decode(
            query[:, :, 0].contiguous(), self.flat_keys, self.flat_values, ring_start, allocated,
            self.windows_tensor, length, scale, sinks=self.sink_tokens,
        )
        return out[:, :, None]

    def decode_block(
        self,
        hidden_states: torch.Tensor,
        block: ring_decode.Block,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.Tensor | None,
        attention: torch.nn.Module,
    ) -> torch.Tensor | None:
        """One decode step of a whole decoder layer whose attention reads this cache, in one call
        of :func:`aah.decode.ring_decode.decode_block`; ``None`` where the step must take the module
        path (this cache records writes for ``crop``, a row was padded, the positions or the
        windows are not this cache's, no compiled step). ``hidden_states`` (B, 1, d_model)."""
        if not self.is_initialized or self.crop_limit or self.record_past:
            return None
        spec = getattr(attention, SPEC_ATTR, None)
        position, batch = self.cumulative_length, hidden_states.shape[0]
        if (
            spec is None or spec.windows != self.windows or spec.sink_tokens != self.sink_tokens
            or batch != self.sink_start.shape[0] or position < self.sink_tokens
            or (position_ids is not None and int(position_ids[0, -1]) != position)
            or not self._compiled_ready(hidden_states)
        ):
            return None
        self._check_room(position + 1)
        self._grow(position + 1)
        ring_start, allocated, scratch = self.ring_index()
        rings = ring_decode.Rings(self.flat_keys, self.flat_values, scratch, ring_start, allocated, self.windows_tensor)
        cos, sin = position_embeddings
        out = ring_decode.decode_block(
            hidden_states.reshape(batch, -1).contiguous(), block, cos[0], sin[0], rings, position + 1,
            attention.scaling, sinks=self.sink_tokens,
        )
        for g in self.groups:
            g.ring_positions[position % g.capacity] = position
        self.cumulative_length += 1
        self.route = "compiled block"
        return out.view(batch, 1, -1)

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
        unmasked = None
        if attention_mask is not None:
            unmasked = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        out = torch.empty_like(query)
        for g in self.groups:
            keys = torch.cat([g.keys, pending.keys[:, g.kv_heads]], dim=2)
            values = torch.cat([g.values, pending.values[:, g.kv_heads]], dim=2)
            # Positions of every key column, per row: sink slots, ring slots, new tokens.
            kpos = torch.cat([sink_pos, g.ring_positions.expand(batch, -1), qpos.expand(batch, -1)], dim=1)
            dist = qpos[None, :, None] - kpos[:, None, :]  # (B, T_new, K)
            windows = torch.tensor(g.query_windows, device=device)[None, :, None, None]
            in_window = dist[:, None] < windows  # (B, heads, T_new, K)
            rule = visible(qpos[:, None], kpos[:, None, None, :], windows, sinks, self.sink_start[:, None, None, None])
            # Each key is read from one column: a sink outside the window from its sink slot (once
            # written), every other key from the ring or the new tokens.
            stored_sink = (sink_pos < pending.start)[:, None, None, :]
            written = (g.ring_positions >= 0)[None, None, None, :]
            reader = torch.cat([
                stored_sink & ~in_window[..., :sinks], written & in_window[..., sinks:sinks + g.allocated],
                torch.ones_like(in_window[..., sinks + g.allocated:]),
            ], dim=-1)
            allowed = rule & reader
            if unmasked is not None:
                columns = kpos.clamp(0, unmasked.shape[-1] - 1)[:, None, None, :].expand(-1, 1, new, -1)
                allowed = allowed & unmasked.gather(-1, columns)
            allowed = allowed | (~allowed.any(-1, keepdim=True) & (dist == 0)[:, None])
            q = query[:, g.query_heads]
            out[:, g.query_heads] = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=allowed, scale=scaling, enable_gqa=q.shape[1] != keys.shape[1]
            )
        return out

    def _grow(self, needed: int) -> None:
        """Make room for ``needed`` ring slots in every group (at most its capacity), growing a ring
        by at least ``1 / GROWTH`` of its size: positions below the capacity sit in slot = position,
        so the stored prefix is copied as it is."""
        sizes = [g.allocated for g in self.groups]
        wanted = [
            size if size >= min(g.capacity, needed) else min(g.capacity, max(needed, size + size // GROWTH))
            for g, size in zip(self.groups, sizes)
        ]
        if wanted != sizes:
            _, _, key_dim = self.flat_keys.shape
            self._lay_out(self.flat_keys.shape[0], key_dim, self.flat_values.shape[-1], wanted)

    def _lay_out(self, batch: int, key_dim: int, value_dim: int, sizes: list[int]) -> None:
        """New flat buffers with ``sizes[i]`` ring slots for group ``i``, holding what the old ones held."""
        old = [(g.keys, g.values) for g in self.groups]
        sinks = self.sink_tokens
        total = sum(len(g.kv_heads) * (sinks + size) for g, size in zip(self.groups, sizes))
        like = dict(dtype=self.dtype, device=self.device)
        self.flat_keys = torch.zeros(batch, total, key_dim, **like)
        self.flat_values = torch.zeros(batch, total, value_dim, **like)
        for g, size in zip(self.groups, sizes):
            extra = size - g.allocated
            g.ring_positions = torch.cat([g.ring_positions, g.ring_positions.new_full((extra,), -1)])
        self._views()
        for g, (keys, values) in zip(self.groups, old):
            if keys is not None:
                g.keys[:, :, :keys.shape[2]] = keys
                g.values[:, :, :values.shape[2]] = values

    def _views(self) -> None:
        """Point every group's keys/values at its part of the flat buffers."""
        batch, sinks, offset = self.flat_keys.shape[0], self.sink_tokens, 0
        for g in self.groups:
            size = len(g.kv_heads) * (sinks + g.allocated)
            shape = (batch, len(g.kv_heads), sinks + g.allocated)
            g.keys = self.flat_keys[:, offset:offset + size].view(*shape, self.flat_keys.shape[-1])
            g.values = self.flat_values[:, offset:offset + size].view(*shape, self.flat_values.shape[-1])
            offset += size
        self._ring_index = None

    def ring_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ring_start, capacity, scratch) as the compiled steps read the flat buffers
        (:class:`aah.decode.ring_decode.Rings`): for every KV head, in KV head order, the slot of its
        first ring entry (its sinks in the slots before) and its allocated ring slots; a float32
        (1, slots) tensor the packed step marks (this cache keeps its own record of the slots)."""
        if self._ring_index is None:
            start = [0] * self.num_kv_heads
            allocated = [0] * self.num_kv_heads
            offset = 0
            for g in self.groups:
                for kv in g.kv_heads:
                    start[kv], allocated[kv] = offset + self.sink_tokens, g.allocated
                    offset += self.sink_tokens + g.allocated
            self._ring_index = (
                torch.tensor(start, dtype=torch.long), torch.tensor(allocated, dtype=torch.long),
                torch.zeros(1, offset, dtype=torch.float32),
            )
        return self._ring_index

    def _check_room(self, end: int) -> None:
        """``ValueError`` when holding positions up to ``end - 1`` would push keys out of a window
        (a ring capped by ``max_cache_len`` below its heads' windows)."""
        if self.max_cache_len is None or end <= self.max_cache_len:
            return
        for g in self.groups:
            if g.capacity < max(g.query_windows):
                raise ValueError(
                    f"this window cache holds at most max_cache_len={self.max_cache_len} positions, and "
                    f"{end} would push keys out of windows of up to {max(g.query_windows)}; "
                    "build it with a larger max_cache_len (aah.hf.new_cache)"
                )

    def _store(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Write positions ``start..`` into each row's sink slots and into the rings."""
        batch, _, new, dim = keys.shape
        sinks = self.sink_tokens
        self._check_room(start + new)
        fresh = None  # (B, S): the sink positions this write brings, when it brings any
        if sinks:
            sink_pos = self._sink_positions()
            fresh = (sink_pos >= start) & (sink_pos < start + new)
            fresh = fresh if bool(fresh.any()) else None
        self._grow(start + new)
        for g in self.groups:
            k, v = (keys, values) if len(self.groups) == 1 else (keys[:, g.kv_heads], values[:, g.kv_heads])
            if fresh is not None:
                index = (sink_pos - start).clamp(0, new - 1)[:, None, :, None].expand(-1, k.shape[1], -1, dim)
                take = fresh[:, None, :, None]
                g.keys[:, :, :sinks] = torch.where(take, k.gather(2, index), g.keys[:, :, :sinks])
                g.values[:, :, :sinks] = torch.where(take, v.gather(2, index), g.values[:, :, :sinks])
            recording = self.crop_limit or self.record_past
            if new == 1 and not recording:  # a decode step: one slot, no index tensors
                slot = start % g.capacity
                g.keys[:, :, sinks + slot] = k[:, :, 0]
                g.values[:, :, sinks + slot] = v[:, :, 0]
                g.ring_positions[slot] = start
                continue
            first = max(start, start + new - g.capacity)  # older ones would be overwritten at once
            pos = torch.arange(first, start + new, device=g.ring_positions.device)
            slots = pos % g.capacity
            if recording:
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


def cache_route(cache) -> str:
    """How the last call through ``cache`` ran (:attr:`WindowCacheLayer.route` of its layers,
    joined with ``+`` where they differ), or ``transformers`` for another cache."""
    routes = sorted({layer.route or "unused" for layer in cache.layers if isinstance(layer, WindowCacheLayer)})
    return "+".join(routes) if routes else "transformers"
