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

The slots are an :class:`aah.decode.rings.RingStore`, the storage of the GPT's decode cache
too: all KV heads of a layer in one pair of flat buffers (B, slots, D), the layout the compiled
decode steps of :mod:`aah.decode.ring_decode` read. A ring grows with the tokens seen, by at
least an eighth of its size at a time, up to ``C`` (a window at or above the context costs what
a dynamic cache costs), never beyond.

The routes of a call (:attr:`WindowCacheLayer.route`):

* ``compiled block``: a one-token step of a Llama, Mistral or Qwen2 layer without padding on
  CPU runs the whole decoder layer in one compiled call (:mod:`aah.hf.bridge.block_step`), any
  kept keys (:mod:`aah.hf.bridge.kept_keys`) read beside each KV head's ring in the same softmax;
* ``compiled attention``: any other one-token step without padding on CPU runs the layer's
  modules, and its attention reads each head's window, the sinks before it and any kept keys
  in one call (:func:`aah.decode.ring_decode.ring_decode`);
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

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ...decode.rings import KeptSlots, RingGroup, RingStore, joined_route, pack_kept
from ...decode.route import PREFILL, Route, choose_route
from ...windows import visible as window_rule
from .._transformers import require
from .attention import attend_without_cache, by_rows
from .kept_keys import (
    KeptKeys,
    KeptStore,
    choose_kept,
    compiled_rolling_prefill,
    rolling_kept_attention,
    rolling_prefill,
    tail_attention,
)
from .masks import padded_spans, visible_keys
from .spec import SPEC_ATTR, LayerWindows, kv_heads, layer_specs
from .windowed_kv import Pending, WindowedKV

