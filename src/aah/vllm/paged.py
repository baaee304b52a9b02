"""Per-head windows with sink tokens over vLLM's paged KV cache (PyTorch and the compiled kernel, no vLLM import).

vLLM hands an attention layer a batch of requests: request ``r`` has ``q_len`` new query tokens
at positions ``[seq_len - q_len, seq_len)``, and its keys sit in the pages listed by its row of
the block table. For one :class:`aah.vllm.plan.WindowClass` (query heads sharing a KV head and a
window ``W``) with ``S`` sinks, :func:`windowed_attention` splits each request's queries:

* queries at positions ``p < W`` see no key outside their window (and every sink inside it),
  so a plain sliding-window kernel is exact for them: the ``kernel`` callable (vLLM's CPU
  kernel in :mod:`aah.vllm.backend`) runs them, and with ``S = 0`` it runs every query;
* the other queries also need the sinks ``j <= p - W`` that fell out of their window; they run
  in the compiled :func:`aah.decode.ring_decode.paged_attention` (one call per window class, or one
  per layer when all its heads share a window), which reads the window and the sinks straight
  from the pages. Where the extension cannot be built they run here in PyTorch: keys gathered
  from the pages, sinks and window in one softmax; a request with one new token (a decode
  step) batched with the others, a longer chunk in blocks of queries, each over the keys its
  window spans plus the sinks.

The page layout is vLLM CPU's: ``key_cache`` and ``value_cache`` of shape
``(num_blocks, num_kv_heads, block_size, head_size)``; with ``keys_transposed`` each page of a
KV head stores its keys as ``(head_size, block_size)`` (the ``vec`` layout of vLLM's CPU kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..decode import ring_decode
from ..windows import visible
from .plan import LayerPlan, WindowClass

__all__ = ["Batch", "PagedKV", "windowed_attention"]

#: ``kernel(query (n, G, D), kv_head, query_start_loc, seq_lens, block_table, window) -> (n, G, D)``:
#: causal attention of each request's last queries over its pages, keys ``p - j < window``
#: (``window = -1``: all causal keys), reading KV head ``kv_head`` (``None``: all of the layer's
#: KV heads, the query heads in groups as vLLM orders them).
Kernel = Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

#: Queries per block of a multi-token chunk computed here.
QUERY_BLOCK = 128


@dataclass(frozen=True)
class PagedKV:
    """A layer's paged KV cache, read by KV head, page and slot."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    keys_transposed: bool

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[2]

    def gather(self, kv_head: int | None, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(*blocks.shape, head_size)`` of the slots ``(blocks, offsets)``
        (``kv_head=None``: every KV head, ``(*blocks.shape, num_kv_heads, head_size)``)."""
        keys = self.key_cache if kv_head is None else self.key_cache[:, kv_head : kv_head + 1]
        values = self.value_cache if kv_head is None else self.value_cache[:, kv_head : kv_head + 1]
        if self.keys_transposed:
            nb, kv, bs, d = keys.shape
            keys = keys.as_strided((nb, kv, d, bs), (keys.stride(0), keys.stride(1), bs, 1), keys.storage_offset())
            k = keys[blocks, :, :, offsets]
        else:
            k = keys[blocks, :, offsets]
        v = values[blocks, :, offsets]
        return (k, v) if kv_head is None else (k.squeeze(-2), v.squeeze(-2))

    def pages(self, kv_head: int | None, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages: keys ``(*blocks.shape, head_size, block_size)`` (transposed) and values
        ``(*blocks.shape, block_size, head_size)`` (``kv_head=None``: every KV head, a
        ``num_kv_heads`` axis after the pages')."""
        keys = (self.key_cache if kv_head is None else self.key_cache[:, kv_head])[blocks]
        if self.keys_transposed:
            keys = keys.reshape(*keys.shape[:-2], keys.shape[-1], keys.shape[-2])
        else:
            keys = keys.transpose(-1, -2)
        return keys, (self.value_cache if kv_head is None else self.value_cache[:, kv_head])[blocks]


@dataclass(frozen=True)
class Batch:
    """One step's requests: where their queries start in the token axis, how many, and where."""

    query_start: tuple[int, ...]
    query_len: tuple[int, ...]
    seq_len: tuple[int, ...]
    block_table: torch.Tensor  # (num_requests, max_blocks) int
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # per-step values the layers share

    @classmethod
    def from_metadata(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor) -> Batch:
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        n = len(lens)
        return cls(tuple(starts[:n]), tuple(starts[i + 1] - starts[i] for i in range(n)), tuple(lens), block_table[:n])

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1] + self.query_len[-1] if self.query_len else 0

    def context(self, r: int) -> int:
        """Position of request ``r``'s first new query token."""
        return self.seq_len[r] - self.query_len[r]


