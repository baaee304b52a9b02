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

**Rolling kept keys in the prefill** (``prefill_keys`` > 0, ours). A fact far back in a long
prompt is lost not only by the question's reading: the text after it, read through short
windows, no longer refers to it, and at 8192 tokens that alone can make SmolLM2 miss a pass key
that the question reads with full attention (docs/hf.md, "Kept keys"). The prompt is therefore
read in blocks of ``prefill_block`` rows; before each block after the first, the last
``tail_tokens`` rows of the previous one score every earlier key as above (their exact
attention, summed, sinks zeroed, max-pooled), and each KV head whose windows leave keys behind
gives the block's rows its ``prefill_keys`` best keys among those no window of its query heads
reads from the block's first row on; the block's rows read them besides their windows and
sinks (:func:`rolling_kept_attention`; an unpadded prompt reads those rows there only, not
through the windowed pass as well: :func:`rolling_prefill`). This adds at most ``prefill_keys`` pairs per row and
head to the causal coverage (:func:`rolling_coverage_pairs`) and nothing to the cache.

KV memory grows by at most ``keys_per_head`` keys per KV head (``keys_per_head / T`` of a full
cache): a head keeps only far keys that exist (none where its window reaches the whole prompt),
and the prefill's causal coverage by the tail rows' extra pairs (:func:`tail_coverage_pairs`);
both are reported beside the windows' own. What the prefill really reads, the tail rows' windowed
pass and the blocks' scoring rows included, is its executed coverage (:func:`executed_read_coverage`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...backends.strips import strip_attention_lse
from ...decode.ring_decode import KeptSlots
from ...windows import causal_pairs, kv_group_reach, visible
from .spec import executed_coverage

__all__ = [
    "KEPT_SETTINGS", "KeptGroup", "KeptKeys", "KeptStore", "choose_kept", "compiled_rolling_prefill", "executed_read_coverage", "kept_coverage",
    "kept_keys_from", "rolling_coverage_pairs", "rolling_kept_attention", "rolling_prefill", "tail_attention", "tail_coverage_pairs",
]


