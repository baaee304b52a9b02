"""vLLM's CPU attention backend, with each head's window and the windows file's sink tokens.

:func:`aah.vllm.register` puts :class:`AAHCPUAttentionBackend` in place of vLLM's ``CPU_ATTN``
backend. Without a windows file it runs vLLM's own attention unchanged. With one, every layer
writes its keys and values into the paged cache as vLLM does, then runs
:func:`aah.vllm.paged.windowed_attention`: per window class (the query heads that read one KV
head with one window), vLLM's CPU kernel with that window as its sliding window for the queries
that need no sink outside their window, and the exact sink-and-window softmax of
:mod:`aah.vllm.paged` for the others.

Set-ups it cannot run exactly are refused, with the reason: the windows file and the engine's
settings (another platform than CPU, a quantised KV cache, a page layout other than the one
checked at start-up) in vLLM's front-end process before the engine starts
(:mod:`aah.vllm.startup`); ALiBi, logit soft-capping, learned attention sinks, non-decoder
attention and KV sharing across layers, which only the model's layers tell, when the engine
builds them.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm import _custom_ops as ops
from vllm import envs

from .page_layout import keys_transposed
from .paged import Batch, PagedKV, windowed_attention
from .plan import LayerPlan, plan_layer
from .startup import WindowsSource, check_windows_file, engine_windows_source

__all__ = [
    "AAHCPUAttentionBackend", "AAHCPUAttentionImpl", "AAHCPUAttentionMetadataBuilder", "model_kv_heads_and_rank",
    "refuse_settings", "served_layer_plan", "served_windows",
]


class ServedWindows:
    """The windows file the engine serves: the (layers, query heads) windows and the sinks."""

    def __init__(self, path: Path, windows: torch.Tensor, sink_tokens: int) -> None:
        self.path, self.windows, self.sink_tokens = path, windows, sink_tokens


@functools.lru_cache(maxsize=1)
def _load(source: WindowsSource, config_key: int) -> ServedWindows:
    del config_key  # part of the cache key only
    hf_config = get_current_vllm_config().model_config.hf_config
    windows, sinks = check_windows_file(source, hf_config)  # checked in the front-end already
    return ServedWindows(source.path, windows, sinks)


def served_windows() -> ServedWindows | None:
    """The windows of the model being served (``None``: serve it unchanged)."""
    model_config = get_current_vllm_config().model_config
    if model_config is None:
        return None
    source = engine_windows_source(model_config)
    if source is None:
        return None
    return _load(source, id(model_config.hf_config))


def refuse_settings(served: ServedWindows, refusals: dict[str, tuple[bool, str]]) -> None:
    """Stop with one line naming the first setting in ``refusals`` (``name: (bad, what)``) that is
    ``bad``, for a layer that serves the windows of ``served``."""
    for name, (bad, what) in refusals.items():
        if bad:
            raise ValueError(f"aah.vllm: AAH windows ({served.path}) cannot run with {name}: {what}")


def model_kv_heads_and_rank() -> tuple[int, int, int]:
    """The model's KV heads over all ranks, the tensor-parallel size and this worker's rank."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    hf_config = get_current_vllm_config().model_config.hf_config
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return kv_heads, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()


def served_layer_plan(served: ServedWindows, layer, *, num_heads: int, kv_heads: int, tp_size: int, rank: int,
                      layer_window: int | None) -> LayerPlan:
    """The plan of ``layer`` (windows of this rank's ``num_heads`` query heads, sinks; its own
    sliding window ``layer_window`` or ``None``), with one line if the file does not fit it."""
    from vllm.model_executor.models.utils import extract_layer_index

    index = extract_layer_index(layer.layer_name)
    if not 0 <= index < served.windows.shape[0]:
        raise ValueError(f"aah.vllm: layer {layer.layer_name} has index {index}; the windows file has "
                         f"{served.windows.shape[0]} layers")
    plan = plan_layer(served.windows[index], num_kv_heads=kv_heads, sink_tokens=served.sink_tokens,
                      layer_window=layer_window, tp_size=tp_size, rank=rank)
    if len(plan.windows) != num_heads:
        raise ValueError(f"aah.vllm: layer {layer.layer_name} runs {num_heads} query heads on this rank, "
                         f"the windows file gives it {len(plan.windows)}")
    return plan


class AAHCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder; with windows, it checks the cache layout and dtype at start-up."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if served_windows() is None:
            return
        if self.kv_cache_dtype not in ("auto", None):
            raise ValueError(
                f"aah.vllm: kv_cache_dtype={self.kv_cache_dtype!r} is not supported with AAH windows; "
                "use kv_cache_dtype='auto'"
            )
        keys_transposed(self.isa, self.block_size, self.head_dim, self.dtype)


class AAHCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with the windows file's windows and sinks when one is served."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.served = served_windows()
        self._plan: LayerPlan | None = None
        if self.served is None:
            return
        refuse_settings(self.served, {
            "attention type": (attn_type != AttentionType.DECODER, f"{attn_type} (only decoder attention)"),
            "ALiBi slopes": (alibi_slopes is not None, "set"),
            "logit soft-capping": (bool(logits_soft_cap), f"{logits_soft_cap}"),
            "learned attention sinks": (sinks is not None, "set"),
            "KV sharing across layers": (kv_sharing_target_layer_name is not None, f"{kv_sharing_target_layer_name}"),
            "KV cache dtype": (self.is_fp8_kv_cache, f"{kv_cache_dtype} (use 'auto')"),
        })
        self._global_kv_heads, *self._tp = model_kv_heads_and_rank()

    def _layer_plan(self, layer) -> LayerPlan:
        if self._plan is None:
            self._plan = served_layer_plan(
                self.served, layer, num_heads=self.num_heads, kv_heads=self._global_kv_heads,
                tp_size=self._tp[0], rank=self._tp[1],
                layer_window=self.sliding_window if self.sliding_window > 0 else None)
        return self._plan

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if self.served is None or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("aah.vllm: fused output quantization is not supported")
        if attn_metadata.causal is not True or attn_metadata.dynamic_causal is not None:
            raise NotImplementedError("aah.vllm: AAH windows run causal decoder attention only")
        plan = self._layer_plan(layer)
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        paged = PagedKV(key_cache, value_cache, keys_transposed(layer.isa, block_size, self.head_size, key_cache.dtype))
        batch = _shared_batch(attn_metadata)
        n = attn_metadata.num_actual_tokens
        out = output[:n].view(n, self.num_heads, self.head_size)
        q = query[:n].view(n, self.num_heads, self.head_size)
        windowed_attention(q, out, paged, batch, plan, self.scale, kernel=self._kernel(layer, key_cache, value_cache))
        return output

    def _kernel(self, layer, key_cache, value_cache):
        def kernel(q, kv_head, starts, seq_lens, table, window):
            kv_heads = self.num_kv_heads if kv_head is None else 1
            key = (id(starts), q.shape[1], kv_heads, window)
            metadata = _METADATA.get(key)
            if metadata is None:
                metadata = _scheduler_metadata(q.shape[1], kv_heads, self.head_size, q.dtype, starts, seq_lens,
                                               window, layer.isa, self.kv_cache_dtype)
                _METADATA[key] = metadata
            out = torch.empty_like(q)
            heads = slice(None) if kv_head is None else slice(kv_head, kv_head + 1)
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=key_cache[:, heads], value_cache=value_cache[:, heads],
                output=out, query_start_loc=starts, seq_lens=seq_lens, scale=self.scale, causal=True,
                alibi_slopes=None, sliding_window=window, block_table=table, softcap=0,
                scheduler_metadata=metadata, s_aux=None, k_scale=layer._k_scale_float,
                v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype,
            )
            return out

        return kernel


_BATCH_CACHE: dict = {}
#: The kernel's scheduler metadata of this step, by (query starts, heads, KV heads, window);
#: the starts tensors live in the step's Batches, so their ids are stable until they are replaced.
_METADATA: dict = {}
#: Batches kept at once: a step has one metadata object per KV cache group (several when the
#: layers' KV memory follows their windows, :mod:`aah.vllm.kv_memory`).
_MAX_BATCHES = 64


def _shared_batch(attn_metadata) -> Batch:
    """One :class:`Batch` per step's metadata, shared by the layers of its KV cache group (they
    get the same object; the cache holds it, so its id is not reused while it is cached)."""
    key = id(attn_metadata)
    hit = _BATCH_CACHE.get(key)
    if hit is not None and hit[0] is attn_metadata:
        return hit[1]
    batch = Batch.from_metadata(attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.block_table)
    if len(_BATCH_CACHE) >= _MAX_BATCHES:
        _BATCH_CACHE.clear()
        _METADATA.clear()
    _BATCH_CACHE[key] = (attn_metadata, batch)
    return batch


def _scheduler_metadata(heads, kv_heads, head_size, dtype, starts, seq_lens, window, isa, kv_cache_dtype):
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_size, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=starts, causal=True, sliding_window_size=window, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=kv_cache_dtype,
    )


class AAHCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with AAH windows (see the module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[AAHCPUAttentionImpl]:
        return AAHCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AAHCPUAttentionMetadataBuilder]:
        return AAHCPUAttentionMetadataBuilder
