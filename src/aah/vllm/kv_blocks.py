"""Which KV blocks a request holds per layer when vLLM's memory follows the windows (no vLLM import).

A layer whose heads read at most ``W`` keys back (its largest window, after the layer's own
sliding window; :func:`aah.windows.layer_rule`) and the first ``S`` tokens (sinks) needs, for a
query at position ``p``, the keys ``(p - W, p]`` and ``[0, S)``. vLLM's pages hold ``block_size``
consecutive tokens of every KV head of a layer, so the layer keeps, per request:

* the sink blocks ``[0, ceil(S / block_size))``, always;
* the blocks from the one holding key ``c - W + 1`` on, where ``c`` is the number of tokens the
  request has fully computed (the next query sits at ``c`` or later);

and frees the blocks in between as the request advances (:func:`freed_blocks`). This module is
the arithmetic; :mod:`aah.vllm.kv_memory` puts it into vLLM's KV cache manager.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..windows import layer_rule

__all__ = [
    "admission_blocks", "cdiv", "frees_blocks", "freed_blocks", "layer_reach", "max_concurrency",
    "read_blocks", "sink_blocks", "skipped_tokens", "sliding_admission_blocks",
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layer_reach(windows: Sequence[int], sink_tokens: int, layer_window: int | None) -> tuple[int, int]:
    """``(W, S)``: the largest window of a layer (all its query heads, every tensor-parallel
    rank's) and the sinks it keeps, after its own sliding window (``None`` or ``<= 0``: none)."""
    local, sinks = layer_rule([int(w) for w in windows], int(sink_tokens), layer_window)
    return max(local), sinks


def sink_blocks(sinks: int, block_size: int) -> int:
    """The blocks holding the sink tokens, kept for the request's whole life."""
    return cdiv(max(int(sinks), 0), block_size)


def skipped_tokens(computed: int, window: int) -> int:
    """Tokens no query from position ``computed`` on reads through its window (vLLM's
    sliding-window rule: ``computed - W + 1``)."""
    return max(0, computed - window + 1)


def freed_blocks(computed: int, window: int, sinks: int, block_size: int) -> range:
    """The blocks of a request freed once ``computed`` tokens are computed: whole blocks before
    the window of the next query, except the sink blocks."""
    first = sink_blocks(sinks, block_size)
    return range(first, max(first, skipped_tokens(computed, window) // block_size))


def read_blocks(position: int, window: int, sinks: int, block_size: int) -> set[int]:
    """The blocks a query at ``position`` reads: its window's keys ``(p - W, p]`` and the sinks
    ``[0, min(S, p + 1))``."""
    window_blocks = range(max(0, position - window + 1) // block_size, position // block_size + 1)
    return set(window_blocks) | set(range(cdiv(min(sinks, position + 1), block_size)))


def frees_blocks(window: int, sinks: int, block_size: int, max_model_len: int) -> bool:
    """Whether a request of up to ``max_model_len`` tokens ever frees a block of this layer (the
    last query, at ``max_model_len - 1``, skips ``max_model_len - W`` tokens)."""
    return len(freed_blocks(max_model_len - 1, window, sinks, block_size)) > 0


def sliding_admission_blocks(window: int, block_size: int, in_flight_tokens: int, max_model_len: int) -> int:
    """vLLM 0.32's bound on the blocks a sliding-window layer holds per request
    (``SlidingWindowSpec.max_admission_blocks_per_request``): the window's ``W - 1`` computed
    tokens and the tokens in flight, ``+ 1`` for a window that starts inside a block."""
    return cdiv(min(window - 1 + in_flight_tokens, max_model_len), block_size) + 1


def admission_blocks(window: int, sinks: int, block_size: int, in_flight_tokens: int, max_model_len: int) -> int:
    """The same bound with the sink blocks added, never above what the layer's full attention
    would hold (all ``ceil(max_model_len / block_size)`` blocks) unless the window alone does."""
    windowed = sliding_admission_blocks(window, block_size, in_flight_tokens, max_model_len)
    return with_sinks(windowed, sink_blocks(sinks, block_size), cdiv(max_model_len, block_size))


def with_sinks(window_blocks: int, sink_block_count: int, full_blocks: int) -> int:
    """``window_blocks + sink_block_count``, capped at ``max(window_blocks, full_blocks)``."""
    return min(window_blocks + sink_block_count, max(window_blocks, full_blocks))


def max_concurrency(memory_bytes: int, layer_page_bytes: int, groups: Sequence[tuple[int, int]]) -> float:
    """vLLM's "maximum concurrency" for a KV cache of ``memory_bytes`` split into groups of
    ``(layers, blocks per request)``: one block of the shared pool holds a page of every layer of
    one group (``layer_page_bytes`` each), so the pool has ``memory // (max layers * page)``
    blocks, and a request of ``max_model_len`` tokens takes its blocks from every group."""
    per_block = max(layers for layers, _ in groups) * layer_page_bytes
    return (memory_bytes // per_block) / sum(blocks for _, blocks in groups)