@dataclass(frozen=True)
class KeptKeys:
    """How many prompt positions read everything (``tail_tokens``), how many far keys each KV
    head keeps from their reading (``keys_per_head``) and over how many neighbouring positions
    a key's score is max-pooled (``pool_width``, odd; 1: no pooling); with ``prefill_keys`` > 0,
    each block of ``prefill_block`` prompt rows also reads that many far keys per KV head,
    chosen by the last ``tail_tokens`` rows of the block before (rolling kept keys)."""

    tail_tokens: int
    keys_per_head: int
    pool_width: int = 7
    prefill_keys: int = 0
    prefill_block: int = 512

    def __post_init__(self) -> None:
        for name, least in (("tail_tokens", 1), ("keys_per_head", 1), ("pool_width", 1), ("prefill_keys", 0),
                            ("prefill_block", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"kept keys: {name} must be an integer >= {least}, got {value!r}")
        if self.pool_width % 2 == 0:
            raise ValueError(f"kept keys: pool_width must be odd, got {self.pool_width}")


#: The names of the kept-keys settings: ``aah hf`` flags (``--tail-tokens``, ...), JSON config keys and
#: lm-eval ``model_args``, in the order of :class:`KeptKeys`'s fields.
KEPT_SETTINGS = ("tail_tokens", "kept_keys", "kept_pool", "prefill_kept", "prefill_block")


def kept_keys_from(values: Mapping[str, int | None], name: Callable[[str], str] = str) -> KeptKeys | None:
    """The :class:`KeptKeys` of the settings :data:`KEPT_SETTINGS` in ``values`` (missing or None: not
    given), or ``None`` without ``tail_tokens`` and ``kept_keys`` (which go together). A setting
    without what it needs, or a bad value, is a ``ValueError`` naming it as ``name`` spells it."""
    tail_tokens, kept_keys, pool, prefill, block = (values.get(key) for key in KEPT_SETTINGS)
    if tail_tokens is None and kept_keys is None:
        for key, value in (("kept_pool", pool), ("prefill_kept", prefill), ("prefill_block", block)):
            if value is not None:
                raise ValueError(f"{name(key)} needs {name('tail_tokens')} and {name('kept_keys')}")
        return None
    if tail_tokens is None or kept_keys is None:
        raise ValueError(f"{name('tail_tokens')} and {name('kept_keys')} go together: give both or neither")
    if block is not None and not prefill:
        raise ValueError(f"{name('prefill_block')} needs {name('prefill_kept')} >= 1")
    pool = KeptKeys.pool_width if pool is None else pool
    prefill = 0 if prefill is None else prefill
    block = KeptKeys.prefill_block if block is None else block
    given = dict(zip(KEPT_SETTINGS, (tail_tokens, kept_keys, pool, prefill, block)))
    for key, least in zip(KEPT_SETTINGS, (1, 1, 1, 0, 1)):
        value = given[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name(key)} must be an integer, got {value!r}")
        if value < least:
            raise ValueError(f"{name(key)} must be >= {least}, got {value}")
    if pool % 2 == 0:
        raise ValueError(f"{name('kept_pool')} must be odd, got {pool}")
    return KeptKeys(*given.values())


@dataclass(eq=False)
class KeptGroup:
    """The keys kept by KV heads that share one ring capacity: (B, n, K, D) keys and values,
    their positions (B, n, K) (-1 where empty) and which slots hold a key. ``K`` is the most any
    of these heads keeps in any row, so heads with no far key to keep hold nothing. The keys,
    values and flags are views of the layer's :class:`KeptStore` buffers."""

    capacity: int
    kv_heads: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor


@dataclass(eq=False)
class KeptStore:
    """What one layer keeps: one :class:`KeptGroup` per ring group of its window cache (in the
    order of :attr:`aah.decode.rings.RingStore.groups`), all in one buffer of keys, one of values
    and one of flags, KV head after KV head, which the compiled decode steps read as they are
    (:meth:`slots`: no copy)."""

    groups: list[KeptGroup]
    keys: torch.Tensor  # (B, slots, D)
    values: torch.Tensor
    valid: torch.Tensor  # (B, slots) bool

    @classmethod
    def gather(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
               ring_groups: Sequence) -> KeptStore:
        """Keep the ``positions`` (B, H_kv, K) that :func:`choose_kept` chose (``valid`` ones first)
        of ``keys``/``values`` (B, H_kv, T, D); each ring group (with ``capacity`` and ``kv_heads``)
        gets only as many slots as its heads fill."""
        parts, layout = [], []
        for ring in ring_groups:
            heads = list(ring.kv_heads)
            count = int(valid[:, heads].sum(-1).max())
            pos, ok = positions[:, heads, :count], valid[:, heads, :count]
            index = pos.clamp_min(0)[..., None]
            parts.append((keys[:, heads].gather(2, index.expand(-1, -1, -1, keys.shape[-1])),
                          values[:, heads].gather(2, index.expand(-1, -1, -1, values.shape[-1])), ok))
            layout.append((ring.capacity, heads, pos.clone()))
        return cls._laid_out(parts, layout)

    @classmethod
    def _laid_out(cls, parts, layout) -> KeptStore:
        """One buffer each for the groups' keys, values and flags (B, n, K, ...), groups as views."""
        flat = [torch.cat([p[i].flatten(1, 2) for p in parts], dim=1) for i in range(3)]
        groups, offset = [], 0
        for (capacity, heads, pos), (k, v, ok) in zip(layout, parts):
            size = ok.shape[1] * ok.shape[2]
            view = slice(offset, offset + size)
            groups.append(KeptGroup(capacity, heads, flat[0][:, view].view(k.shape), flat[1][:, view].view(v.shape),
                                    pos, flat[2][:, view].view(ok.shape)))
            offset += size
        return cls(groups, *flat)

    def readable(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per ring group: keys, values and valid flags, as :meth:`aah.decode.rings.RingStore.attend` reads them."""
        return [(g.keys, g.values, g.valid) for g in self.groups]

    def slots(self):
        """The kept keys as the compiled decode steps read them (:class:`aah.decode.ring_decode.KeptSlots`):
        the buffers themselves, each KV head a run of its group's ``K`` slots."""
        kv_heads = sum(len(g.kv_heads) for g in self.groups)
        start, count, offset = [0] * kv_heads, [0] * kv_heads, 0
        for g in self.groups:
            width = g.valid.shape[2]
            for i, head in enumerate(g.kv_heads):
                start[head], count[head] = offset + i * width, width
            offset += len(g.kv_heads) * width
        return KeptSlots(self.keys, self.values, self.valid, torch.tensor(start, dtype=torch.long),
                         torch.tensor(count, dtype=torch.long))

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
            g.valid &= g.positions <= length - g.capacity  # in place: the flags buffer sees it

    def select_rows(self, select: Callable[[torch.Tensor], torch.Tensor]) -> None:
        parts = [(select(g.keys), select(g.values), select(g.valid)) for g in self.groups]
        layout = [(g.capacity, g.kv_heads, select(g.positions)) for g in self.groups]
        again = self._laid_out(parts, layout)
        self.groups, self.keys, self.values, self.valid = again.groups, again.keys, again.values, again.valid

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


def tail_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of the last ``n`` query rows over every key they may see.

    ``query`` (B, H, n, D) holds those rows, ``key``/``value`` (B, H_kv, T, D) every key,
    ``visible`` (B or 1, 1, n, T) the causal, padding and sliding-window mask of those rows.
    Returns the output (B, H, n, D_v) in the query's dtype and the probabilities (B, H, n, T)
    in float32.
    """
    batch, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    # The query heads of one KV head read it as one stack of rows: no copy of the keys per head.
    stacked = query.float().reshape(batch, kv_heads, heads // kv_heads * rows, dim)
    scores = torch.matmul(stacked, key.float().transpose(-1, -2)).view(batch, heads, rows, length)
    scores.mul_(scale).masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    out = torch.matmul(probs.view(batch, kv_heads, -1, length), value.float())
    return out.view(batch, heads, rows, -1).to(query.dtype), probs


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


def rolling_kept_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    windows: Sequence[int],
    sink_tokens: int,
    real: torch.Tensor,
    kept: KeptKeys,
    scale: float,
) -> torch.Tensor:
    """A windowed prefill's output ``out`` (B, H, T, D) with rolling kept keys (module docstring).

    ``query`` (B, H, T, D), ``key``/``value`` (B, H_kv, T, D) the prompt's; ``windows`` (H,) and
    ``sink_tokens`` its layer's; ``real`` (B, T) the positions holding tokens (padding and other
    hidden keys are read by no row); a row's blocks and its sinks start at its first token. The
    rows of blocks that get kept keys are recomputed for the query heads of the KV heads whose
    windows leave keys behind; everything else of ``out`` (hidden rows too) is returned as it is.
    """
    reach, short, short_heads = _rolling_groups(windows, key.shape[1], sink_tokens, query.shape[2])
    if kept.prefill_keys == 0 or not short:
        return out
    out = out.clone()
    for row in range(query.shape[0]):
        held = real[row].nonzero().flatten()
        if held.numel() == 0:
            continue
        first, last = int(held[0]), int(held[-1]) + 1
        span = slice(first, last)
        out[row, short_heads, span] = _rolling_row(
            query[row, short_heads, span], key[row, short, span], value[row, short, span], real[row, span],
            out[row, short_heads, span], [windows[h] for h in short_heads], [reach[g] for g in short],
            sink_tokens, kept, scale,
        )
    return out


def _rolling_groups(windows: Sequence[int], kv_heads: int, sink_tokens: int,
                    length: int) -> tuple[list[int], list[int], list[int]]:
    """Each KV group's reach (its widest window), the groups whose windows and sinks leave keys of
    a ``length`` prompt behind, and those groups' query heads."""
    group = len(windows) // kv_heads
    reach = list(kv_group_reach(windows, kv_heads))
    short = [g for g in range(kv_heads) if reach[g] + sink_tokens < length]
    return reach, short, [g * group + i for g in short for i in range(group)]


def rolling_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    windows: Sequence[int],
    sink_tokens: int,
    kept: KeptKeys,
    scale: float,
    windowed: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]], torch.Tensor],
) -> torch.Tensor:
    """A prompt every position of which holds a token, read with rolling kept keys, each key of a
    window read once: what :func:`rolling_kept_attention` gives after the windowed pass, without
    that pass over the rows it recomputes.

    ``windowed(q, k, v, windows)`` is the layer's windowed attention for a subset of its KV groups
    (their query heads' ``windows``); it reads the groups whose windows and sinks reach every key
    over the whole prompt and the others over the first block only, whose rows read no kept key.
    """
    _, short, short_heads = _rolling_groups(windows, key.shape[1], sink_tokens, query.shape[2])
    if kept.prefill_keys == 0 or not short:
        return windowed(query, key, value, tuple(windows))
    batch, heads, length = query.shape[:3]
    out = query.new_empty(batch, heads, length, value.shape[-1])
    long = [g for g in range(key.shape[1]) if g not in short]
    long_heads = [h for h in range(heads) if h not in short_heads]
    if long:
        out[:, long_heads] = windowed(query[:, long_heads], key[:, long], value[:, long],
                                      tuple(windows[h] for h in long_heads))
    first = min(kept.prefill_block, length)
    out[:, short_heads, :first] = windowed(query[:, short_heads, :first], key[:, short, :first],
                                           value[:, short, :first], tuple(windows[h] for h in short_heads))
    real = torch.ones(batch, length, dtype=torch.bool, device=query.device)
    return rolling_kept_attention(query, key, value, out, windows, sink_tokens, real, kept, scale)


