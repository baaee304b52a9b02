"""The plugin's CUDA path: vLLM's FlexAttention backend with each query head's window and the sinks.

**Written and tested on CPU only; it has not been run on a GPU.** vLLM's CUDA build was not
available when it was written, so the classes below have never served a model on CUDA.

On vLLM's ``cuda`` platform :func:`aah.vllm.register` puts :class:`AAHFlexAttentionBackend` in
place of vLLM's ``FLEX_ATTENTION`` backend, and :mod:`aah.vllm.startup` refuses a windows file
there unless that backend is the one chosen (``--attention-backend FLEX_ATTENTION``). Without a
windows file the classes run vLLM's FlexAttention unchanged. With one, each layer's mask is the
project's one window rule (:func:`aah.windows.visible`): a query at position ``p`` of head ``h``
reads the keys ``(p - W_h, p]`` and the sink keys ``[0, S)``, never a key after ``p``.

The pieces, each usable without vLLM (torch only):

* :func:`window_mask_mod`: the rule as a FlexAttention ``mask_mod`` on logical positions, the
  window looked up by query head (GQA: ``h`` is the query head);
* :func:`paged_mask_mod`: a logical ``mask_mod`` moved onto vLLM's layout: rows are the step's
  packed query tokens, columns the slots of the flattened paged cache; a slot is mapped back to
  its request's logical key position through the inverse block table, and slots of no page of
  the request, or past its length, are masked;
* :func:`window_pages_hint`: which cache pages a block of queries may read (its window and the
  sink pages), so that vLLM's block mask leaves the others out;
* :func:`layer_block_mask`: the step's block mask (the pages per block of queries, shared by the
  layers of a KV cache group) with one layer's ``mask_mod``;
* :func:`paged_flex_attention`: FlexAttention over vLLM's cache tensor.

With vLLM importable, the classes:

* :class:`AAHFlexAttentionImpl` looks up its layer's windows as the CPU backend does
  (:func:`aah.vllm.backend.served_windows`, :func:`aah.vllm.plan.plan_layer`, the same
  tensor-parallel slice) and, per step, runs :func:`paged_flex_attention` with its own mask on
  the group's block mask;
* :class:`AAHFlexAttentionMetadataBuilder` prepares every layer of its group when it is built
  (before any CUDA graph is captured), and rebuilds each step's block mask as vLLM's direct build
  does, but pruned by the group's largest window and sinks instead of vLLM's sliding window
  (:func:`window_metadata`).

Refused with the reason: ALiBi, soft-capping, KV sharing and a quantised KV cache (by vLLM's
FlexAttention), and, with windows, non-decoder attention, learned attention sinks, an output
transform, multimodal prefix attention, R-SWA, non-causal steps and block masks vLLM builds the
generic way (``flex_attn_kv_block_size`` other than the cache's block size).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..windows import visible
from .plan import LayerPlan

__all__ = [
    "AAHFlexAttentionBackend", "AAHFlexAttentionImpl", "AAHFlexAttentionMetadataBuilder", "layer_block_mask",
    "paged_flex_attention", "paged_mask_mod", "window_mask_mod", "window_metadata", "window_pages_hint",
]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def window_mask_mod(windows_per_head: torch.Tensor, sink_tokens: int | torch.Tensor) -> MaskMod:
    """The window rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` on logical positions.

    ``windows_per_head`` holds one window per query head (on the device the attention runs on);
    query ``q_idx`` of head ``h`` may read key ``kv_idx`` when ``kv_idx <= q_idx`` and
    (``q_idx - kv_idx < W_h`` or ``kv_idx < S``): :func:`aah.windows.visible`. Give
    ``sink_tokens`` as a 0-d tensor to let masks with different sink counts share one compiled
    kernel (an int is made one).
    """
    sinks = sink_tokens if isinstance(sink_tokens, torch.Tensor) else torch.tensor(
        int(sink_tokens), device=windows_per_head.device)

    def window_mask(b, h, q_idx, kv_idx):
        return visible(q_idx, kv_idx, windows_per_head[h], sinks)

    return window_mask


def paged_mask_mod(logical: MaskMod, *, request_of_row: torch.Tensor, query_start: torch.Tensor,
                   computed: torch.Tensor, seq_lens: torch.Tensor, logical_page: torch.Tensor,
                   page_size: int) -> MaskMod:
    """``logical`` (a ``mask_mod`` on logical positions) over vLLM's packed queries and paged cache.

    Row ``q_idx`` is a query token of the step, of request ``r = request_of_row[q_idx]``, at
    logical position ``q_idx - query_start[r] + computed[r]`` (``computed``: the request's tokens
    already in the cache before the step). Column ``kv_idx`` is a slot of the flattened cache:
    page ``kv_idx // page_size``, offset ``kv_idx % page_size``. ``logical_page[r, page]`` is the
    logical page that physical page holds for request ``r``, ``-1`` for none (vLLM's inverse
    block table, ``physical_to_logical``). A slot is read only when its page is the request's and
    its key lies before the request's length ``seq_lens[r]``, and ``logical`` allows the pair.
    """

    def paged_mask(b, h, q_idx, kv_idx):
        request = request_of_row[q_idx]
        page = logical_page[request, kv_idx // page_size]
        key = page * page_size + kv_idx % page_size
        query = q_idx - query_start[request] + computed[request]
        return (page >= 0) & (key < seq_lens[request]) & logical(b, h, query, key)

    return paged_mask


def window_pages_hint(window: int, sink_tokens: int) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """Which cache pages a query may read when no head's window exceeds ``window``: vLLM's
    ``BlockSparsityHint`` function ``(query_page, key_page, page_size) -> bool``.

    ``query_page`` is the logical page of a query's position; the earliest key any query of that
    page reads in its window is ``query_page * page_size - window + 1``. A key page is kept when
    its last key is not before that key, or when it holds a sink (its first key ``< sink_tokens``);
    causality is pruned by vLLM itself. Conservative: it never drops a page a query reads.
    """
    window, sink_tokens = int(window), int(sink_tokens)

    def window_pages(query_page, key_page, page_size):
        first_key = key_page * page_size
        return (first_key + page_size > query_page * page_size - window + 1) | (first_key < sink_tokens)

    return window_pages


def layer_block_mask(group_mask: Any, mask_mod: MaskMod) -> Any:
    """The step's ``BlockMask`` (its pages per block of queries) with one layer's ``mask_mod``.

    Every page listed must be a partial block (the mask is evaluated on each of its slots): a
    block mask with full blocks would skip the layer's mask there, and is refused.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if group_mask.full_kv_num_blocks is not None:
        raise ValueError("aah.vllm: the step's block mask has full blocks, which would skip the windows' mask")
    return BlockMask.from_kv_blocks(
        group_mask.kv_num_blocks, group_mask.kv_indices, None, None, BLOCK_SIZE=group_mask.BLOCK_SIZE,
        mask_mod=mask_mod, seq_lengths=group_mask.seq_lengths, compute_q_blocks=False,
    )


def paged_flex_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_mask: Any, scale: float, *,
                         flex: Callable[..., torch.Tensor], kernel_options: dict | None = None,
                         score_mod: Callable | None = None) -> torch.Tensor:
    """FlexAttention of the step's queries over vLLM's paged cache: ``(tokens, query heads, D)``.

    ``query`` is ``(tokens, query heads, D)``; ``kv_cache`` is the layer's cache as vLLM's
    FlexAttention backend holds it: shape ``(pages, KV heads, page_size, 2 D)`` (keys, then
    values, in the last dimension), laid out in memory as ``(pages, page_size, KV heads, 2 D)``
    (vLLM's ``LBNHC``), so that pages and slots view as one slot axis without a copy (a cache
    laid out otherwise is refused by ``view``).
    ``block_mask`` lists the pages per block of queries and carries the mask; ``flex`` is the
    (compiled) ``flex_attention``.
    """
    head_size = query.shape[-1]
    slots = kv_cache.transpose(1, 2)
    slots = slots.view(-1, slots.shape[2], slots.shape[3])  # (pages * page_size, KV heads, 2 D)
    key = slots[..., :head_size].transpose(0, 1)[None]
    value = slots[..., head_size:].transpose(0, 1)[None]
    q = query.transpose(0, 1)[None]
    out = flex(q, key, value, score_mod, block_mask, scale, enable_gqa=key.shape[1] != q.shape[1],
               kernel_options=kernel_options)
    return out[0].transpose(0, 1)


# ---- the vLLM backend (needs vLLM; its CUDA build to run) --------------------------------------

try:
    from vllm.v1.attention.backends import flex_attention as vllm_flex
except ImportError as exc:  # the functions above still work
    vllm_flex = None
    _VLLM_MISSING = f"vLLM's FlexAttention backend cannot be imported ({exc})"


if vllm_flex is not None:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import AttentionType

    from vllm import envs

    from .backend import model_kv_heads_and_rank, refuse_settings, served_layer_plan, served_windows

    def window_metadata(metadata: Any, hint: Any) -> Any:
        """A step's FlexAttention metadata for windowed layers: its block mask rebuilt as vLLM's direct
        build does (each block of queries lists the pages of its requests, up to its causal end),
        pruned by ``hint`` (a ``BlockSparsityHint`` of :func:`window_pages_hint`) and with no sliding
        window (a layer's own window is part of its windows, :func:`aah.vllm.plan.plan_layer`)."""
        if not metadata.causal:
            raise NotImplementedError("aah.vllm: AAH windows run causal decoder attention only")
        if metadata.mm_prefix_range:
            raise NotImplementedError("aah.vllm: AAH windows do not run multimodal prefix attention")
        if metadata.rswa_window is not None:
            raise NotImplementedError("aah.vllm: AAH windows do not run reference sliding-window attention (R-SWA)")
        if not metadata.direct_build:
            raise NotImplementedError("aah.vllm: AAH windows need vLLM's direct block-mask build (leave "
                                      "flex_attn_kv_block_size unset, or equal to the cache's block size)")
        metadata.sliding_window = None
        metadata.logical_mask_mod = vllm_flex.causal_mask_mod
        metadata.block_sparsity_hint = hint
        metadata.mask_mod = metadata.get_mask_mod()
        metadata.block_mask = metadata._build_block_mask_direct()
        return metadata

    class AAHFlexAttentionImpl(vllm_flex.FlexAttentionImpl):
        """vLLM's FlexAttention, with the windows file's windows and sinks when one is served (not
        run on a GPU yet)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.served = served_windows()
            self.plan: LayerPlan | None = None
            if self.served is None:
                return
            refuse_settings(self.served, {
                "attention type": (self.attn_type != AttentionType.DECODER, f"{self.attn_type} (only decoder attention)"),
                "learned attention sinks": (kwargs.get("sinks") is not None, "set"),
                "an output transform": (self.out_transform is not None, "set"),
            })
            self._global_kv_heads, *self._tp = model_kv_heads_and_rank()

        def prepare(self, layer, device) -> LayerPlan:
            """The layer's plan (windows of this rank's query heads, sinks) and its mask on
            ``device``, made once; the builder calls it before any step is run or captured."""
            if self.plan is None:
                plan = served_layer_plan(
                    self.served, layer, num_heads=self.num_heads, kv_heads=self._global_kv_heads,
                    tp_size=self._tp[0], rank=self._tp[1], layer_window=self.sliding_window)
                windows = torch.tensor(plan.windows, dtype=torch.int64, device=device)
                sinks = torch.tensor(plan.sink_tokens, dtype=torch.int64, device=device)
                self.logical_mask = window_mask_mod(windows, sinks)
                self.plan = plan
            return self.plan

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            if self.served is None or attn_metadata is None:
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                       output_scale, output_block_scale)
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError("aah.vllm: fused output quantization is not supported")
            if attn_metadata.block_sparsity_hint is None:
                raise RuntimeError("aah.vllm: the step's metadata was not built by the plugin's builder")
            self.prepare(layer, query.device)
            mask = paged_mask_mod(
                self.logical_mask, request_of_row=attn_metadata.doc_ids, query_start=attn_metadata.query_start_loc,
                computed=attn_metadata.decode_offset, seq_lens=attn_metadata.seq_lens,
                logical_page=attn_metadata.physical_to_logical, page_size=attn_metadata.block_size,
            )
            block_mask = layer_block_mask(attn_metadata.block_mask, mask)
            options = vllm_flex.get_kernel_options(query, *block_mask.BLOCK_SIZE, attn_metadata.direct_build)
            if self.block_m is not None:
                options["BLOCK_M"] = self.block_m
            if self.block_n is not None:
                options["BLOCK_N"] = self.block_n
            if envs.VLLM_BATCH_INVARIANT:
                options["IS_DIVISIBLE"] = False
            n = attn_metadata.num_actual_tokens
            out = paged_flex_attention(query[:n], kv_cache, block_mask, self.scale, flex=vllm_flex.flex_attention_compiled,
                                       kernel_options=options, score_mod=attn_metadata.transformed_score_mod)
            output[:n].view(n, self.num_heads, self.head_size).copy_(out)
            return output

    class AAHFlexAttentionMetadataBuilder(vllm_flex.FlexAttentionMetadataBuilder):
        """vLLM's FlexAttention metadata builder; with windows, each step's block mask keeps the
        pages of the group's largest window and its sinks (:func:`window_metadata`). Not run on a
        GPU, nor constructed in a test (it needs vLLM's workers)."""

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            self.hint = None
            if served_windows() is None:
                return
            if self.rswa_window is not None:
                raise ValueError("aah.vllm: AAH windows do not run reference sliding-window attention (R-SWA)")
            plans = [layer.impl.prepare(layer, device)
                     for layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).values()
                     if isinstance(layer.impl, AAHFlexAttentionImpl) and layer.impl.served is not None]
            if plans:
                window = max(max(plan.windows) for plan in plans)
                sinks = max(plan.sink_tokens for plan in plans)
                self.hint = vllm_flex.BlockSparsityHint(window_pages_hint(window, sinks))

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
            return metadata if self.hint is None else window_metadata(metadata, self.hint)

    class AAHFlexAttentionBackend(vllm_flex.FlexAttentionBackend):
        """``FLEX_ATTENTION`` with AAH windows (see the module docstring); not run on a GPU yet."""

        @staticmethod
        def get_impl_cls() -> type[AAHFlexAttentionImpl]:
            return AAHFlexAttentionImpl

        @staticmethod
        def get_builder_cls() -> type[AAHFlexAttentionMetadataBuilder]:
            return AAHFlexAttentionMetadataBuilder

else:
    def __getattr__(name: str):
        if name in ("AAHFlexAttentionBackend", "AAHFlexAttentionImpl", "AAHFlexAttentionMetadataBuilder",
                    "window_metadata"):
            raise ImportError(f"aah.vllm.cuda_backend.{name} needs vLLM: {_VLLM_MISSING}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