__all__ = ["WindowCacheLayer", "cache_memory_bytes", "cache_route", "new_cache"]
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
        kept_keys: KeptKeys | None = None,
    ):
        super().__init__()
        heads = len(windows)
        if num_kv_heads < 1 or heads % num_kv_heads:
            raise ValueError(f"{heads} query heads cannot share {num_kv_heads} KV heads")
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len must be >= 1, got {max_cache_len}")
        if crop_limit < 0:
            raise ValueError(f"crop_limit must be >= 0, got {crop_limit}")
        self.windows = tuple(windows)
        self.sink_tokens = sink_tokens
        self.num_kv_heads = num_kv_heads
        self.max_cache_len = max_cache_len
        self.crop_limit = crop_limit
        self.kept_keys = kept_keys
        self.kept: KeptStore | None = None  # what the prefill kept (aah.hf.bridge.kept_keys)
        self._kept_slots: KeptSlots | None = None  # self.kept packed for the compiled steps
        self.store = RingStore(self.windows, num_kv_heads, sinks=sink_tokens, max_len=max_cache_len)
        self.undo: list[list[_Undo]] = [[] for _ in self.store.groups]  # per ring group, oldest first
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
        self.store.allocate(batch, dim, value_states.shape[-1], self.dtype, self.device)
        self.undo = [[] for _ in self.store.groups]
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
        self._check_room(self.cumulative_length + key_states.shape[-2])  # before anything is counted
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
        self.store = RingStore(self.windows, self.num_kv_heads, sinks=self.sink_tokens, max_len=self.max_cache_len)
        self.undo = [[] for _ in self.store.groups]
        self.kept = None
        self._kept_slots = None
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
        self.store.select_rows(select)
        for records in self.undo:
            for record in records:
                for name in ("old_keys", "old_values", "skipped_keys", "skipped_values"):
                    if getattr(record, name) is not None:
                        setattr(record, name, select(getattr(record, name)))
        self.sink_start = select(self.sink_start)
        if self.kept is not None:
            self.kept.select_rows(select)
            self._kept_slots = None

    @property
    def route(self) -> str | None:
        """How the last call attended: ``prefill`` (no cache yet), ``masked`` (a chunk, padding, or
        no compiled step), ``compiled attention`` (one token, the attention compiled) or ``compiled
        block`` (one token, the whole decoder layer compiled, :mod:`aah.hf.bridge.block_step`)."""
        return self.store.route

    @property
    def route_reason(self) -> str | None:
        """Why the last call did not take a faster compiled route (``None`` where it took the fastest)."""
        return self.store.route_reason

    @property
    def is_croppable(self) -> bool:  # noqa: D102 - transformers' flag
        return self.crop_limit > 0 or self.record_past

    def activate_past_recording(self) -> None:
        """Record every write from now on, so that ``crop`` can take back a whole write (transformers
        calls this before assisted decoding and prompt lookup).

        With kept keys, before the first call: ``ValueError``. Kept keys are chosen by the prompt's
        last rows, and assisted decoding and prompt lookup put draft tokens into that first call,
        so drafts (rejected ones too) would choose them."""
        if self.kept_keys is not None and not self.is_initialized:
            raise ValueError(
                "assisted decoding and prompt lookup are refused with kept keys (aah.hf.KeptKeys): their first "
                "call holds draft tokens, which would choose the kept keys; use a cache without kept keys "
                "(aah.hf.new_cache(model)), or greedy or sampled decoding"
            )
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
        if self.record_past and self.undo[0]:
            reach = min(reach, self.undo[0][-1].start)
        if target < max(reach, self._crop_floor):
            raise ValueError(
                f"this window cache can take back its positions only down to {max(reach, self._crop_floor)} "
                f"(the last write while transformers records the past, the last {self.crop_limit} positions "
                f"by crop_limit of aah.hf.new_cache, and never into a write an earlier crop cut); "
                f"cropping {self.cumulative_length} tokens to {target} needs more"
            )
        for g, records in zip(self.store.groups, self.undo):
            self._undo_to(g, records, target)
        if self.kept is not None:
            # A crop back into the prefill brings later windows back over positions kept from it.
            self.kept.forget_reached(target)
            self._kept_slots = None
        self.cumulative_length = target

    def _undo_to(self, g: RingGroup, records: list[_Undo], target: int) -> None:
        """Put the ring back as it was after position ``target - 1`` was written."""
        sinks = self.sink_tokens
        while records and records[-1].end > target:
            r = records.pop()
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
        records = [
            t for group in self.undo for r in group
            for t in (r.old_keys, r.old_values, r.skipped_keys, r.skipped_values) if t is not None
        ]
        kept = 0 if self.kept is None else self.kept.memory_bytes()
        return self.store.memory_bytes() + kept + sum(t.numel() * t.element_size() for t in records)

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
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling

        def prefill() -> torch.Tensor:
            kept_keys = self.kept_keys
            rolling = (kept_keys is not None and kept_keys.prefill_keys > 0 and spec.layer_window is None
                       and query.shape[2] == pending.keys.shape[2])
            out = self._rolling_prefill(query, pending, attention_mask, scaling, scale, spec) if rolling else None
            if out is None:
                out = attend_without_cache(query, pending.keys, pending.values, attention_mask, scaling, spec)
                if rolling:
                    out = rolling_kept_attention(query, pending.keys, pending.values, out, spec.windows,
                                                 spec.sink_tokens, self._real_keys(attention_mask, query),
                                                 kept_keys, scale)
            if kept_keys is not None:
                out = self._read_tail_and_keep(query, pending.keys, pending.values, attention_mask, scale, spec, out)
            return out

        return self.store.attend_and_store(
            query, pending.keys, pending.values, pending.start,
            prefill=prefill, scale=scale, first_real=self.sink_start, key_mask=attention_mask,
            record=self._record if self.crop_limit or self.record_past else None,
            kept=None if self.kept is None else self.kept.readable(), kept_slots=self.kept_slots(),
        )

    def _rolling_prefill(self, query, pending: Pending, attention_mask, scaling, scale: float,
                         spec: LayerWindows) -> torch.Tensor | None:
        """A prompt read with rolling kept keys, each window read once: on CPU (and without
        gradients) in one compiled pass (:func:`compiled_rolling_prefill`), a plainly padded
        batch one row at a time over its tokens; elsewhere, an unpadded prompt through
        :func:`rolling_prefill`. ``None`` for other masks (the caller's masked route)."""
        kept_keys, keys, values = self.kept_keys, pending.keys, pending.values
        compiled = query.device.type == "cpu" and not torch.is_grad_enabled()
        if attention_mask is None:
            spans = [(0, query.shape[2])] * query.shape[0]
        elif compiled:
            spans = padded_spans(visible_keys(query.shape[2], keys.shape[2], attention_mask, query.device))
            if spans is None:
                return None
        else:
            return None
        if not compiled:
            return rolling_prefill(
                query, keys, values, spec.windows, spec.sink_tokens, kept_keys, scale,
                lambda q, k, v, windows: attend_without_cache(q, k, v, None, scaling,
                                                              replace(spec, requested=windows, windows=windows)),
            )
        return by_rows(spans, query, lambda rows, span: compiled_rolling_prefill(
            query[rows, :, span], keys[rows, :, span], values[rows, :, span], spec.windows, spec.sink_tokens,
            kept_keys, scale))

    def kept_slots(self) -> KeptSlots | None:
        """The kept keys as the compiled steps read them: the store's own buffers, or (keys in
        another dtype than the rings') packed by :func:`aah.decode.rings.pack_kept` once after each
        change of :attr:`kept` (``None`` without kept keys)."""
        if self.kept is None:
            return None
        if self._kept_slots is None:
            self._kept_slots = (self.kept.slots() if self.kept.keys.dtype == self.store.dtype
                                else pack_kept(self.kept.readable(), self.store.groups, self.store.dtype))
        return self._kept_slots

    def _read_tail_and_keep(self, query, keys, values, attention_mask, scale, spec: LayerWindows, out):
        """The prefill's last rows read every key; each KV head keeps the far keys they read most
        (:mod:`aah.hf.bridge.kept_keys`). Returns ``out`` with those rows replaced."""
        length = keys.shape[2]
        tail = min(self.kept_keys.tail_tokens, query.shape[2])
        rows = None if attention_mask is None else attention_mask[:, :, -tail:]
        visible = visible_keys(tail, length, rows, query.device)  # (B or 1, 1, tail, T): the tail rows only
        if spec.layer_window is not None:
            qpos = torch.arange(length - tail, length, device=query.device)[:, None]
            visible = visible & window_rule(qpos, torch.arange(length, device=query.device)[None, :], spec.layer_window)
        tail_out, probs = tail_attention(query[:, :, -tail:], keys, values, visible, scale)
        out = out.clone()
        out[:, :, -tail:] = tail_out
        if spec.layer_window is not None:
            return out  # a layer with its own sliding window must not read far keys later: it keeps none
        # Eligible: real keys, not sinks, that no window will read again (the ring holds the last
        # C positions; a later query's window of at most C reaches back to length - C + 1).
        pos = torch.arange(length, device=query.device)
        capacity = torch.tensor(self.store.capacities, device=query.device)
        real = visible[:, 0, -1].expand(keys.shape[0], -1)  # (B, T)
        first = self.sink_start[:, None]
        sink = window_rule(length, pos[None], 1, self.sink_tokens, first)  # what a query past every key reads as sinks
        eligible = (real & ~sink)[:, None, :] & (pos[None, None, :] <= length - capacity[None, :, None])
        # The sinks' large attention must not lend its score to their neighbours through the pooling.
        probs = probs.masked_fill(sink[:, None, None, :], 0.0)
        positions, valid = choose_kept(
            probs, self.num_kv_heads, eligible, self.kept_keys.keys_per_head, self.kept_keys.pool_width
        )
        self.kept = KeptStore.gather(keys, values, positions, valid, self.store.groups)
        self._kept_slots = None
        return out

    @staticmethod
    def _real_keys(attention_mask: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
        """(B, T): the prompt positions that hold tokens (what its last row may see)."""
        length = query.shape[2]
        if attention_mask is None:
            return torch.ones(query.shape[0], length, dtype=torch.bool, device=query.device)
        return visible_keys(1, length, attention_mask[:, :, -1:], query.device)[:, 0, 0].expand(query.shape[0], -1)

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

    def layer_route(
        self,
        hidden_states: torch.Tensor,
        attention: torch.nn.Module,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        layer: Callable[[], object],
    ) -> Route:
        """The route of a decoder layer's step through this cache (:func:`aah.decode.route.choose_route`):
        ``compiled block`` only where this cache can hand the whole layer over: it records no writes
        for ``crop``, holds the windows and the batch the layer runs, and the
        positions continue it. ``layer()`` maps the layer's weights (or says why it cannot)."""

        def whole_layer():
            spec = getattr(attention, SPEC_ATTR, None)
            if self.crop_limit or self.record_past:
                return "the cache records its writes for crop (assisted decoding, prompt lookup, crop_limit)"
            if spec is None or spec.windows != self.windows or spec.sink_tokens != self.sink_tokens:
                return "the layer runs other windows than this cache holds"
            if hidden_states.shape[0] != self.sink_start.shape[0]:
                return "the batch is not the cache's"
            if position_ids is not None and int(position_ids[0, -1]) != self.cumulative_length:
                return "the position ids do not continue the cache"
            return layer()

        if not self.is_initialized:
            return Route(PREFILL)
        return choose_route(
            self.store, hidden_states, start=self.cumulative_length, tokens=hidden_states.shape[1],
            first_real=self.sink_start, padded=attention_mask is not None, layer=whole_layer,
        )

    def decode_block(
        self,
        hidden_states: torch.Tensor,
        block,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention: torch.nn.Module,
    ) -> torch.Tensor:
        """One decode step of a whole decoder layer whose attention reads this cache, in one call
        of :func:`aah.decode.ring_decode.decode_block`, where :meth:`layer_route` chose it.
        ``hidden_states`` (B, 1, d_model)."""
        position, batch = self.cumulative_length, hidden_states.shape[0]
        self._check_room(position + 1)
        cos, sin = position_embeddings
        out = self.store.decode_block(hidden_states.reshape(batch, -1), block, cos[0], sin[0], position, attention.scaling,
                                      kept=self.kept_slots())
        self.cumulative_length += 1
        return out.view(batch, 1, -1)

    def _check_room(self, end: int) -> None:
        """``ValueError`` when holding positions up to ``end - 1`` would push keys out of a window
        (a ring capped by ``max_cache_len`` below its heads' windows)."""
        if self.max_cache_len is None or end <= self.max_cache_len:
            return
        for g in self.store.groups:
            if g.capacity < max(g.query_windows):
                raise ValueError(
                    f"this window cache holds at most max_cache_len={self.max_cache_len} positions, and "
                    f"{end} would push keys out of windows of up to {max(g.query_windows)}; "
                    "build it with a larger max_cache_len (aah.hf.new_cache)"
                )

    def _record(self, g: RingGroup, start: int, end: int, first: int, slots, k, v) -> None:
        """Keep what the write of positions ``start..end-1`` overwrites, for its last
        ``crop_limit`` positions, and the positions it skips that a crop back into it needs."""
        limit, sinks = self.crop_limit, self.sink_tokens
        records = self.undo[self.store.groups.index(g)]
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
        while records and records[0].end <= end - limit:
            records.pop(0)
        records.append(record)


def new_cache(
    model: torch.nn.Module, *, max_cache_len: int | None = None, crop_limit: int = 0, kept_keys: KeptKeys | None = None
):
    """A ``transformers.Cache`` of :class:`WindowCacheLayer`, one per layer of a patched model.

    Each ring grows with the tokens seen up to its largest window (or ``max_cache_len``, when
    given: a cache that would then lose keys inside a window raises ``ValueError`` instead), so
    windows at or above the context cost what a dynamic cache costs. ``crop_limit`` is how many
    of the last positions ``crop`` can always take back exactly. With ``kept_keys`` the prompt's
    last tokens read every key and each KV head keeps the far keys they read most
    (:mod:`aah.hf.bridge.kept_keys`); later one-token steps read them beside the rings, in the
    compiled routes as in the masked one.
    """
    specs = layer_specs(model)
    num_kv = kv_heads(model)
    layers = [
        WindowCacheLayer(spec.windows, spec.sink_tokens, num_kv, max_cache_len=max_cache_len, crop_limit=crop_limit,
                         kept_keys=kept_keys)
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
    layers = [layer for layer in cache.layers if isinstance(layer, WindowCacheLayer)]
    return joined_route(layer.route for layer in layers) if layers else "transformers"
