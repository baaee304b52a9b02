"""A key/value cache for decoding whose memory and reads follow the per-head windows (paper section 5.8).

Windowed execution (section 5.8) means a head with window ``W`` never looks
further back than ``W - 1`` positions. During autoregressive decoding the cache
therefore only has to keep, per layer and per KV head, the last few keys and
values: a ring buffer in which absolute position ``p`` lives in slot
``p % C``.

Grouped-query attention: the query heads that share a KV head may have
different windows. The KV head's ring buffer keeps ``C = min(max W of its query
heads, max_len)`` entries, and every query head reads only its own window of
the buffer. (The controller option ``window_granularity="kv_group"`` gives the
query heads of a KV head one shared window, so that no entry is kept for a
subset of them.) Memory per layer is ``sum over KV heads of C * head_dim * 2
(K and V) * batch * bytes per element``; :meth:`WindowKVCache.full_memory_bytes`
is what an ordinary cache of ``max_len`` entries per KV head would take.

The windows are read from the model once, when the cache is created (at
length ``max_len``), and frozen: decoding runs in evaluation mode, where the
head controller never changes its windows. A forward that finds the model's
windows changed since then raises an error instead of decoding with stale
windows.

The paths through a layer:

* **Prefill** (the cache is empty): the normal execution path
  (:func:`aah.attend` with the model's backend), then the last ``C`` keys and
  values of each KV head are copied into its ring buffer.
* **One decode step** (one new token): its key and value go into slot
  ``p % C`` (that slot held position ``p - C``, which no window reaches any
  more), then attention over the rings. Every ring is stored as chunks of one
  common length ``c`` (the greatest common divisor of the capacities), all
  chunks of a layer in one tensor, so one fused attention call covers every
  KV head whatever its capacity, and its work splits evenly over CPU threads
  (a long ring is several chunks, not one long row). The call returns each
  chunk's output and log-sum-exp; a KV head with several chunks combines them
  exactly by their log-sum-exp weights (split-key attention). The query heads
  that share a KV head are the rows of its chunks, so every cached key is
  read once per step. Softmax does not care about the order of the keys, so
  once every ring is full and every query head reads its whole ring, the call
  needs no mask. Before that (rings still filling) and for a query head whose
  window is smaller than its KV head's ring (GQA with mixed windows), an
  additive mask is computed from the age of each slot.
* **The compiled decode step** (:mod:`aah.decode.ring_decode`, CPU): where it is
  built, one decode step is one call instead: after the write, every (batch
  row, query head) reads the last ``min(W, length, C)`` entries of its KV
  head's ring straight from the flat storage, in spans spread over the
  threads, joined exactly by their maxima and sums; no mask, no gather, no
  per-chunk join. It runs when the query has the cache's dtype and no
  gradient is asked for; the chunked plans above remain the path elsewhere
  (CUDA, ``AAH_RING_KERNEL=0``, no compiler) and are tested against it. A
  model's decode step goes further: :meth:`LayerKVCache.decode_packed` (an
  attention layer's rotary embedding, write and attention) and
  :meth:`LayerKVCache.decode_block` (a whole block) run on the rings in one
  call each.
* **A chunk of several tokens after a prefix**: masked attention over the ring
  plus the new keys, with a causal, per-head window mask built from the absolute
  position held in each slot; the new entries are written afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from . import ring_decode
from ..backends import attend
from ..windows import window_tuple

if TYPE_CHECKING:  # pragma: no cover
    from ..model import GPT

__all__ = ["LayerKVCache", "WindowKVCache", "chunk_attention", "chunk_attention_math", "kv_capacities", "slot_positions"]


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def kv_capacities(windows: Sequence[int], num_kv_heads: int, max_len: int) -> tuple[int, ...]:
    """Ring-buffer length of every KV head: ``min(max window of its query heads, max_len)``.

    ``windows`` holds one window per query head; query head ``h`` reads KV head
    ``h // (H // H_kv)`` (the grouping of :func:`aah.attend`).
    """
    wins = window_tuple(windows)
    _positive_int(num_kv_heads, "num_kv_heads")
    _positive_int(max_len, "max_len")
    if len(wins) % num_kv_heads:
        raise ValueError(f"{len(wins)} query heads cannot be split among {num_kv_heads} KV heads")
    group = len(wins) // num_kv_heads
    return tuple(min(max(wins[g * group : (g + 1) * group]), max_len) for g in range(num_kv_heads))


def slot_positions(length: int, capacity: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Absolute position held by each slot of a ring buffer after ``length`` writes.

    Slot ``s`` holds the latest position ``p < length`` with ``p % capacity == s``;
    slots never written get a negative value.
    """
    slots = torch.arange(capacity, device=device)
    last = length - 1
    return last - torch.remainder(last - slots, capacity)