def windowed_attention(
    query: torch.Tensor,
    out: torch.Tensor,
    paged: PagedKV,
    batch: Batch,
    plan: LayerPlan,
    scale: float,
    kernel: Kernel | None = None,
    compiled: bool = True,
) -> torch.Tensor:
    """Write into ``out`` (num_tokens, local query heads, D) the attention of every query head
    over its window and the plan's sinks; ``kernel=None`` computes every query here.

    A layer whose heads all have one window runs its kernel part, and its compiled part, in one
    call over all its KV heads (``kv_head=None``); otherwise one call per window class.
    ``compiled=False`` (or an extension that cannot be built) runs this module's PyTorch path.
    """
    sinks = plan.sink_tokens
    uniform = len({cls.window for cls in plan.classes}) == 1
    if kernel is not None:
        if uniform:
            _run_kernel(query, out, batch, None, slice(None), plan.classes[0].window, sinks, kernel)
        else:
            for cls in plan.classes:
                _run_kernel(query, out, batch, cls.kv_head, _heads_index(cls), cls.window, sinks, kernel)
    if compiled and ring_decode.load() is not None:
        if uniform:
            _run_compiled(query, out, paged, batch, None, slice(None), plan.windows, sinks, scale, kernel is not None)
        else:
            for cls in plan.classes:
                windows = (cls.window,) * len(cls.q_heads)
                _run_compiled(query, out, paged, batch, cls.kv_head, _heads_index(cls), windows, sinks, scale,
                              kernel is not None)
        return out
    for cls in plan.classes:
        _, own = _split(batch, cls.window, sinks, kernel is not None)
        if not own:
            continue
        heads = _heads_index(cls)
        singles = tuple((r, first) for r, first in own if batch.query_len[r] - first == 1)
        if singles:
            _run_singles(query, out, paged, batch, cls.kv_head, heads, cls.window, singles, sinks, scale)
        for r, first in own:
            if batch.query_len[r] - first > 1:
                _run_chunk(query, out, paged, batch, cls, heads, r, first, sinks, scale)
    return out


def _heads_index(cls: WindowClass) -> slice | list[int]:
    heads = cls.q_heads
    if heads == tuple(range(heads[0], heads[0] + len(heads))):
        return slice(heads[0], heads[0] + len(heads))
    return list(heads)


def _split(batch: Batch, window: int, sinks: int, with_kernel: bool):
    """``(kernel_parts, own)``: per request, the first ``n`` queries the kernel runs exactly (no
    sink outside their window) and the offset of the first query computed here (memoised per step)."""
    key = ("split", window, sinks, with_kernel)
    hit = batch.memo.get(key)
    if hit is not None:
        return hit
    kernel_parts, own = [], []
    for r, q_len in enumerate(batch.query_len):
        if q_len == 0:
            continue
        if not with_kernel:
            first = 0
        elif sinks:
            first = min(max(window - batch.context(r), 0), q_len)
        else:
            first = q_len
        if first:
            kernel_parts.append((r, first))
        if first < q_len:
            own.append((r, first))
    batch.memo[key] = (tuple(kernel_parts), tuple(own))
    return batch.memo[key]


def _kernel_inputs(batch: Batch, window: int, sinks: int):
    """The token index (``None``: every token), query starts, sequence lengths and block table of
    the kernel's part, and the window it runs (``-1``: no request reaches it); memoised per step."""
    key = ("kernel", window, sinks)
    hit = batch.memo.get(key)
    if hit is not None:
        return hit
    parts, _ = _split(batch, window, sinks, True)
    run_window = window if window < max(batch.seq_len) else -1
    if not parts:
        result = None
    elif len(parts) == len(batch.query_len) and all(n == batch.query_len[r] for r, n in parts):
        starts = torch.tensor((0,) + tuple(_cumsum(batch.query_len)), dtype=torch.int32)
        result = (None, starts, torch.tensor(batch.seq_len, dtype=torch.int32), batch.block_table, run_window)
    else:
        rows = [r for r, _ in parts]
        index = torch.cat([torch.arange(batch.query_start[r], batch.query_start[r] + n) for r, n in parts])
        starts = torch.tensor((0,) + tuple(_cumsum([n for _, n in parts])), dtype=torch.int32)
        seq_lens = torch.tensor([batch.context(r) + n for r, n in parts], dtype=torch.int32)
        result = (index, starts, seq_lens, batch.block_table[rows].contiguous(), run_window)
    batch.memo[key] = result
    return result


