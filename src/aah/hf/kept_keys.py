"""Kept keys: the far keys a prompt's last tokens attend to stay in the window cache (ours).

Windows cut what lies far back, and a fact buried early in a long prompt is then out of every
short head's reach when the question comes (docs/hf.md, "Retrieval-preserving windows"). At
the end of a windowed prefill this asks the prompt itself which far keys matter, as SnapKV
does for a full prefill:

* the last ``tail_tokens`` prompt positions (where the question sits) attend to **every**
  earlier key in every head (within a layer's own sliding window), not only to their windows
  and sinks; their outputs replace the windowed ones;
* from those rows' attention probabilities, summed over the tail rows and over the query heads
  that read one KV head, then max-pooled over ``pool_width`` neighbouring positions (so a key
  next to one the question reads is kept with it: copying a number digit by digit reads each
  digit's neighbours, as SnapKV's pooling keeps them), each KV head keeps its ``keys_per_head``
  highest-scoring keys among those no window will read again (positions up to the end of the
  prompt less the ring's capacity, sinks excluded; the sinks' scores are zeroed before the
  pooling);
* every later query of every head reading that KV head sees the kept keys besides its window
  and sinks; no key is counted twice, since a kept key lies outside every window from then on
  (a ``crop`` back into the prompt drops the kept keys a window would reach again).

Only the cache's first call (the prompt, or the first chunk of a chunked prefill) reads its
tail and keeps keys. A layer with its own sliding window reads its tail within that window
and keeps no keys, since it must never read beyond it.

KV memory grows by at most ``keys_per_head`` keys per KV head (``keys_per_head / T`` of a full
cache): a head keeps only far keys that exist (none where its window reaches the whole prompt),
and the prefill's causal coverage by the tail rows' extra pairs (:func:`tail_coverage_pairs`);
both are reported beside the windows' own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .patching import executed_coverage

__all__ = ["KeptGroup", "KeptKeys", "KeptStore", "choose_kept", "kept_coverage", "tail_attention", "tail_coverage_pairs"]


@dataclass(frozen=True)
class KeptKeys:
    """How many prompt positions read everything (``tail_tokens``), how many far keys each KV
    head keeps from their reading (``keys_per_head``) and over how many neighbouring positions
    a key's score is max-pooled (``pool_width``, odd; 1: no pooling)."""

    tail_tokens: int
    keys_per_head: int
    pool_width: int = 7

    def __post_init__(self) -> None:
        for name in ("tail_tokens", "keys_per_head", "pool_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kept keys: {name} must be an integer >= 1, got {value!r}")
        if self.pool_width % 2 == 0:
            raise ValueError(f"kept keys: pool_width must be odd, got {self.pool_width}")


@dataclass(eq=False)
class KeptGroup:
    """The keys kept by KV heads that share one ring capacity: (B, n, K, D) keys and values,
    their positions (B, n, K) (-1 where empty) and which slots hold a key. ``K`` is the most any
    of these heads keeps in any row, so heads with no far key to keep hold nothing."""

    capacity: int
    kv_heads: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor


@dataclass(eq=False)
class KeptStore:
    """What one layer keeps: one :class:`KeptGroup` per ring group of its window cache (in the
    order of :attr:`aah.decode.rings.RingStore.groups`)."""

    groups: list[KeptGroup]

    @classmethod
    def gather(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
               ring_groups: Sequence) -> KeptStore:
        """Keep the ``positions`` (B, H_kv, K) that :func:`choose_kept` chose (``valid`` ones first)
        of ``keys``/``values`` (B, H_kv, T, D); each ring group (with ``capacity`` and ``kv_heads``)
        gets only as many slots as its heads fill."""
        groups = []
        for ring in ring_groups:
            heads = list(ring.kv_heads)
            count = int(valid[:, heads].sum(-1).max())
            pos, ok = positions[:, heads, :count], valid[:, heads, :count]
            index = pos.clamp_min(0)[..., None]
            groups.append(KeptGroup(
                ring.capacity, heads,
                keys[:, heads].gather(2, index.expand(-1, -1, -1, keys.shape[-1])),
                values[:, heads].gather(2, index.expand(-1, -1, -1, values.shape[-1])),
                pos.clone(), ok.clone(),
            ))
        return cls(groups)

    def readable(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per ring group: keys, values and valid flags, as :meth:`aah.decode.rings.RingStore.attend` reads them."""
        return [(g.keys, g.values, g.valid) for g in self.groups]

    def held(self) -> list[list[list[int]]]:
        """The positions each row (first index) and KV head (second) holds, in increasing order."""
        rows = self.groups[0].valid.shape[0]
        held: list[list[list[int]]] = [[[] for _ in range(sum(len(g.kv_heads) for g in self.groups))]
                                       for _ in range(rows)]
        for g in self.groups:
            for i, head in enumerate(g.kv_heads):
                for row in range(rows):
                    held[row][head] = g.positions[row, i][g.valid[row, i]].tolist()
        return held

    def forget_reached(self, length: int) -> None:
        """After a crop back to ``length`` positions, drop the keys a later window reaches again (a
        ring of capacity C serves windows that reach back to ``length - C + 1`` at the most)."""
        for g in self.groups:
            g.valid &= g.positions <= length - g.capacity

    def select_rows(self, select: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for g in self.groups:
            for name in ("keys", "values", "positions", "valid"):
                setattr(g, name, select(getattr(g, name)))

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for g in self.groups for t in (g.keys, g.values))


def tail_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of the last ``n`` query rows over every key they may see.

    ``query`` (B, H, n, D) holds those rows, ``key``/``value`` (B, H_kv, T, D) every key,
    ``visible`` (B or 1, 1, n, T) the causal, padding and sliding-window mask of those rows.
    Returns the output (B, H, n, D_v) in the query's dtype and the probabilities (B, H, n, T)
    in float32.
    """
    repeat = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(repeat, dim=1)
    v = value.float().repeat_interleave(repeat, dim=1)
    scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, v).to(query.dtype), probs


