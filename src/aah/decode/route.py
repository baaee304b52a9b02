"""The one route decision of the decode engine (paper section 5.8: decode cost follows the windows).

Every call through a ring store, from the small GPT, a patched Hugging Face model, or either
with kept keys, takes one of four routes:

* ``prefill``: the first call (nothing stored yet) runs the model's own attention backend;
* ``compiled block``: a one-token step runs the whole decoder layer in one compiled call
  (:func:`aah.decode.ring_decode.decode_block`), the new key and value written into the ring;
* ``compiled attention``: a one-token step runs the layer's modules, and its attention reads each
  head's window and sinks from the rings in one compiled call (kept keys join its softmax);
* ``masked``: everything else (a chunk of tokens, padding, another device or dtype, gradients, no
  compiled extension) attends over the stored slots with an exact position mask.

:func:`choose_route` is the only place that decides; the callers only ask. A layer asks once per
step with the weights its adapter mapped (or the adapter's reason why it cannot); its attention,
when the layer's modules run, asks again without them. Where a compiled route cannot run, the
returned :class:`Route` says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from . import extension

__all__ = [
    "ATTENTION", "BLOCK", "MASKED", "PREFILL", "Route", "choose_route", "hooks_or_autocast", "inference_reason", "layer_reason",
]

PREFILL = "prefill"
BLOCK = "compiled block"
ATTENTION = "compiled attention"
MASKED = "masked"


@dataclass(frozen=True)
class Route:
    """A route; where a faster compiled route was not taken, why (``None`` where none was); and,
    for ``compiled block``, the layer's weights as its adapter mapped them."""

    name: str
    reason: str | None = None
    block: object | None = None


def hooks_or_autocast(*modules: torch.nn.Module) -> bool:
    """Whether a forward hook or autocast would change what these modules compute."""
    if _global_forward_hooks or _global_forward_pre_hooks or torch.is_autocast_enabled("cpu"):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def inference_reason(x: torch.Tensor, *modules: torch.nn.Module) -> str | None:
    """Why a compiled kernel may not stand in for ``modules`` on ``x``: another device, a gradient
    asked for, hooks or autocast, no extension; ``None`` where it may."""
    if x.device.type != "cpu":
        return f"the compiled steps run on CPU, this step is on {x.device.type}"
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for m in modules for p in m.parameters(recurse=False))):
        return "gradients are asked for (decode under torch.no_grad() or torch.inference_mode())"
    if modules and hooks_or_autocast(*modules):
        return "forward hooks or autocast would change what the modules compute"
    unavailable = extension.unavailable_reason()
    if unavailable is not None:
        return f"the compiled extension is unavailable: {unavailable}"
    return None


def layer_reason(layer: torch.nn.Module) -> str | None:
    """Why a whole decoder layer cannot run as one compiled step, beyond what :func:`choose_route`
    checks on the store: training mode, gradients, a hook on it or any of its modules, autocast."""
    if layer.training:
        return "the layer is in training mode"
    if torch.is_grad_enabled():
        return "gradients are enabled (decode under torch.no_grad() or torch.inference_mode())"
    if hooks_or_autocast(*layer.modules()):
        return "forward hooks or autocast would change what the layer computes"
    return None


def _store_reason(store, x: torch.Tensor, tokens: int, first_real: torch.Tensor | None, padded: bool) -> str | None:
    """Why no compiled step can read ``store`` for this call, or ``None``."""
    if tokens != 1:
        return f"a chunk of {tokens} tokens (the compiled steps take one token per row)"
    if padded:
        return "a padding mask is given"
    if first_real is not None and bool(first_real.any()):
        return "a row starts after position 0 (left padding), so its sinks are not slots 0..S-1"
    if store.device.type != "cpu" or x.dtype != store.dtype:
        return f"the rings hold {store.dtype} on {store.device.type}, this step is {x.dtype} on {x.device.type}"
    if store.flat_keys.shape[-1] != store.flat_values.shape[-1]:
        return "keys and values of different head dims (the kernels read one)"
    return inference_reason(x)


def choose_route(
    store,
    x: torch.Tensor,
    *,
    start: int,
    tokens: int = 1,
    first_real: torch.Tensor | None = None,
    padded: bool = False,
    layer: Callable[[], object] | None = None,
) -> Route:
    """The route of a call of ``tokens`` new tokens at position ``start`` through ``store`` (an
    allocated :class:`aah.decode.rings.RingStore`); ``x`` is the query or the hidden states.

    ``first_real`` (B,) is where each row's real tokens start; ``padded`` says a padding mask came
    with the call. ``layer`` is asked by a decoder layer that could run whole: a callable that maps
    its weights (an :class:`aah.decode.ring_decode.Block`) or returns a string saying why it
    cannot; the attention's own call passes none and gets ``compiled attention`` at best.
    """
    if start == 0:
        return Route(PREFILL)
    reason = _store_reason(store, x, tokens, first_real, padded)
    if reason is not None:
        return Route(MASKED, reason)
    if layer is None:
        return Route(ATTENTION)
    if start < store.sinks:
        return Route(ATTENTION, f"the {store.sinks} sink slots are not all written yet (position {start})")
    weights = layer()
    if isinstance(weights, str):
        return Route(ATTENTION, weights)
    return Route(BLOCK, block=weights)