def _run_kernel(query, out, batch, kv_head, heads, window, sinks, kernel) -> None:
    """The kernel on each request's first queries that need no sink outside their window."""
    inputs = _kernel_inputs(batch, window, sinks)
    if inputs is None:
        return
    index, starts, seq_lens, table, run_window = inputs
    if index is None:
        n = batch.num_tokens
        q = query[:n] if heads == slice(None) else query[:n, heads].contiguous()
        out[:n, heads] = kernel(q, kv_head, starts, seq_lens, table, run_window)
        return
    q = query[index][:, heads].contiguous()
    _scatter(out, index, heads, kernel(q, kv_head, starts, seq_lens, table, run_window))


def _cumsum(values) -> list[int]:
    total, acc = 0, []
    for v in values:
        total += v
        acc.append(total)
    return acc


def _scatter(out: torch.Tensor, index: torch.Tensor, heads, res: torch.Tensor) -> None:
    if isinstance(heads, slice):
        out[index, heads] = res
    else:
        out[index[:, None], torch.tensor(heads)[None, :]] = res


def _run_compiled(query, out, paged, batch, kv_head, heads, windows, sinks, scale, with_kernel) -> None:
    """The queries the kernel does not run, in one call of the compiled paged attention
    (``kv_head=None``: all of the layer's KV heads and query heads, ``windows`` one per head).
    When those queries are one run of tokens, the call reads and writes views of ``query`` and
    ``out``; otherwise it reads a copy and its result is scattered."""
    inputs = _compiled_inputs(batch, min(windows), sinks, with_kernel)
    if inputs is None:
        return
    tokens, requests, positions = inputs
    kv = slice(None) if kv_head is None else slice(kv_head, kv_head + 1)
    run = isinstance(tokens, slice) and isinstance(heads, slice)
    q = query[tokens, heads] if run else query[tokens][:, heads]
    res = ring_decode.paged_attention(
        q, paged.key_cache[:, kv], paged.value_cache[:, kv], paged.keys_transposed, requests, positions,
        batch.block_table, torch.tensor(windows, dtype=torch.int64), sinks, scale,
        out=out[tokens, heads] if run else None,
    )
    if not run:
        _scatter(out, torch.arange(out.shape[0])[tokens] if isinstance(tokens, slice) else tokens, heads, res)


def _compiled_inputs(batch: Batch, window: int, sinks: int, with_kernel: bool):
    """The tokens (a slice when they are one run, else an index), request and position of each
    query the compiled call runs, or ``None`` when it runs none; memoised per step."""
    key = ("compiled", window, sinks, with_kernel)
    if key in batch.memo:
        return batch.memo[key]
    _, own = _split(batch, window, sinks, with_kernel)
    result = None
    if own:
        spans = [(batch.query_start[r] + first, batch.query_start[r] + batch.query_len[r]) for r, first in own]
        rows = torch.cat([torch.full((b - a,), r, dtype=torch.int64) for (r, _), (a, b) in zip(own, spans)])
        positions = torch.cat([torch.arange(batch.context(r) + first, batch.seq_len[r]) for r, first in own])
        if all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)):
            tokens = slice(spans[0][0], spans[-1][1])
        else:
            tokens = torch.cat([torch.arange(a, b) for a, b in spans])
        result = (tokens, rows, positions)
    batch.memo[key] = result
    return result