def scoring_probabilities(rows: torch.Tensor, keys: torch.Tensor, group: int) -> torch.Tensor:
    """Causal attention probabilities of a block's last rows over the keys before the block.

    ``rows`` (B, S, G * n, D): the ``n`` rows before position ``t`` (``keys`` (B, S, t, D) holds
    positions ``0 .. t - 1``) of the ``G`` query heads of each of ``S`` KV heads, head after head,
    scaled; row ``i`` of a head sits at ``t - n + i`` and reads keys up to it. Returns (B, S, G * n, t).
    """
    tail, start = rows.shape[2] // group, keys.shape[2]
    scores = torch.matmul(rows, keys.transpose(-1, -2))
    future = torch.ones(tail, tail, dtype=torch.bool, device=rows.device).triu(1)
    scores.view(*scores.shape[:2], group, tail, start)[..., start - tail:].masked_fill_(future, float("-inf"))
    return torch.softmax(scores, dim=-1)


def kept_part(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept keys' part of the rows' softmax: output (B, S, R, D) and log-sum-exp (B, S, R)
    (``-inf`` where a KV head holds no valid key) of ``rows`` (B, S, R, D), scaled, over ``keys``
    and ``values`` (B, S, K, D) of which ``valid`` (B, S, K) are read."""
    if rows.device.type == "cpu" and bool(valid.all()):  # every key read: one fused kernel call
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(rows, keys, values, 0.0, False,
                                                                             scale=1.0)
        return out, lse
    part = torch.matmul(rows, keys.transpose(-1, -2)).masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(part, dim=-1)
    return torch.matmul(torch.exp(part - lse[..., None]).nan_to_num(0.0), values), lse


def compiled_rolling_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    windows: Sequence[int],
    sink_tokens: int,
    kept: KeptKeys,
    scale: float,
) -> torch.Tensor:
    """:func:`rolling_prefill` in one compiled windowed pass, forward only (CPU).

    Every row reads its window and sinks once, through the strip kernel, which also returns each
    row's log-sum-exp (:func:`aah.backends.strips.strip_attention_lse`). Before each block after
    the first, the previous block's last ``tail_tokens`` rows score the earlier keys (their exact
    causal attention, summed over the rows and over the query heads of a KV head, sinks zeroed,
    max-pooled: :func:`choose_kept`), and the block's rows read their KV head's ``prefill_keys``
    best keys as one more small part of the same softmax, joined by the log-sum-exps. A kept key
    lies before every window of its group and after the sinks, so no key is read twice and the
    result is the semantics of the module docstring. ``query`` (B, H, T, D) of an unpadded prompt,
    ``key``/``value`` (B, H_kv, T, D); returns (B, H, T, D).
    """
    out, lse = strip_attention_lse(query, key, value, windows, scale, sink_tokens=sink_tokens)
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    reach, short, _ = _rolling_groups(windows, kv_heads, sink_tokens, length)
    first_block = kept.prefill_block
    if kept.prefill_keys == 0 or not short or first_block >= length:
        return out
    group, groups = heads // kv_heads, len(short)
    sinks = min(sink_tokens, length)
    pos = torch.arange(length, device=query.device)
    limit = torch.tensor([reach[g] for g in short], device=query.device)[:, None]  # (S, 1)
    # The short groups (a slice where they are consecutive: views, not copies), their queries
    # (scaled once), keys and values: (B, S, G, T, D) and (B, S, T, D).
    short = slice(short[0], short[-1] + 1) if short == list(range(short[0], short[-1] + 1)) else short
    q_short = query.view(batch, kv_heads, group, length, dim)[:, short].float() * scale
    k_short, v_short = key[:, short].float(), value[:, short].float()
    kept_out = q_short.new_zeros(batch, groups, group, length - first_block, dim)
    kept_lse = q_short.new_full((batch, groups, group, length - first_block), float("-inf"))
    for start in range(first_block, length, first_block):
        stop = min(length, start + first_block)
        tail = min(kept.tail_tokens, start)
        # The previous block's last rows score every earlier key (grouped: no copy of the keys);
        # only their last ``tail`` columns can lie in a row's future.
        rows = q_short[:, :, :, start - tail:start].reshape(batch, groups, group * tail, dim)
        probs = scoring_probabilities(rows, k_short[:, :, :start], group)
        probs[..., :sinks] = 0.0  # the sinks lend no score to their neighbours
        eligible = (pos[None, :start] >= sinks) & (pos[None, :start] <= start - limit)  # (S, start)
        positions, valid = choose_kept(probs.view(batch, groups * group, tail, start), groups,
                                       eligible[None].expand(batch, -1, -1), kept.prefill_keys, kept.pool_width)
        # The block's rows read those keys: one more part of their softmax.
        index = positions.clamp_min(0)[..., None].expand(-1, -1, -1, dim)
        block_rows = q_short[:, :, :, start:stop].reshape(batch, groups, group * (stop - start), dim)
        part_out, part_lse = kept_part(block_rows, k_short.gather(2, index), v_short.gather(2, index), valid)
        span = slice(start - first_block, stop - first_block)
        kept_out[:, :, :, span] = part_out.view(batch, groups, group, stop - start, dim)
        kept_lse[:, :, :, span] = part_lse.view(batch, groups, group, stop - start)
    # Every row from the second block on: its window's part and its kept keys' part, joined.
    out_groups = out.view(batch, kv_heads, group, length, dim)
    window_lse = lse.view(batch, kv_heads, group, length)[:, short, :, first_block:]
    joined = torch.logaddexp(window_lse, kept_lse)
    kept_out.mul_(torch.exp(kept_lse - joined)[..., None])
    window_share = torch.exp(window_lse - joined)[..., None]
    if isinstance(short, slice) and out.dtype == torch.float32:  # in place, in the output itself
        out_groups[:, short, :, first_block:].mul_(window_share).add_(kept_out)
    else:
        merged = out_groups[:, short, :, first_block:].float() * window_share + kept_out
        out_groups[:, short, :, first_block:] = merged.to(out.dtype)
    return out


def _rolling_row(query, key, value, present, out, windows, reach, sink_tokens, kept: KeptKeys, scale):
    """:func:`rolling_kept_attention` for one row's tokens: ``query`` (H, n, D) of the heads of
    KV heads ``key``/``value`` (H_kv, n, D), whose groups reach back ``reach`` keys; ``present``
    (n,) the positions that hold tokens (the first and last do)."""
    heads, length = query.shape[0], query.shape[1]
    kv_heads = key.shape[0]
    group = heads // kv_heads
    pos = torch.arange(length, device=query.device)
    sinks = min(sink_tokens, length)
    limit = torch.tensor(reach, device=query.device)[:, None]  # (H_kv, 1)
    out = out.clone()
    for start in range(kept.prefill_block, length, kept.prefill_block):
        stop = min(length, start + kept.prefill_block)
        # The previous block's last rows score every earlier key with their exact attention.
        tail = min(kept.tail_tokens, start)
        seen = (visible(pos[start - tail:start, None], pos[None, :start], start) & present[None, :start])[None, None]
        _, probs = tail_attention(query[None, :, start - tail:start], key[None, :, :start], value[None, :, :start],
                                  seen, scale)
        probs[..., :sinks] = 0.0  # the sinks lend no score to their neighbours
        # Every block from the second on is read here, with no kept key where none is eligible yet:
        # rolling_prefill's windowed pass leaves those rows to this.
        eligible = (pos[None, :start] >= sinks) & (pos[None, :start] <= start - limit) & present[None, :start]
        positions, valid = choose_kept(probs, kv_heads, eligible[None], kept.prefill_keys, kept.pool_width)
        positions, valid = positions[0], valid[0]  # (H_kv, K)
        # The block's rows read their sinks (those before their window), the kept keys (all before
        # every window of the group) and their window, once each; the heads of one window at a time,
        # so that each reads only its own span.
        index = positions.clamp_min(0)[..., None].expand(-1, -1, key.shape[-1])
        kept_keys = key.gather(1, index).repeat_interleave(group, 0)
        kept_values = value.gather(1, index).repeat_interleave(group, 0)
        kept_valid = valid.repeat_interleave(group, 0)  # (H, K)
        rows = pos[start:stop, None]
        for width in sorted(set(windows)):
            heads_here = [h for h, w in enumerate(windows) if w == width]
            kv = [h // group for h in heads_here]
            low = max(0, start - width + 1)
            keys = torch.cat([key[kv, :sinks], kept_keys[heads_here], key[kv, low:stop]], 1)
            values = torch.cat([value[kv, :sinks], kept_values[heads_here], value[kv, low:stop]], 1)
            local = pos[None, low:stop]
            sink_columns = pos[None, :sinks]  # read as sinks where the window does not reach them
            allowed = torch.cat([
                (visible(rows, sink_columns, width, sinks) & ~visible(rows, sink_columns, width)
                 & present[None, :sinks]).expand(len(heads_here), -1, -1),
                kept_valid[heads_here][:, None, :].expand(-1, stop - start, -1),
                (visible(rows, local, width) & present[None, low:stop]).expand(len(heads_here), -1, -1),
            ], -1)
            block = F.scaled_dot_product_attention(
                query[None, heads_here, start:stop], keys[None], values[None], attn_mask=allowed[None], scale=scale
            )[0]
            # A hidden row may see no key at all here: it keeps what the windowed pass gave it.
            out[heads_here, start:stop] = torch.where(present[start:stop, None], block, out[heads_here, start:stop])
    return out


def rolling_coverage_pairs(
    windows: Sequence[int], sink_tokens: int, seq_len: int, kept: KeptKeys, num_kv_heads: int,
    *, tail_rows: bool = False,
) -> int:
    """(query, key) pairs the rows of a ``seq_len`` prompt before its last ``tail_tokens`` read
    through rolling kept keys (:func:`rolling_kept_attention`), for one layer's ``windows``; with
    ``tail_rows``, the tail's rows too (they read them before the tail's reading replaces them)."""
    if kept.prefill_keys == 0:
        return 0
    group = len(windows) // num_kv_heads
    pairs = 0
    end = seq_len if tail_rows else max(0, seq_len - kept.tail_tokens)  # the tail's rows read every key anyway
    for reach in kv_group_reach(windows, num_kv_heads):
        if reach + sink_tokens >= seq_len:
            continue
        for start in range(kept.prefill_block, end, kept.prefill_block):
            far = max(0, start - reach + 1 - sink_tokens)  # positions sinks .. start - reach
            pairs += group * (min(end, start + kept.prefill_block) - start) * min(kept.prefill_keys, far)
    return pairs


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
    ``specs`` (:class:`aah.hf.bridge.spec.LayerWindows`): each head holds its window and its sinks,
    plus its KV head's kept keys (at most the positions no window reads again, none in a layer
    with its own sliding window), and the tail rows read every earlier key (the other rows also
    their blocks' rolling kept keys, where ``kept.prefill_keys`` > 0)."""
    heads = sum(len(spec.windows) for spec in specs)
    ratio = 0.0
    for spec in specs:
        group = len(spec.windows) // num_kv_heads
        reach_of = kv_group_reach(spec.windows, num_kv_heads)
        for h, window in enumerate(spec.windows):
            held = min(window + spec.sink_tokens, seq_len)
            if spec.layer_window is None:
                reach = reach_of[h // group]
                held += min(kept.keys_per_head, max(0, seq_len - reach + 1 - spec.sink_tokens))
            ratio += min(held, seq_len) / seq_len
    tail = sum(tail_coverage_pairs(spec.windows, spec.sink_tokens, seq_len, kept.tail_tokens, spec.layer_window)
               + (0 if spec.layer_window is not None
                  else rolling_coverage_pairs(spec.windows, spec.sink_tokens, seq_len, kept, num_kv_heads))
               for spec in specs)
    return ratio / heads, executed_coverage(None, seq_len, specs)[1] + tail / (seq_len * (seq_len + 1) // 2 * heads)


def executed_read_coverage(
    specs: Sequence, seq_len: int, kept: KeptKeys | None, num_kv_heads: int, *, padded: bool = False
) -> float:
    """Executed coverage: every (query, key) pair the prefill of a ``seq_len`` prompt reads, over
    the causal pairs ``T (T + 1) / 2`` of every head of the layers ``specs``
    (:class:`aah.hf.bridge.spec.LayerWindows`, a sliding layer's windows capped and without sinks).

    Counted, per head: its window and sinks on every row (:func:`aah.windows.causal_pairs`); with
    ``kept``, the tail rows once more, over every earlier key (within a layer's own sliding window):
    the windowed pass reads them before :func:`tail_attention` replaces them; with rolling kept keys,
    in the KV groups whose windows leave keys behind, each row from the second block on also reads
    its block's kept keys (:func:`rolling_coverage_pairs`, the tail's rows included) and, before
    each block, the previous block's last ``tail_tokens`` rows read every earlier key to score them.
    ``padded``: the prompt took the two-pass route (a mask that is not plain padding, or gradients
    or a device the compiled pass does not serve), so those groups' rows from the second block on
    were read by the windowed pass first (:func:`rolling_kept_attention`); the compiled pass
    (:func:`compiled_rolling_prefill`, plainly padded rows too) and :func:`rolling_prefill` read them once. Without ``kept`` this is the causal coverage. Pairs
    follow the window rule; a backend's tiles may compute more (:func:`aah.backends.executed_coverage`).
    """

    def rows(window: int, sinks: int, start: int, stop: int) -> int:  # window pairs of rows start..stop-1
        return causal_pairs(window, stop, sink_tokens=sinks) - (causal_pairs(window, start, sink_tokens=sinks)
                                                                 if start else 0)

    heads = sum(len(spec.windows) for spec in specs)
    pairs = 0
    for spec in specs:
        windows, sinks = spec.windows, spec.sink_tokens
        pairs += sum(rows(w, sinks, 0, seq_len) for w in windows)
        if kept is None:
            continue
        tail = min(kept.tail_tokens, seq_len)
        pairs += tail_coverage_pairs(windows, sinks, seq_len, tail, spec.layer_window)
        pairs += sum(rows(w, sinks, seq_len - tail, seq_len) for w in windows)
        if spec.layer_window is not None or not kept.prefill_keys:
            continue
        pairs += rolling_coverage_pairs(windows, sinks, seq_len, kept, num_kv_heads, tail_rows=True)
        short_heads = _rolling_groups(windows, num_kv_heads, sinks, seq_len)[2]
        for start in range(kept.prefill_block, seq_len, kept.prefill_block):
            scoring = min(kept.tail_tokens, start)  # rows start - scoring .. start - 1 read q + 1 keys each
            pairs += len(short_heads) * (scoring * start - scoring * (scoring - 1) // 2)
        if padded:
            pairs += sum(rows(windows[h], sinks, min(kept.prefill_block, seq_len), seq_len) for h in short_heads)
    return pairs / (seq_len * (seq_len + 1) // 2 * heads)
