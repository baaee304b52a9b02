"""One layer's KV storage for windowed decoding: sink slots and a ring per KV head (paper section 5.8).

The ring-and-visibility core of both decode caches, the GPT's (:mod:`aah.decode.cache`) and
the Hugging Face bridge's (:mod:`aah.hf.bridge.cache`). A head with window ``W`` never reads further
back than ``W - 1`` positions, so a KV head keeps ``S + C`` slots: ``S`` sink slots for the
first ``S`` real tokens of each row (0 for the GPT) and a ring of ``C`` slots, ``C`` the largest
window of the query heads that read it (capped by ``max_len``), position ``p`` in ring slot
``p mod C``. KV heads of equal capacity form a :class:`RingGroup`.

Every KV head of the layer lives in one pair of flat buffers (B, slots, D), groups in order of
capacity and KV heads in order within a group, each KV head's sink slots right before its
ring: the layout the compiled steps of :mod:`aah.decode.ring_decode` read
(:meth:`RingStore.ring_index`). A store may hold fewer ring slots than its capacity and grow as
positions arrive (:meth:`RingStore.grow`, by at least ``1 / GROWTH`` of a ring at a time);
positions below a ring's allocation sit in slot = position, so growth copies the prefix as it is.

Which keys a query reads is :func:`aah.windows.visible`; :meth:`RingStore.attend` builds its mask
from it (adding only which column, sink slot, ring slot or new token, each key is read from),
and the compiled kernels are tested against it.

Kept keys (far keys a prefill keeps per KV head, :mod:`aah.hf.bridge.kept_keys`) live beside the
store, per ring group; :meth:`RingStore.attend` reads them in that form, and the compiled steps
read them packed once into one pair of buffers (:func:`pack_kept`, :class:`KeptSlots`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..windows import check_sink_tokens, kv_group_reach, visible, window_tuple
from . import ring_decode
from .route import ATTENTION, BLOCK, PREFILL, choose_route

__all__ = ["GROWTH", "KeptSlots", "RingGroup", "RingStore", "joined_route", "kv_capacities", "pack_kept"]

KeptSlots = ring_decode.KeptSlots

#: Kept keys per ring group, in the order of :attr:`RingStore.groups`: keys, values (B, n, K, D) of
#: the group's ``n`` KV heads and a (B, n, K) bool flag of which entries hold a key
#: (:meth:`aah.hf.bridge.kept_keys.KeptStore.readable`).
KeptGroups = Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

#: A ring that must grow grows by at least ``1 / GROWTH`` of its size (up to its capacity), so
#: that decoding while long rings fill copies the buffers rarely.
GROWTH = 8


def kv_capacities(windows: Sequence[int], num_kv_heads: int, max_len: int | None = None) -> tuple[int, ...]:
    """Ring length of every KV head: the largest window of its query heads, at most ``max_len``.

    Query head ``h`` reads KV head ``h // (H // H_kv)`` (the grouping of :func:`aah.attend`).
    """
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    caps = kv_group_reach(window_tuple(windows), num_kv_heads)
    return caps if max_len is None else tuple(min(c, max_len) for c in caps)


def pack_kept(kept: KeptGroups, groups: Sequence[RingGroup], dtype: torch.dtype | None = None) -> KeptSlots:
    """The kept keys of every ring group (``kept``, as :meth:`RingStore.attend` reads them) packed
    for the compiled steps: KV head after KV head, in the order of ``groups``, one run of slots each.

    A KV head's run ends after the last entry valid in any row (a head with none has an empty
    run), so the steps visit no slot that no row holds. Keys and values are cast to ``dtype``
    (the rings' dtype, which the compiled steps require; ``None``: their own). Build it once per
    change of the kept keys (a prefill, a row selection, a crop that forgets some) and hand it to
    every :meth:`RingStore.decode` and :meth:`RingStore.decode_block` until then.
    """
    if not groups or len(kept) != len(groups):
        raise ValueError(f"kept keys must come per ring group: {len(groups)} groups, {len(kept)} given")
    num_kv_heads = sum(len(g.kv_heads) for g in groups)
    start, count = [0] * num_kv_heads, [0] * num_kv_heads
    keys, values, valid, offset = [], [], [], 0
    for g, (k, v, ok) in zip(groups, kept):
        if k.shape[:3] != ok.shape or v.shape[:3] != ok.shape or ok.shape[1] != len(g.kv_heads):
            raise ValueError(
                f"a ring group's kept keys must be (B, {len(g.kv_heads)}, K, D) with a (B, {len(g.kv_heads)}, K) "
                f"valid flag; got keys {tuple(k.shape)}, values {tuple(v.shape)}, valid {tuple(ok.shape)}"
            )
        if ok.shape[-1] == 0:
            continue
        held = ok.any(0)  # (n, K): entries some row holds
        ends = torch.where(held, torch.arange(1, held.shape[-1] + 1, device=held.device), 0).amax(-1).tolist()
        for i, kv in enumerate(g.kv_heads):
            if ends[i]:
                start[kv], count[kv] = offset, ends[i]
                keys.append(k[:, i, :ends[i]])
                values.append(v[:, i, :ends[i]])
                valid.append(ok[:, i, :ends[i]])
                offset += ends[i]
    if not keys:  # nothing held: empty buffers, which the steps read as no kept keys
        k, v, ok = kept[0]
        keys, values, valid = [k.flatten(1, 2)[:, :0]], [v.flatten(1, 2)[:, :0]], [ok.flatten(1, 2)[:, :0]]
    dtype = keys[0].dtype if dtype is None else dtype
    return KeptSlots(
        torch.cat([t.to(dtype) for t in keys], dim=1).contiguous(),
        torch.cat([t.to(dtype) for t in values], dim=1).contiguous(),
        torch.cat(valid, dim=1).to(torch.bool).contiguous(),
        torch.tensor(start, dtype=torch.long),
        torch.tensor(count, dtype=torch.long),
    )


def joined_route(routes: Iterable[str | None]) -> str:
    """The routes of a model's layers in one string: each route once, joined with ``+``
    (``unused``: a layer no call has reached)."""
    return "+".join(sorted({route or "unused" for route in routes}))


@dataclass(eq=False)
class RingGroup:
    """KV heads that share one ring capacity, and the query heads that read them."""

    capacity: int
    kv_heads: list[int]
    query_heads: list[int]
    query_windows: tuple[int, ...]
    keys: torch.Tensor | None = None  # (B, n, S + allocated, D), a view of the store's flat buffer
    values: torch.Tensor | None = None
    ring_positions: torch.Tensor | None = None  # (allocated,) position in each ring slot, -1: empty
    windows: torch.Tensor | None = None  # (len(query_heads),) query_windows on the store's device

    @property
    def allocated(self) -> int:
        return 0 if self.ring_positions is None else int(self.ring_positions.numel())


#: ``record(group, start, end, first, slots, keys, values)``: called by :meth:`RingStore.write`
#: before positions ``first..end-1`` of a write of ``start..end-1`` overwrite ring ``slots``;
#: ``keys``/``values`` (B, n, end - start, D) are the group's KV heads of the whole write, in the
#: store's dtype.
WriteRecorder = Callable[..., None]


class RingStore:
    """The sink slots and rings of one layer's KV heads; see the module docstring."""

    def __init__(self, windows: Sequence[int], num_kv_heads: int, *, sinks: int = 0, max_len: int | None = None):
        self.windows = window_tuple(windows)
        self.capacities = kv_capacities(self.windows, num_kv_heads, max_len)
        self.sinks = check_sink_tokens(sinks)
        self.num_kv_heads = num_kv_heads
        self.windows_tensor = torch.tensor(self.windows, dtype=torch.long)  # as the compiled steps read them
        rep = len(self.windows) // num_kv_heads
        self.groups: list[RingGroup] = []
        for capacity in sorted(set(self.capacities)):
            kv_heads = [kv for kv, c in enumerate(self.capacities) if c == capacity]
            query_heads = [kv * rep + r for kv in kv_heads for r in range(rep)]
            self.groups.append(RingGroup(capacity, kv_heads, query_heads, tuple(self.windows[h] for h in query_heads)))
        self.flat_keys: torch.Tensor | None = None  # (B, slots, D)
        self.flat_values: torch.Tensor | None = None
        #: How the last call ran: ``prefill``, ``compiled block``, ``compiled attention`` or ``masked``.
        self.route: str | None = None
        #: Why the last call took no faster compiled route (``None`` where it took the fastest).
        self.route_reason: str | None = None
        self._layer_reason: str | None = None
        self._ring_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # -- storage --------------------------------------------------------------------------

    def allocate(
        self, batch: int, key_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device, ring_slots: int = 0
    ) -> None:
        """Empty buffers for ``batch`` rows with ``min(capacity, ring_slots)`` ring slots per KV head."""
        self.dtype, self.device = dtype, torch.device(device)
        for g in self.groups:
            g.keys = g.values = None
            g.ring_positions = torch.full((0,), -1, dtype=torch.long, device=self.device)
            g.windows = torch.tensor(g.query_windows, device=self.device)
        self._lay_out(batch, key_dim, value_dim, [min(g.capacity, ring_slots) for g in self.groups])

    def clear(self) -> None:
        """Mark every ring slot empty (the buffers stay and are overwritten later); forget the route."""
        self.route = self.route_reason = self._layer_reason = None
        for g in self.groups:
            g.ring_positions.fill_(-1)

    def grow(self, needed: int) -> None:
        """Make room for ``needed`` ring slots in every group (at most its capacity)."""
        sizes = [g.allocated for g in self.groups]
        wanted = [
            size if size >= min(g.capacity, needed) else min(g.capacity, max(needed, size + size // GROWTH))
            for g, size in zip(self.groups, sizes)
        ]
        if wanted != sizes:
            self._lay_out(self.flat_keys.shape[0], self.flat_keys.shape[-1], self.flat_values.shape[-1], wanted)

    def _lay_out(self, batch: int, key_dim: int, value_dim: int, sizes: list[int]) -> None:
        """New flat buffers with ``sizes[i]`` ring slots for group ``i``, holding what the old ones held."""
        old = [(g.keys, g.values) for g in self.groups]
        total = sum(len(g.kv_heads) * (self.sinks + size) for g, size in zip(self.groups, sizes))
        like = dict(dtype=self.dtype, device=self.device)
        self.flat_keys = torch.zeros(batch, total, key_dim, **like)
        self.flat_values = torch.zeros(batch, total, value_dim, **like)
        for g, size in zip(self.groups, sizes):
            g.ring_positions = torch.cat([g.ring_positions, g.ring_positions.new_full((size - g.allocated,), -1)])
        self._views()
        for g, (keys, values) in zip(self.groups, old):
            if keys is not None:
                g.keys[:, :, :keys.shape[2]] = keys
                g.values[:, :, :values.shape[2]] = values

    def _views(self) -> None:
        """Point every group's keys/values at its part of the flat buffers."""
        batch, offset = self.flat_keys.shape[0], 0
        for g in self.groups:
            shape = (batch, len(g.kv_heads), self.sinks + g.allocated)
            size = shape[1] * shape[2]
            g.keys = self.flat_keys[:, offset:offset + size].view(*shape, self.flat_keys.shape[-1])
            g.values = self.flat_values[:, offset:offset + size].view(*shape, self.flat_values.shape[-1])
            offset += size
        self._ring_index = None

    def select_rows(self, select: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace the buffers by ``select`` of them along the batch (beam search, batch splits)."""
        self.flat_keys, self.flat_values = select(self.flat_keys), select(self.flat_values)
        self._views()

    def memory_bytes(self) -> int:
        """Bytes of the key and value buffers."""
        return sum(t.numel() * t.element_size() for t in (self.flat_keys, self.flat_values) if t is not None)

    def ring_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ring_start, allocated, scratch) as the compiled steps read the flat buffers: per KV head
        the slot of its first ring entry (its sinks in the slots before) and its allocated ring slots;
        a float32 (1, slots) tensor the compiled block step marks (the groups keep their own record)."""
        if self._ring_index is None:
            start, allocated, offset = [0] * self.num_kv_heads, [0] * self.num_kv_heads, 0
            for g in self.groups:
                for kv in g.kv_heads:
                    start[kv], allocated[kv] = offset + self.sinks, g.allocated
                    offset += self.sinks + g.allocated
            self._ring_index = (
                torch.tensor(start, dtype=torch.long), torch.tensor(allocated, dtype=torch.long),
                torch.zeros(1, offset, dtype=torch.float32),
            )
        return self._ring_index

    def rings(self) -> ring_decode.Rings:
        """The buffers as :func:`aah.decode.ring_decode.decode_block` reads them."""
        ring_start, allocated, scratch = self.ring_index()
        return ring_decode.Rings(self.flat_keys, self.flat_values, scratch, ring_start, allocated, self.windows_tensor)

    def held(self, kv_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ring keys (B, n, D), values (B, n, D) and positions (n,) of one KV head, oldest first."""
        for g in self.groups:
            if kv_head in g.kv_heads:
                i = g.kv_heads.index(kv_head)
                order = torch.argsort(g.ring_positions)
                order = order[g.ring_positions[order] >= 0]
                ring = self.sinks + order
                return g.keys[:, i, ring], g.values[:, i, ring], g.ring_positions[order]
        raise ValueError(f"kv_head must be in [0, {self.num_kv_heads}), got {kv_head}")

    # -- writes ---------------------------------------------------------------------------

    def sink_positions(self, first_real: torch.Tensor) -> torch.Tensor:
        """(B, S) position held by each sink slot of each row whose real tokens start at ``first_real`` (B,)."""
        return first_real[:, None] + torch.arange(self.sinks, device=first_real.device)

    def write(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        first_real: torch.Tensor | None = None,
        record: WriteRecorder | None = None,
    ) -> None:
        """Store positions ``start..`` (``keys``, ``values`` (B, H_kv, T, D)) in the sink slots and rings.

        ``first_real`` (B,): where each row's real tokens start (``None``: at 0); its sink slots
        take the positions ``first_real .. first_real + S - 1`` this write brings. ``record`` is
        told what each ring write overwrites (:data:`WriteRecorder`).
        """
        batch, _, new, _ = keys.shape
        keys, values = keys.detach().to(self.dtype), values.detach().to(self.dtype)
        self.grow(start + new)
        fresh = None  # (B, S): the sink positions this write brings, when it brings any
        if self.sinks:
            first = torch.zeros(batch, dtype=torch.long, device=keys.device) if first_real is None else first_real
            sink_pos = self.sink_positions(first)
            fresh = (sink_pos >= start) & (sink_pos < start + new)
            fresh = fresh if bool(fresh.any()) else None
        sinks = self.sinks
        for g in self.groups:
            first_kept = max(start, start + new - g.capacity)  # older ones would be overwritten at once
            # Taken from the group's KV heads: the positions it keeps (all of them for sinks or a record).
            lo = 0 if fresh is not None or record is not None else first_kept - start
            k, v = self._group_heads(g, keys, lo), self._group_heads(g, values, lo)
            if fresh is not None:
                index = (sink_pos - start).clamp(0, new - 1)[:, None, :, None]
                take = fresh[:, None, :, None]
                for buffer, entries in ((g.keys, k), (g.values, v)):
                    picked = entries.gather(2, index.expand(-1, entries.shape[1], -1, entries.shape[-1]))
                    buffer[:, :, :sinks] = torch.where(take, picked, buffer[:, :, :sinks])
            if new == 1 and record is None:  # a decode step: one slot, no index tensors
                slot = start % g.capacity
                g.keys[:, :, sinks + slot] = k[:, :, 0]
                g.values[:, :, sinks + slot] = v[:, :, 0]
                g.ring_positions[slot] = start
                continue
            pos = torch.arange(first_kept, start + new, device=g.ring_positions.device)
            if record is not None:
                record(g, start, start + new, first_kept, pos % g.capacity, k, v)
            # The slots of consecutive positions are one run that wraps at most once: two slice copies.
            first_slot, kept = first_kept % g.capacity, start + new - first_kept
            run = min(kept, g.capacity - first_slot)
            for buffer, new_entries in ((g.keys, k), (g.values, v)):
                kept_entries = new_entries[:, :, first_kept - start - lo:]
                buffer[:, :, sinks + first_slot:sinks + first_slot + run] = kept_entries[:, :, :run]
                buffer[:, :, sinks:sinks + kept - run] = kept_entries[:, :, run:]
            g.ring_positions[first_slot:first_slot + run] = pos[:run]
            g.ring_positions[:kept - run] = pos[run:]

    def _group_heads(self, g: RingGroup, new: torch.Tensor, lo: int) -> torch.Tensor:
        """Positions ``lo..`` of the group's KV heads of ``new`` (B, H_kv, T, D)."""
        new = new[:, :, lo:]
        return new if len(self.groups) == 1 else new[:, g.kv_heads]

    # -- attention ------------------------------------------------------------------------

    def attend(
        self,
        query: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        start: int,
        *,
        first_real: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        scale: float | None = None,
        kept: KeptGroups | None = None,
    ) -> torch.Tensor:
        """Exact masked attention of ``query`` (B, H, T, D) at positions ``start..`` over the stored
        slots plus the new keys/values (B, H_kv, T, D) of those positions, which are not stored yet.

        A query reads key ``k`` where :func:`aah.windows.visible` allows it, each key from one
        column: a sink outside the window from its sink slot (once stored), every other key from
        the ring or the new tokens. ``first_real`` (B,) as in :meth:`write`; ``key_mask`` (B, 1,
        T, >= start + T), ``True`` (or 0.0) where a key position may be read (a padding mask).
        ``kept``: per ring group (in the order of :attr:`groups`), keys, values (B, n, K, D) of its
        ``n`` KV heads and a (B, n, K) flag of which hold a key, seen by every query of the heads
        reading each KV head (far keys outside every window, :mod:`aah.hf.bridge.kept_keys`). Computes
        in the query's dtype (the stored entries are cast to it); returns (B, H, T, D_v).
        """
        batch, _, new, _ = query.shape
        device, sinks = query.device, self.sinks
        first = torch.zeros(batch, dtype=torch.long, device=device) if first_real is None else first_real
        qpos = torch.arange(start, start + new, device=device)
        sink_pos = self.sink_positions(first)  # (B, S)
        unmasked = None
        if key_mask is not None:
            unmasked = key_mask if key_mask.dtype == torch.bool else key_mask == 0
        dtype = query.dtype
        out = query.new_empty(*query.shape[:-1], new_values.shape[-1])
        for i, g in enumerate(self.groups):
            keys = torch.cat([g.keys.to(dtype), new_keys[:, g.kv_heads].to(dtype)], dim=2)
            values = torch.cat([g.values.to(dtype), new_values[:, g.kv_heads].to(dtype)], dim=2)
            # Positions of every key column, per row: sink slots, ring slots, new tokens.
            kpos = torch.cat([sink_pos, g.ring_positions.expand(batch, -1), qpos.expand(batch, -1)], dim=1)
            dist = qpos[None, :, None] - kpos[:, None, :]  # (B, T_new, K)
            windows = g.windows[None, :, None, None]
            in_window = dist[:, None] < windows  # (B, heads, T_new, K)
            rule = visible(qpos[:, None], kpos[:, None, None, :], windows, sinks, first[:, None, None, None])
            stored_sink = (sink_pos < start)[:, None, None, :]
            written = (g.ring_positions >= 0)[None, None, None, :]
            reader = torch.cat([
                stored_sink & ~in_window[..., :sinks], written & in_window[..., sinks:sinks + g.allocated],
                torch.ones_like(in_window[..., sinks + g.allocated:]),
            ], dim=-1)
            allowed = rule & reader
            if unmasked is not None:
                columns = kpos.clamp(0, unmasked.shape[-1] - 1)[:, None, None, :].expand(-1, 1, new, -1)
                allowed = allowed & unmasked.gather(-1, columns)
            # A row with nothing to read (all padding) reads its own token: finite, and never used.
            allowed = allowed | (~allowed.any(-1, keepdim=True) & (dist == 0)[:, None])
            if kept is not None:
                kept_keys, kept_values, kept_valid = kept[i]
                keys = torch.cat([kept_keys.to(dtype), keys], dim=2)
                values = torch.cat([kept_values.to(dtype), values], dim=2)
                readers = kept_valid.repeat_interleave(len(g.query_heads) // len(g.kv_heads), dim=1)
                allowed = torch.cat([readers[:, :, None, :].expand(-1, -1, new, -1), allowed], dim=-1)
            q = query[:, g.query_heads]
            out[:, g.query_heads] = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
            )
        return out

    def attend_and_store(
        self,
        query: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        start: int,
        *,
        prefill: Callable[[], torch.Tensor],
        scale: float,
        first_real: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        compute: torch.dtype | None = None,
        record: WriteRecorder | None = None,
        kept: KeptGroups | None = None,
        kept_slots: KeptSlots | None = None,
    ) -> torch.Tensor:
        """Attend ``query`` (B, H, T, D) at positions ``start..`` over the stored slots plus the new
        keys/values, then store those: the route of every call that is not a whole compiled block.

        ``prefill`` (the first call, ``start == 0``) runs the model's own attention; one token
        that the route decision (:func:`aah.decode.route.choose_route`) sends to the compiled
        attention is written, then read by one :meth:`decode` call; anything else is :meth:`attend`
        (with the query in ``compute``, when given). :attr:`route` names the route taken and
        :attr:`route_reason` why no faster one. ``kept_slots``: ``kept`` packed by :func:`pack_kept`,
        which :meth:`decode` reads (without it, the kept keys are packed for this call). Other
        arguments as :meth:`attend` and :meth:`write`.
        """
        route = choose_route(self, query, start=start, tokens=query.shape[2], first_real=first_real,
                             padded=key_mask is not None)
        self.route, layer_reason, self._layer_reason = route.name, self._layer_reason, None
        self.route_reason = route.reason or layer_reason  # a layer's reason not to run whole, where it had one
        if route.name == PREFILL:
            out = prefill()
        elif route.name == ATTENTION:
            self.write(new_keys, new_values, start, first_real, record)
            return self.decode(query[:, :, 0], start + 1, scale, kept if kept_slots is None else kept_slots)[:, :, None]
        else:
            compute = query.dtype if compute is None else compute
            out = self.attend(
                query.to(compute), new_keys, new_values, start, first_real=first_real, key_mask=key_mask, scale=scale,
                kept=kept,
            ).to(query.dtype)
        self.write(new_keys, new_values, start, first_real, record)
        return out

    def note_layer_reason(self, reason: str | None) -> None:
        """Keep why a decoder layer did not run whole (:func:`aah.decode.route.choose_route`), so that
        the attention call that follows reports it as :attr:`route_reason`."""
        self._layer_reason = reason

    def decode(
        self, query: torch.Tensor, length: int, scale: float, kept: KeptSlots | KeptGroups | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` (B, H, D) at position ``length - 1`` (stored) over each head's
        window and the sinks before it, in one call of :func:`aah.decode.ring_decode.ring_decode`;
        ``kept`` keys join the same softmax in that call: packed by :func:`pack_kept` (built once
        per change of the kept keys), or per ring group as :meth:`attend` takes them (packed here,
        for this call)."""
        ring_start, allocated, _ = self.ring_index()
        if kept is not None and not isinstance(kept, KeptSlots):
            kept = pack_kept(kept, self.groups, self.dtype)
        return ring_decode.ring_decode(
            query.contiguous(), self.flat_keys, self.flat_values, ring_start, allocated, self.windows_tensor,
            length, scale, sinks=self.sinks, kept=kept,
        )

    def decode_block(
        self, x: torch.Tensor, block: ring_decode.Block, cos: torch.Tensor | None, sin: torch.Tensor | None,
        position: int, scale: float, kept: KeptSlots | None = None,
    ) -> torch.Tensor:
        """One decode step of a whole pre-norm block at ``position`` (``x`` (B, d_model)) in one call
        of :func:`aah.decode.ring_decode.decode_block`, which writes the new key and value (to the
        ring only: the sink slots must hold positions 0..S-1 already); ``kept`` keys
        (:func:`pack_kept`) join its attention's softmax."""
        if position < self.sinks:
            raise ValueError(f"a compiled step at position {position} would leave sink slots unwritten ({self.sinks} sinks)")
        self.grow(position + 1)
        out = ring_decode.decode_block(
            x.contiguous(), block, cos, sin, self.rings(), position + 1, scale, sinks=self.sinks, kept=kept
        )
        for g in self.groups:
            g.ring_positions[position % g.capacity] = position
        self.route, self.route_reason = BLOCK, None
        return out

