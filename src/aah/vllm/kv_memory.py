"""vLLM's KV memory following the windows: a layer's blocks outside its sinks and largest window are freed.

vLLM asks every attention layer for its KV cache spec (``Attention.get_kv_cache_spec``) and gives
each group of layers with one spec its own block table, managed by the spec's
``SingleTypeKVCacheManager`` (``vllm.v1.core.single_type_kv_cache_manager``). :func:`install` wraps
``Attention.get_kv_cache_spec``: when a windows file is served and vLLM's hybrid KV cache manager is
on, a layer whose largest window ``W`` (with its ``S`` sinks) lets a request of ``max_model_len``
tokens free a block reports

* :class:`SinkWindowSpec` (a ``SlidingWindowSpec`` with ``sink_tokens``), managed by
  :class:`SinkWindowManager`: vLLM's sliding-window manager, which also keeps the first
  ``ceil(S / block_size)`` blocks of every request (they are never freed, a prefix-cache hit needs
  them cached too, and the per-request reservation counts them);
* or, in a layer without sinks (none in the file, or a layer with its own sliding window), vLLM's
  own ``SlidingWindowSpec`` with the layer's largest window.

Other layers (their largest window reaches the whole context) keep vLLM's full-attention spec, and
engines without a windows file are unchanged. The arithmetic is :mod:`aah.vllm.kv_blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from vllm.v1.core.kv_cache_utils import resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from .kv_blocks import cdiv, frees_blocks, layer_reach, sink_blocks, with_sinks

__all__ = ["SinkWindowManager", "SinkWindowSpec", "memory_spec", "register_spec"]


@dataclass(frozen=True, kw_only=True)
class SinkWindowSpec(SlidingWindowSpec):
    """A sliding window of ``sliding_window`` keys that also keeps the first ``sink_tokens`` tokens."""

    sink_tokens: int = 0

    @property
    def sink_blocks(self) -> int:
        return sink_blocks(self.sink_tokens, self.block_size)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        windowed = super().max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
        return with_sinks(windowed, self.sink_blocks, cdiv(max_model_len, self.block_size))

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        return all(
            isinstance(spec, SinkWindowSpec) and spec.sliding_window == self.sliding_window
            and spec.sink_tokens == self.sink_tokens
            for spec in kv_cache_specs.values()
        )


class SinkWindowManager(SlidingWindowManager):
    """vLLM's sliding-window manager, keeping each request's sink blocks.

    * freeing (``remove_skipped_blocks``): the blocks before the window of the next query, from
      the first block after the sinks on (they become vLLM's null block in the request's table);
    * a prefix-cache hit (``find_longest_cache_hit``): vLLM's sliding-window hit (the blocks of
      the last window, nulls before) whose sink blocks are cached too, else a shorter one;
    * a new request's hit blocks (``add_local_computed_blocks``): the sink blocks and the blocks
      of the window are taken, the ones between are nulls;
    * caching: every full block (``reachable_block_mask`` is dense), so sink blocks stay found.
    """

    def __init__(self, kv_cache_spec: SinkWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sink_blocks = kv_cache_spec.sink_blocks

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        del num_prompt_tokens
        skipped = self.get_num_skipped_tokens(processed_computed_tokens) // self.block_size
        if skipped <= self.sink_blocks or request_id not in self.req_to_blocks:
            return
        self._remove_blocks_in_range(request_id, self.sink_blocks, skipped)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        count = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_local_computed_tokens,
            num_tokens_main_model, apply_admission_cap=apply_admission_cap, prefill_end=prefill_end,
        )
        if request_id in self.num_cached_block:
            return count
        # the sink blocks of a hit are taken too (vLLM counts only the window's evictable ones)
        skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        return count + self._get_num_evictable_blocks(new_computed_blocks[: min(self.sink_blocks, skipped)])

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence, num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        skipped = self.get_num_skipped_tokens(num_local_computed_tokens + num_external_computed_tokens)
        skipped_blocks = skipped // self.block_size
        kept = min(self.sink_blocks, skipped_blocks)
        if kept == 0:
            super().add_local_computed_blocks(request_id, new_computed_blocks, num_local_computed_tokens,
                                              num_external_computed_tokens)
            return
        req_blocks = self.req_to_blocks[request_id]
        assert len(req_blocks) == 0
        sinks = list(new_computed_blocks[:kept])
        if len(sinks) < kept or any(block.is_null for block in sinks):
            raise RuntimeError("aah.vllm: a prefix-cache hit without its sink blocks")
        window = list(new_computed_blocks[skipped_blocks:])
        if self.enable_caching:
            self.block_pool.touch(sinks)
            self.block_pool.touch(window)
        req_blocks.extend(sinks)
        req_blocks.extend([self._null_block] * (skipped_blocks - kept))
        req_blocks.extend(window)
        self.num_cached_block[request_id] = len(req_blocks)
        if self._has_partial_local_hit(window, num_local_computed_tokens):
            block_idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (block_idx, window[-1])
            self.num_cached_block[request_id] = block_idx

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        sinks = sink_blocks(getattr(kv_cache_spec, "sink_tokens", 0), kv_cache_spec.block_size)
        hashes = resolve_block_hashes(
            block_hashes, block_pool.hash_block_size, kv_cache_spec.block_size,
            supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup, alignment_tokens=alignment_tokens,
        )
        while True:
            computed, length = super().find_longest_cache_hit(
                block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block,
                alignment_tokens, dcp_world_size, pcp_world_size,
            )
            missing = None
            for i in range(min(sinks, len(computed[0]))):
                if not computed[0][i].is_null:
                    continue
                cached = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
                if cached is None:
                    missing = i
                    break
                for blocks, block in zip(computed, cached):
                    blocks[i] = block
            if missing is None:
                return computed, length
            max_length = missing * kv_cache_spec.block_size  # below the hit: the loop ends

    @classmethod
    def reachable_block_mask(cls, *args, **kwargs):
        return None


def register_spec() -> None:
    """Register :class:`SinkWindowSpec` with its manager (vLLM's built-in specs first: vLLM
    registers those only while its registry is empty)."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(SinkWindowSpec, SinkWindowManager, uniform_type_base_spec=SinkWindowSpec)


register_spec()  # on import: the engine core unpickles specs from worker processes


def memory_spec(spec: KVCacheSpec, windows: Sequence[int], sink_tokens: int, max_model_len: int) -> KVCacheSpec:
    """The spec a layer reports: ``spec`` (vLLM's) with its memory following the layer's windows
    (``windows``: the layer's row of the windows file, every query head)."""
    if type(spec) is FullAttentionSpec:
        if spec.sliding_window is not None or spec.attention_chunk_size is not None or spec.non_causal:
            return spec
        layer_window = None
    elif type(spec) is SlidingWindowSpec:
        layer_window = spec.sliding_window
    else:
        return spec
    window, sinks = layer_reach(windows, sink_tokens, layer_window)
    if not frees_blocks(window, sinks, spec.block_size, max_model_len):
        return spec
    if layer_window is not None:
        return replace(spec, sliding_window=window) if window < layer_window else spec
    fields = dict(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                  head_size_v=spec.head_size_v, dtype=spec.dtype, kv_quant_mode=spec.kv_quant_mode,
                  page_size_padded=spec.page_size_padded, sliding_window=window)
    if sinks == 0:
        return SlidingWindowSpec(**fields)
    return SinkWindowSpec(**fields, sink_tokens=sinks)
