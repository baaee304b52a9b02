"""A decode step of a whole Llama-style decoder layer in one compiled call (paper section 5.8).

At one token per row a transformers decoder layer is some forty operator calls (norms, four
projections, rotary embedding, cache update, attention, three MLP projections, residuals),
each paying PyTorch's fixed costs, and the general matrix product is slow for one row. When a
patched model decodes into an :mod:`aah.hf.bridge.cache` window cache on CPU, :func:`adopt_layers`
moves each decoder layer into a subclass whose ``forward`` runs such a step as one call of
:func:`aah.decode.ring_decode.decode_block` instead: the same operations in the same order, the key
and value written straight into the layer's ring, each head reading its window and the sinks
before it. The layer's weights stay in its modules; nothing is copied.

The step runs for Llama, Mistral and Qwen2 layers (RMSNorm, rotate-half rotary embedding,
SiLU-gated MLP; Qwen3's per-head query and key norms are not in the kernel) in evaluation mode
without gradients, for one token per row with no padding mask, in float32 or bfloat16, with
plain ``nn.Linear`` projections, no forward hooks and no autocast. Anything else runs the
layer's own ``forward`` (whose attention still reads the window cache). This module only maps a
layer's weights; the route is decided by :func:`aah.decode.route.choose_route`, and the cache
layer says which route its last step took and why (:attr:`aah.hf.WindowCacheLayer.route`,
``route_reason``).
"""

from __future__ import annotations

import torch

from ...decode import ring_decode
from ...decode.route import BLOCK, layer_reason
from .cache import WindowCacheLayer
from .generation import Adopted, adopted_class

__all__ = ["BLOCK_FAMILIES", "adopt_layers", "release_layers", "layer_block"]

#: ``config.model_type`` of the models whose decoder layers the compiled step reproduces.
BLOCK_FAMILIES = ("llama", "mistral", "qwen2")


class _CompiledDecodeLayer(Adopted):
    """Mixed in front of a decoder layer class by :func:`adopt_layers` (pickles as the original class)."""

    def forward(self, hidden_states, *args, **kwargs):
        if not args:
            out = _compiled_step(self, hidden_states, kwargs)
            if out is not None:
                return out
        return super().forward(hidden_states, *args, **kwargs)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "self_attn", None), torch.nn.Module)
            and isinstance(getattr(m, "mlp", None), torch.nn.Module)]


def adopt_layers(model: torch.nn.Module) -> None:
    """Move the decoder layers of a model of :data:`BLOCK_FAMILIES` into their compiled-step subclass."""
    if getattr(model.config, "model_type", None) not in BLOCK_FAMILIES:
        return
    for layer in _decoder_layers(model):
        if not isinstance(layer, _CompiledDecodeLayer):
            layer.__class__ = adopted_class(_CompiledDecodeLayer, type(layer))


def release_layers(model: torch.nn.Module) -> None:
    """Move the decoder layers back to their own classes."""
    for layer in _decoder_layers(model):
        if isinstance(layer, _CompiledDecodeLayer):
            layer.__class__ = layer._aah_base


def layer_block(layer: torch.nn.Module, dtype: torch.dtype) -> ring_decode.Block | str:
    """The layer's weights as :func:`aah.decode.ring_decode.decode_block` reads them, or why the
    compiled step would compute something else (see the module docstring)."""
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if any(type(p) is not torch.nn.Linear for p in projections):
        return "a projection is not a plain nn.Linear"
    if not hasattr(norm1, "variance_epsilon") or not hasattr(norm2, "variance_epsilon"):
        return "the layer's norms are not RMSNorm"
    if getattr(mlp, "config", None) is not None and mlp.config.hidden_act not in ("silu", "swish"):
        return f"the MLP's activation {mlp.config.hidden_act!r} is not SiLU"
    q, k, v, o, gate, up, down = projections
    block = ring_decode.Block.of(
        dtype, "rmsnorm", (norm1.variance_epsilon, norm2.variance_epsilon), "swiglu",
        norm1=norm1, qkv=q, key=k, value=v, out=o, norm2=norm2, gate=gate, up=up, down=down,
    )
    return f"the layer's weights are not contiguous {dtype} tensors" if block is None else block


def _compiled_step(layer, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """The layer's output through the compiled step, or ``None`` for the module path (the route
    is :func:`aah.decode.route.choose_route`'s, asked through the cache layer)."""
    attn = layer.self_attn
    layers = getattr(kwargs.get("past_key_values"), "layers", ())
    cache_layer = layers[attn.layer_idx] if attn.layer_idx < len(layers) else None
    if not isinstance(cache_layer, WindowCacheLayer) or hidden_states.dim() != 3:
        return None
    position_embeddings = kwargs.get("position_embeddings")
    route = cache_layer.layer_route(
        hidden_states, attn, kwargs.get("attention_mask"), kwargs.get("position_ids"),
        lambda: ("the layer was given no position embeddings" if position_embeddings is None
                 else layer_reason(layer) or layer_block(layer, hidden_states.dtype)),
    )
    if route.name != BLOCK:
        cache_layer.store.note_layer_reason(route.reason)
        return None
    return cache_layer.decode_block(hidden_states, route.block, position_embeddings, attn)