@dataclass
class _Bucket:
    """KV heads of one layer that share a ring-buffer capacity: a view of the layer's chunk storage."""

    kv_heads: torch.Tensor  # (n,) long: which KV heads of the layer
    kv_range: tuple[int, int] | None  # (first, end) when the KV heads are consecutive
    capacity: int
    windows: torch.Tensor  # (n, group) long: windows of their query heads
    keys: torch.Tensor  # (B, n, capacity, D), a view of LayerKVCache's chunk storage
    values: torch.Tensor  # (B, n, capacity, D)
    unread: torch.Tensor  # (1, n, capacity) additive mask: 0 where written, else masked
    all_heads: bool  # the bucket is every KV head, in order (no gather needed)

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """The bucket's KV heads of ``x`` (B, H_kv, ...) along dim 1: a view when they are consecutive."""
        if self.all_heads:
            return x
        if self.kv_range is not None:
            return x[:, self.kv_range[0] : self.kv_range[1]]
        return x.index_select(1, self.kv_heads)


def _ring_write(ring: torch.Tensor, new: torch.Tensor, first_pos: int) -> None:
    """Copy ``new`` (B, n, t, D), positions ``first_pos ..``, into ``ring`` (B, n, C, D); t <= C.

    At most two slice copies: the run up to the end of the ring and the wrapped rest.
    """
    cap, t = ring.shape[2], new.shape[2]
    s0 = first_pos % cap
    run = min(t, cap - s0)
    ring[:, :, s0 : s0 + run].copy_(new[:, :, :run])
    if run < t:
        ring[:, :, : t - run].copy_(new[:, :, run:])


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and log-sum-exp of every chunk: ``q`` (B, N, G, D) over ``k``, ``v`` (B, N, c, D).

    ``mask`` is additive (broadcastable to (B, N, G, c), the dtype of ``q``) or
    ``None``. Returns the output (B, N, G, D) in ``q``'s dtype and the
    log-sum-exp of the scaled, masked scores (B, N, G) in float32. On CPU this is
    PyTorch's fused flash kernel; elsewhere :func:`chunk_attention_math`.
    """
    if q.device.type != "cpu":
        return chunk_attention_math(q, k, v, mask, scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)


def chunk_attention_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_attention` in plain float32 arithmetic (any device)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return out.to(q.dtype), lse


#: Additive mask value of a slot a query must not read: finite, so that a chunk with no
#: readable slot gives a finite output whose log-sum-exp weight is zero.
_MASKED = -1.0e30


class _DecodePlan:
    """One fused attention call of the decode step over chunked rings (see the module docstring).

    The plan covers ``buckets`` stored as consecutive chunks of length ``chunk``
    in ``keys`` / ``values`` (B, N, chunk, D). Its KV heads, in storage order,
    are ``kv_heads``; chunk ``n`` belongs to KV head ``chunk_kv[n]`` (an index
    of the layer's KV heads) and holds its ring slots ``slot[n]``.
    """

    def __init__(
        self,
        buckets: Sequence[_Bucket],
        chunk: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        unread: torch.Tensor,
        num_kv_heads: int,
    ):
        device = keys.device
        kv_heads, chunk_kv, slot, cap, wins = [], [], [], [], []
        for bucket in buckets:
            for i, g in enumerate(bucket.kv_heads.tolist()):
                kv_heads.append(g)
                for j in range(bucket.capacity // chunk):
                    chunk_kv.append(g)
                    slot.append(list(range(j * chunk, (j + 1) * chunk)))
                    cap.append(bucket.capacity)
                    wins.append(bucket.windows[i].tolist())
        self.keys, self.values = keys, values
        self.unread = unread[:, :, None, :]  # (1, N, 1, c): the slots not written yet
        self.kv_heads = kv_heads
        # The query rows of chunk n are those of its KV head: a gather unless chunk n is KV head n.
        self.identity = chunk_kv == list(range(num_kv_heads))
        self.chunk_kv = torch.tensor(chunk_kv, dtype=torch.long, device=device)
        self.slot = torch.tensor(slot, dtype=torch.long, device=device)  # (N, c)
        self.capacity = torch.tensor(cap, dtype=torch.long, device=device)[:, None]  # (N, 1)
        self.windows = torch.tensor(wins, dtype=torch.long, device=device)[:, :, None]  # (N, G, 1)
        # A mask is needed while a ring is filling, and always where a query head reads less than its ring.
        self.fill_until = max(cap)  # from this length on, every ring is full
        self.partial_rows = bool((self.windows < self.capacity[:, :, None]).any())
        # Entries of each KV head: its chunks, padded to the longest list with a zero-weight entry.
        per_head = [[n for n, g in enumerate(chunk_kv) if g == head] for head in kv_heads]
        self.width = max(len(e) for e in per_head)
        self.entries = torch.tensor([e + [e[0]] * (self.width - len(e)) for e in per_head], device=device).flatten()
        self.padding = torch.tensor(
            [[0.0] * len(e) + [float("-inf")] * (self.width - len(e)) for e in per_head], device=device
        )[None, :, :, None]  # (1, heads, width, 1), added to the log-sum-exps

    def mask(self, length: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive mask (1, N, G or 1, c) after ``length`` writes, or ``None`` where every slot is readable.

        Slot ``s`` of a ring of capacity ``C`` holds the entry of age ``(length - 1 - s) mod C``;
        a query row with window ``w`` reads it when that age is below ``w`` and the slot was written.
        Where every row reads its whole ring, that is the written slots alone: the mask kept
        up to date by the writes, until every ring is full.
        """
        if not self.partial_rows:
            return None if length >= self.fill_until else self.unread.to(dtype)
        age = torch.remainder(length - 1 - self.slot, self.capacity)  # (N, c)
        readable = (age[:, None, :] < self.windows) & (age < length)[:, None, :]
        return torch.where(readable, 0.0, _MASKED).to(dtype)[None]

    def attend(self, qg: torch.Tensor, length: int, scale: float) -> torch.Tensor:
        """Outputs (B, heads, G, D) of the plan's KV heads for queries ``qg`` (B, H_kv, G, D) of the layer.

        Chunks of one KV head are joined by the softmax of their log-sum-exps:
        the softmax over the union of their keys, exactly.
        """
        dtype = qg.dtype
        keys, values = self.keys, self.values
        if self.width == 1 and not self.partial_rows:
            # One chunk per KV head, all of one capacity: while filling, the written slots are a slice.
            keys, values = keys[:, :, :length], values[:, :, :length]
            mask = None
        else:
            mask = self.mask(length, dtype)
        keys, values = keys.to(dtype), values.to(dtype)
        if self.identity and mask is None:
            return F.scaled_dot_product_attention(qg, keys, values, scale=scale)
        qc = qg if self.identity else qg.index_select(1, self.chunk_kv)
        out, lse = chunk_attention(qc, keys, values, mask, scale)
        b, _, g, d = out.shape
        if self.width == 1:
            return out if self.identity else out.index_select(1, self.entries)
        lse = lse.index_select(1, self.entries).view(b, -1, self.width, g) + self.padding
        weights = torch.softmax(lse, dim=2).to(out.dtype)
        parts = out.index_select(1, self.entries).view(b, -1, self.width, g, d)
        return (weights[..., None] * parts).sum(dim=2)


#: Below this common chunk length the rings of a layer are not split into chunks: each
#: capacity gets its own call instead of many tiny chunks.
MIN_CHUNK = 16


class LayerKVCache:
    """Ring-buffer cache of one attention layer; see the module docstring.

    ``windows`` holds one window per query head (values above ``max_len`` are
    clamped to it). The rings of all KV heads live in one pair of chunk tensors
    (keys and values); KV heads with the same capacity are a bucket, a
    (B, n, C, D) view of consecutive chunks.
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
        self.capacities = kv_capacities(self.windows, num_kv_heads, self.max_len)
        self.num_heads = len(self.windows)
        self.num_kv_heads = num_kv_heads
        self.group = self.num_heads // num_kv_heads
        self.dtype = dtype
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.length = 0
        self.chunk = math.gcd(*self.capacities)
        num_chunks = sum(c // self.chunk for c in self.capacities)
        shape = (self.batch_size, num_chunks, self.chunk, self.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=dtype, device=self.device)
        self.unread = torch.full((1, num_chunks, self.chunk), _MASKED, device=self.device)
        self._buckets: list[_Bucket] = []
        first = 0
        ring_start = {}
        for cap in sorted(set(self.capacities)):
            heads = [g for g, c in enumerate(self.capacities) if c == cap]
            ring_start.update({g: first * self.chunk + i * cap for i, g in enumerate(heads)})
            wins = [self.windows[g * self.group : (g + 1) * self.group] for g in heads]
            consecutive = heads == list(range(heads[0], heads[0] + len(heads)))
            end = first + len(heads) * (cap // self.chunk)
            view = (self.batch_size, len(heads), cap, self.head_dim)
            self._buckets.append(
                _Bucket(
                    kv_heads=torch.tensor(heads, dtype=torch.long, device=self.device),
                    kv_range=(heads[0], heads[-1] + 1) if consecutive else None,
                    capacity=cap,
                    windows=torch.tensor(wins, dtype=torch.long, device=self.device),
                    keys=self.keys[:, first:end].view(view),
                    values=self.values[:, first:end].view(view),
                    unread=self.unread[:, first:end].view(1, len(heads), cap),
                    all_heads=len(heads) == num_kv_heads,
                )
            )
            first = end
        # The decode step writes every KV head's new entry with one index copy into the flat
        # storage: KV head g's ring starts at slot ``ring_start[g]`` and has ``capacities[g]`` slots.
        self._ring_start = [ring_start[g] for g in range(num_kv_heads)]
        self._flat_keys = self.keys.view(self.batch_size, -1, self.head_dim)
        self._flat_values = self.values.view(self.batch_size, -1, self.head_dim)
        self._flat_unread = self.unread.view(1, -1)
        if self.chunk >= MIN_CHUNK or len(self._buckets) == 1:
            self._plans = [_DecodePlan(self._buckets, self.chunk, self.keys, self.values, self.unread, num_kv_heads)]
        else:  # one call per capacity, each ring one chunk
            self._plans = [
                _DecodePlan([b], b.capacity, b.keys, b.values, b.unread, num_kv_heads) for b in self._buckets
            ]
        order = [g for plan in self._plans for g in plan.kv_heads]
        self._order = None if order == list(range(num_kv_heads)) else torch.tensor(
            [order.index(g) for g in range(num_kv_heads)], device=self.device
        )
        # What the compiled decode step (aah.decode.ring_decode) reads: each KV head's ring in the flat
        # storage, and each query head's window.
        self._rings = ring_decode.Rings(
            self._flat_keys, self._flat_values, self._flat_unread,
            torch.tensor(self._ring_start, dtype=torch.long),
            torch.tensor(self.capacities, dtype=torch.long),
            torch.tensor(self.windows, dtype=torch.long),
        )
        self._longest = max(self.capacities)

    # ------------------------------------------------------------------ memory
    def memory_bytes(self) -> int:
        """Bytes held by the ring buffers (keys and values)."""
        return self.keys.nbytes + self.values.nbytes

    def full_memory_bytes(self) -> int:
        """Bytes an ordinary cache of ``max_len`` entries per KV head would take."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * self.max_len * self.head_dim * 2 * self.batch_size * element

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept and overwritten later)."""
        self.length = 0
        self.unread.fill_(_MASKED)

    # ------------------------------------------------------------------ contents
    def cached(self, kv_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys (B, n, D), values (B, n, D) and absolute positions (n,) held for one KV head, oldest first."""
        if not 0 <= kv_head < self.num_kv_heads:
            raise ValueError(f"kv_head must be in [0, {self.num_kv_heads}), got {kv_head}")
        for bucket in self._buckets:
            hits = (bucket.kv_heads == kv_head).nonzero()
            if len(hits):
                i = int(hits[0, 0])
                pos = slot_positions(self.length, bucket.capacity, self.device)
                order = torch.argsort(pos)
                order = order[pos[order] >= 0]
                return bucket.keys[:, i, order], bucket.values[:, i, order], pos[order]
        raise AssertionError("unreachable: every KV head has a bucket")

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
        start = self.length
        if start == 0:
            # Prefill: the ordinary execution path, windows clamped to the chunk as the model does.
            y = attend(q, k, v, tuple(min(w, t) for w in self.windows), backend=backend, scale=scale)
            self._write(k, v, start)
        elif t == 1:
            # One decode step: the new key's slot held a position no window reaches any more.
            y = self._decode_step(q, k, v, start, scale)
        else:
            y = self._attend_ring(q, k, v, start, scale)
            self._write(k, v, start)
        self.length = start + t
        return y

    def _write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        t = k.shape[2]
        k, v = k.detach(), v.detach()
        for bucket in self._buckets:
            n = min(t, bucket.capacity)  # only the last ``capacity`` new entries survive
            kb, vb = bucket.select(k[:, :, t - n :]), bucket.select(v[:, :, t - n :])
            _ring_write(bucket.keys, kb, start + t - n)
            _ring_write(bucket.values, vb, start + t - n)
            if start < bucket.capacity:  # the ring is still filling
                _ring_write(bucket.unread[..., None], bucket.unread.new_zeros(1, 1, n, 1), start + t - n)

    def _decode_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float
    ) -> torch.Tensor:
        """Write the key and value of position ``pos``, then attend its query over the rings.

        ``q`` is (B, H, 1, D). One fused attention call over every chunk of the
        layer, the query heads of a KV head being the rows of its chunks; the
        chunks of a KV head are then combined by their log-sum-exps.
        """
        b, h, _, d = q.shape
        dtype = torch.promote_types(q.dtype, self.dtype)
        slots = torch.tensor(
            [start + pos % cap for start, cap in zip(self._ring_start, self.capacities)], device=self.device
        )
        self._flat_keys.index_copy_(1, slots, k[:, :, 0].detach().to(self.dtype))
        self._flat_values.index_copy_(1, slots, v[:, :, 0].detach().to(self.dtype))
        if pos < self._longest:  # some ring is still filling (a full ring's slots stay 0)
            self._flat_unread.index_fill_(1, slots, 0.0)
        if self._compiled_step(q):
            out = ring_decode.ring_decode(
                q.reshape(b, h, d).contiguous(), self._flat_keys, self._flat_values, self._rings.ring_start,
                self._rings.capacity, self._rings.windows, pos + 1, scale,
            )
            return out.view(b, h, 1, d)
        qg = q.reshape(b, self.num_kv_heads, self.group, d).to(dtype)
        outs = [plan.attend(qg, pos + 1, scale) for plan in self._plans]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self._order is not None:
            out = out.index_select(1, self._order)
        out = out.reshape(b, h, 1, d)
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def _compiled_step(self, q: torch.Tensor) -> bool:
        """Whether this step runs the compiled decode step: CPU, one dtype, no gradient, built."""
        if self.device.type != "cpu" or q.dtype != self.dtype or q.device.type != "cpu":
            return False
        if q.requires_grad and torch.is_grad_enabled():
            return False
        return ring_decode.load() is not None

    def packed_step(self, qkv: torch.Tensor) -> bool:
        """Whether the next decode step can run as :meth:`decode_packed`: the compiled step, float32 or bfloat16."""
        return self.length > 0 and qkv.dtype in (torch.float32, torch.bfloat16) and self._compiled_step(qkv)

    def decode_packed(
        self, qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, scale: float | None = None
    ) -> torch.Tensor:
        """One decode step from a layer's packed projection: rotate, write, attend; returns (B, H * D).

        ``qkv`` (B, (H + 2 H_kv) D) holds the query, key and value heads of
        position ``length``; ``cos``, ``sin`` the rotary tables (``None``: no
        rotary embedding). The same step as :meth:`update_and_attend` with one
        token, in one call of :func:`aah.decode.ring_decode.ring_decode_packed`.
        """
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if qkv.dim() != 2 or qkv.shape[1] != width:
            raise ValueError(f"qkv must be (batch, {width}) for this cache, got {tuple(qkv.shape)}")
        return self._compiled_decode(ring_decode.ring_decode_packed, qkv.detach().contiguous(), cos, sin, scale)

    def decode_block(
        self, x: torch.Tensor, block: ring_decode.Block, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> torch.Tensor:
        """One decode step of a whole pre-norm block whose attention reads this cache; returns (B, d_model).

        ``x`` (B, d_model) is the block's input at position ``length``; ``cos``,
        ``sin`` the rotary tables (``None``: none). The step runs in one call of
        :func:`aah.decode.ring_decode.decode_block` (:meth:`aah.model.Block.forward` uses it).
        """
        if x.dim() != 2:
            raise ValueError(f"x must be (batch, d_model), got {tuple(x.shape)}")
        return self._compiled_decode(
            lambda x, *rest: ring_decode.decode_block(x, block, *rest), x.detach().contiguous(), cos, sin, None
        )

    def _compiled_decode(self, step, x: torch.Tensor, cos, sin, scale: float | None) -> torch.Tensor:
        """Run a compiled decode ``step`` on the rings for position ``length``, then count the position."""
        self.check_step(x.shape[0], 1)
        if self.length == 0:
            raise ValueError("a compiled decode step continues a prefix: prefill the cache first")
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else float(scale)
        out = step(x, cos, sin, self._rings, self.length + 1, scale)
        self.length += 1
        return out

    def _attend_ring(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        start: int,
        scale: float,
    ) -> torch.Tensor:
        """Masked attention of several new queries over the ring buffer plus ``k_new``, ``v_new``.

        Scores are computed in at least float32. The mask is built from the
        absolute position each slot holds, so the slot order does not matter.
        """
        b, h, t, d = q.shape
        compute = torch.promote_types(q.dtype, torch.float32)
        qg = q.reshape(b, self.num_kv_heads, self.group, t, d)
        q_pos = torch.arange(start, start + t, device=self.device)
        out = None
        if len(self._buckets) > 1:
            out = torch.empty(b, self.num_kv_heads, self.group, t, d, dtype=compute, device=q.device)
        for bucket in self._buckets:
            k_pos = torch.cat([slot_positions(start, bucket.capacity, self.device), q_pos])
            keys = torch.cat([bucket.keys.to(compute), bucket.select(k_new).to(compute)], dim=2)
            values = torch.cat([bucket.values.to(compute), bucket.select(v_new).to(compute)], dim=2)
            # allowed[g, j, i, s]: query i of the j-th query head of KV head g may read slot s.
            dist = q_pos[:, None] - k_pos[None, :]  # (T, S)
            allowed = (k_pos >= 0)[None, None, None, :] & (dist >= 0)[None, None]
            allowed = allowed & (dist[None, None] < bucket.windows[:, :, None, None])
            scores = torch.einsum("bgjtd,bgsd->bgjts", bucket.select(qg).to(compute), keys) * scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            yb = torch.einsum("bgjts,bgsd->bgjtd", scores.softmax(dim=-1), values)
            if out is None:  # one bucket holding every KV head in order
                out = yb
            else:
                out[:, bucket.kv_heads] = yb
        return out.reshape(b, h, t, d).to(q.dtype)


class WindowKVCache:
    """Per-window KV cache of a whole :class:`aah.GPT`: one :class:`LayerKVCache` per attention layer.

    Create it with :meth:`for_model` (or ``GPT.new_cache``) and pass it as
    ``model(idx, cache=cache)``; each call continues the cached prefix.
    """

    def __init__(self, layers: Sequence[LayerKVCache]):
        if not layers:
            raise ValueError("a WindowKVCache needs at least one layer")
        first = layers[0]
        for layer in layers:
            if (layer.batch_size, layer.max_len) != (first.batch_size, first.max_len):
                raise ValueError("all layers of a cache must share batch size and max_len")
        self.layers = list(layers)

    @classmethod
    def for_model(
        cls,
        model: GPT,
        batch_size: int,
        max_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> WindowKVCache:
        """An empty cache for ``model`` holding up to ``max_len`` positions (default: its max length).

        The windows are the model's current windows at ``max_len``, frozen from
        now on. ``dtype`` and ``device`` default to those of the model's weights.
        """
        limit = model.config.max_seq_len
        max_len = limit if max_len is None else _positive_int(max_len, "max_len")
        if max_len > limit:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {limit}")
        weight = model.embed.weight
        dtype = weight.dtype if dtype is None else dtype
        device = weight.device if device is None else device
        layers = [
            LayerKVCache(
                attn.current_windows(max_len),
                attn.num_kv_heads,
                attn.head_dim,
                batch_size=batch_size,
                max_len=max_len,
                dtype=dtype,
                device=device,
            )
            for attn in model.attention_layers()
        ]
        return cls(layers)

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