def _run_singles(query, out, paged, batch, kv_head, heads, window, singles, sinks, scale) -> None:
    """One query per request (decode steps), batched: the whole pages that hold each window (one
    copy per page) and the sinks outside the window, in one softmax (``kv_head=None``: all of
    the layer's KV heads and their query heads at once)."""
    tokens, pages, sink_blocks, sink_offsets, masked = _single_slots(batch, singles, window, sinks, paged.block_size)
    keys, values = paged.pages(kv_head, pages)  # keys transposed (R, P, [K,] D, bs), values (R, P, [K,] bs, D)
    if kv_head is not None:
        keys, values = keys.unsqueeze(2), values.unsqueeze(2)
    q = query[tokens][:, heads]  # (R, H, D)
    r, h, d = q.shape
    kv = keys.shape[2]
    groups = q.view(r, 1, kv, h // kv, d)
    scores = torch.matmul(groups, keys)  # (R, P, K, G, bs)
    scores = scores.permute(0, 2, 3, 1, 4).reshape(r * kv, h // kv, -1)
    values = values.permute(0, 2, 1, 3, 4).reshape(r * kv, -1, d)
    if sinks:
        sink_k, sink_v = paged.gather(kv_head, sink_blocks, sink_offsets)  # (R, S, [K,] D)
        if kv_head is not None:
            sink_k, sink_v = sink_k.unsqueeze(2), sink_v.unsqueeze(2)
        sink_k = sink_k.permute(0, 2, 1, 3).reshape(r * kv, sinks, d)
        sink_v = sink_v.permute(0, 2, 1, 3).reshape(r * kv, sinks, d)
        flat = groups.reshape(r * kv, h // kv, d)
        scores = torch.cat([torch.bmm(flat, sink_k.transpose(1, 2)), scores], dim=2)
    scores.mul_(scale).masked_fill_(masked.repeat_interleave(kv, dim=0), float("-inf"))
    probs = scores.softmax(dim=-1)
    res = torch.bmm(probs[:, :, sinks:], values)  # the values are not copied next to the sinks'
    if sinks:
        res += torch.bmm(probs[:, :, :sinks], sink_v)
    _scatter(out, tokens, heads, res.view(r, h, d))


def _single_slots(batch, singles, window, sinks, bs):
    """For one-query requests: token index, the pages of each window (R, P), the sinks' pages and
    slots, and which keys are masked out (R, 1, S + P * bs), by :func:`_read`; memoised per step."""
    key = ("single", singles, window, sinks)
    hit = batch.memo.get(key)
    if hit is not None:
        return hit
    rows = torch.tensor([r for r, _ in singles])
    tokens = torch.tensor([batch.query_start[r] + first for r, first in singles])
    pos = torch.tensor([batch.context(r) + first for r, first in singles])
    first_page = (pos - window + 1).clamp(min=0) // bs
    last_page = pos // bs
    count = int((last_page - first_page).max()) + 1
    index = first_page[:, None] + torch.arange(count)[None, :]  # (R, P)
    # Rows with fewer pages repeat their last; the positions of those slots lie after the query's.
    pages = batch.block_table[rows[:, None], torch.minimum(index, last_page[:, None])].long()
    key_pos = (index[:, :, None] * bs + torch.arange(bs)).reshape(len(singles), -1)  # (R, P * bs)
    sink_pos = torch.arange(sinks).expand(len(singles), sinks)
    valid = _read(pos[:, None], sink_pos, key_pos, (first_page * bs)[:, None], window, sinks)
    sink_blocks = batch.block_table[rows[:, None], sink_pos // bs].long()
    batch.memo[key] = (tokens, pages, sink_blocks, sink_pos % bs, ~valid[:, None, :])
    return batch.memo[key]


def _read(q_pos, sink_pos, key_pos, first_key, window, sinks) -> torch.Tensor:
    """Which (query, key column) pairs a softmax reads, the columns being the sink slots at
    ``sink_pos`` followed by the gathered keys at ``key_pos`` (the gathered keys run from
    ``first_key`` on): the pairs :func:`aah.windows.visible` allows, each key read once, a sink
    from its own slot only when it lies before the gathered keys."""
    sink_slot = (sink_pos < first_key).expand(*key_pos.shape[:-1], -1)
    reader = torch.cat([sink_slot, torch.ones_like(key_pos, dtype=torch.bool)], dim=-1)
    return visible(q_pos, torch.cat([sink_pos, key_pos], dim=-1), window, sinks) & reader


def _run_chunk(query, out, paged, batch, cls, heads, r, first, sinks, scale) -> None:
    """Queries ``first..`` of request ``r``, in blocks over the keys their windows span and the sinks."""
    window = cls.window
    ctx = batch.context(r)
    p0, p1 = ctx + first, batch.seq_len[r]
    lo = max(0, p0 - window + 1)
    bs = paged.block_size
    row = batch.block_table[r]
    keys, values = paged.pages(cls.kv_head, row[lo // bs : (p1 - 1) // bs + 1].long())
    skip = lo % bs
    k = keys.transpose(1, 2).reshape(-1, keys.shape[1])[skip : skip + p1 - lo]  # (L, D)
    v = values.reshape(-1, values.shape[-1])[skip : skip + p1 - lo]
    use_sinks = sinks > 0 and p1 - 1 - window >= 0
    if use_sinks:
        sink_pos = torch.arange(sinks)
        sk, sv = paged.gather(cls.kv_head, row[sink_pos // bs].long(), sink_pos % bs)
    t0 = batch.query_start[r] + first
    for a in range(p0, p1, QUERY_BLOCK):
        b = min(a + QUERY_BLOCK, p1)
        q = query[t0 + a - p0 : t0 + b - p0, heads].transpose(0, 1)  # (G, n, D)
        sink_part = (sk, sv) if use_sinks and b - 1 - window >= 0 else None
        if window > b - a:
            res = _block_by_parts(q, k, v, lo, a, b, window, sink_part, scale)
            out[t0 + a - p0 : t0 + b - p0, heads] = res.transpose(0, 1)
            continue
        start = max(lo, a - window + 1)
        kb, vb = k[start - lo : b - lo], v[start - lo : b - lo]
        spos = torch.arange(0 if sink_part is None else sinks)
        if sink_part is not None:
            kb, vb = torch.cat([sk, kb]), torch.cat([sv, vb])
        mask = _read(torch.arange(a, b)[:, None], spos[None, :], torch.arange(start, b)[None, :], start, window, sinks)
        res = F.scaled_dot_product_attention(q[None], kb[None, None], vb[None, None], attn_mask=mask, scale=scale, enable_gqa=True)
        out[t0 + a - p0 : t0 + b - p0, heads] = res[0].transpose(0, 1)


def _block_by_parts(q, k, v, lo, a, b, window, sinks, scale) -> torch.Tensor:
    """Queries at positions ``[a, b)`` (``q``: (G, n, D)) with ``window > b - a``, from the keys
    ``k, v`` at positions ``lo..``: the keys every query of the block sees, ``[b - W, a]``, in one
    unmasked softmax whose log-sum-exp is kept; the two triangles at the block's edges
    (``[a - W + 1, b - W)`` and ``(a, b)``) and the sinks outside the windows in one small masked
    softmax; the two joined exactly by their log-sum-exps."""
    g, n, d = q.shape
    flat = q.reshape(1, 1, g * n, d)
    inner_lo = max(b - window, 0)
    inner_scores = (flat[0, 0] @ k[inner_lo - lo : a + 1 - lo].T).mul_(scale)  # (G*n, keys)
    inner_lse = torch.logsumexp(inner_scores, dim=-1)
    inner_out = inner_scores.sub_(inner_lse[:, None]).exp_() @ v[inner_lo - lo : a + 1 - lo]
    edge_lo = max(a - window + 1, 0)
    kpos = torch.cat([torch.arange(edge_lo, inner_lo), torch.arange(a + 1, b)])
    ek = torch.cat([k[edge_lo - lo : inner_lo - lo], k[a + 1 - lo : b - lo]])
    ev = torch.cat([v[edge_lo - lo : inner_lo - lo], v[a + 1 - lo : b - lo]])
    spos = torch.arange(0 if sinks is None else sinks[0].shape[0])
    if sinks is not None:
        ek, ev = torch.cat([sinks[0], ek]), torch.cat([sinks[1], ev])
    mask = _read(torch.arange(a, b)[:, None], spos[None, :], kpos[None, :], edge_lo, window, spos.numel())
    if ek.shape[0] == 0:
        return inner_out.reshape(g, n, d)
    scores = (flat[0, 0] @ ek.T).mul_(scale).view(g, n, -1)
    scores.masked_fill_(~mask[None], float("-inf"))
    edge_lse = torch.logsumexp(scores, dim=-1).reshape(g * n)
    top = torch.maximum(inner_lse, edge_lse)
    w_inner = (inner_lse - top).exp_()
    w_edge = (edge_lse - top).exp_()  # 0 where a query sees no edge key or sink
    probs = (scores.reshape(g * n, -1) - torch.where(edge_lse.isfinite(), edge_lse, 0.0)[:, None]).exp_()
    edge_out = probs @ ev
    res = (inner_out * w_inner[:, None] + edge_out * w_edge[:, None]) / (w_inner + w_edge)[:, None]
    return res.reshape(g, n, d)