def choose_kept(
    probs: torch.Tensor, num_kv_heads: int, eligible: torch.Tensor, count: int, pool_width: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` eligible positions with the most attention per (row, KV head).

    ``probs`` (B, H, n, T) from :func:`tail_attention`; ``eligible`` (B, H_kv, T) bool. The score
    of a position is its probability summed over the tail rows and the query heads reading the
    KV head, then the largest such sum within ``pool_width // 2`` positions of it. Returns
    positions (B, H_kv, count) in increasing order and whether each holds an eligible key (a row
    with fewer than ``count`` eligible keys leaves the rest empty, -1); equal scores go to the
    earlier position.
    """
    batch, heads, _, length = probs.shape
    score = probs.sum(2).view(batch, num_kv_heads, heads // num_kv_heads, length).sum(2)
    if pool_width > 1:
        flat = score.reshape(batch * num_kv_heads, 1, length)
        score = F.max_pool1d(flat, pool_width, stride=1, padding=pool_width // 2).view(batch, num_kv_heads, length)
    score = score.masked_fill(~eligible, float("-inf"))
    # A stable sort breaks ties (pooling makes them) toward the earlier position.
    values, indices = score.sort(dim=-1, descending=True, stable=True)
    values, indices = values[..., :count], indices[..., :count]
    valid = torch.isfinite(values)
    positions = torch.where(valid, indices, torch.full_like(indices, length))
    positions, order = positions.sort(dim=-1)
    valid = valid.gather(-1, order)
    return torch.where(valid, positions, torch.full_like(positions, -1)), valid


def tail_coverage_pairs(
    windows: Sequence[int], sink_tokens: int, seq_len: int, tail_tokens: int, layer_window: int | None = None
) -> int:
    """(query, key) pairs the last ``tail_tokens`` rows of a ``seq_len`` prompt read beyond the
    windows and sinks of the heads ``windows``: those rows read every earlier key instead (within
    ``layer_window``, a layer's own sliding window, where it has one)."""
    extra = 0
    for window in windows:
        for q in range(max(0, seq_len - tail_tokens), seq_len):
            reach = q + 1 if layer_window is None else min(q + 1, layer_window)
            seen = min(q + 1, window) + (min(sink_tokens, q + 1 - window) if q + 1 > window else 0)
            extra += max(0, reach - seen)
    return extra


def kept_coverage(specs: Sequence, seq_len: int, kept: KeptKeys, num_kv_heads: int) -> tuple[float, float]:
    """ACR and causal coverage of a ``seq_len`` prompt read with ``kept`` over the layers' windows
    ``specs`` (:class:`aah.hf.patching.LayerWindows`): each head holds its window and its sinks,
    plus its KV head's kept keys (at most the positions no window reads again, none in a layer
    with its own sliding window), and the tail rows read every earlier key."""
    heads = sum(len(spec.windows) for spec in specs)
    ratio = 0.0
    for spec in specs:
        group = len(spec.windows) // num_kv_heads
        for h, window in enumerate(spec.windows):
            held = min(window + spec.sink_tokens, seq_len)
            if spec.layer_window is None:
                reach = max(spec.windows[(h // group) * group:(h // group + 1) * group])
                held += min(kept.keys_per_head, max(0, seq_len - reach + 1 - spec.sink_tokens))
            ratio += min(held, seq_len) / seq_len
    tail = sum(tail_coverage_pairs(spec.windows, spec.sink_tokens, seq_len, kept.tail_tokens, spec.layer_window)
               for spec in specs)
    return ratio / heads, executed_coverage(None, seq_len, specs)[1] + tail / (seq_len * (seq_len + 1) // 2 * heads)
