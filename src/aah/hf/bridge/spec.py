"""What each attention layer of a patched model runs: its windows, sinks and backend.

A head never sees more than its layer allows (:func:`aah.windows.layer_rule`): in a layer
with its own sliding window (Mistral, Qwen3's sliding layers) a head's window is
``min(W_h, sliding_window)`` and that layer keeps no sinks. This module reads a model's
layers and its configuration; it attends nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...windows import acr, causal_coverage, causal_pairs, layer_rule

__all__ = [
    "DEFAULT_SINK_TOKENS", "LayerWindows", "SPEC_ATTR", "attention_modules", "executed_coverage", "kv_heads",
    "layer_sinks", "layer_sliding_window", "layer_sliding_windows", "layer_specs", "layer_windows_for",
    "num_query_heads", "patched_windows", "uniform_window_for_budget", "window_pairs",
]

#: The attribute of a patched attention module that holds its :class:`LayerWindows`.
SPEC_ATTR = "aah_windows"

#: The sink tokens ``patch`` keeps when neither the call nor a windows file names them.
DEFAULT_SINK_TOKENS = 4


@dataclass(frozen=True)
class LayerWindows:
    """What one patched attention module executes.

    ``windows`` and ``sink_tokens`` are what the layer really runs: the requested windows
    capped by the layer's own sliding window (``layer_window``), and no sinks in such a layer.
    """

    requested: tuple[int, ...]  # one per query head, as given to patch()
    windows: tuple[int, ...]
    sink_tokens: int
    backend: str
    layer_window: int | None = None

    @classmethod
    def build(cls, requested: tuple[int, ...], sink_tokens: int, backend: str, layer_window: int | None) -> LayerWindows:
        """A head never sees more than its layer allows: cap by ``layer_window`` and drop sinks there."""
        windows, sinks = layer_rule(requested, sink_tokens, layer_window)
        sliding = None if layer_window is None or layer_window <= 0 else int(layer_window)
        return cls(requested, windows, sinks, backend, sliding)


def layer_sinks(sink_tokens: int, layer_window: int | None) -> int:
    """The sinks a layer keeps (:func:`aah.windows.layer_rule`): none in a sliding layer."""
    return layer_rule((), sink_tokens, layer_window)[1]


def kv_heads(model: torch.nn.Module) -> int:
    """The model's number of KV heads (its query heads without grouped-query attention)."""
    config = model.config
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def layer_sliding_window(model: torch.nn.Module, module: torch.nn.Module) -> int | None:
    """The layer's own sliding window: the module's (Qwen3-style) or the model's (Mistral-style)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(model.config, "sliding_window", None)


def layer_sliding_windows(model: torch.nn.Module) -> list[int | None]:
    """Each attention layer's own sliding window, in layer order (``None`` where it has none)."""
    return [layer_sliding_window(model, module) for module in attention_modules(model)]


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of ``model`` in layer order (modules with ``layer_idx`` and ``q_proj``);
    ``ValueError`` for a model whose attention is not causal (Gemma 3's ``use_bidirectional_attention``)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and hasattr(module, "q_proj") and hasattr(module, "k_proj"):
            if idx in found:
                raise ValueError(f"two attention modules claim layer_idx {idx}")
            found[idx] = module
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention modules with layer_idx and q_proj/k_proj; "
            "aah.hf supports decoder-only causal LMs such as Llama, Mistral and Qwen3"
        )
    if sorted(found) != list(range(len(found))):
        raise ValueError(f"attention layers are not numbered 0..L-1: {sorted(found)}")
    if any(getattr(module, "is_causal", True) is False for module in found.values()):
        raise ValueError(
            f"{type(model).__name__} attends bidirectionally (e.g. use_bidirectional_attention=True); "
            "aah.hf windows are causal"
        )
    return [found[i] for i in range(len(found))]


def num_query_heads(model: torch.nn.Module) -> int:
    """The model's number of query heads per layer (``ValueError`` where its config names none)."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise ValueError(f"{type(model).__name__}.config has no num_attention_heads")
    return heads


def layer_specs(model: torch.nn.Module) -> list[LayerWindows]:
    """Each layer's :class:`LayerWindows`; ``ValueError`` when the model is not patched."""
    specs = [getattr(module, SPEC_ATTR, None) for module in attention_modules(model)]
    if any(spec is None for spec in specs):
        raise ValueError(f"{type(model).__name__} is not patched by aah.hf.patch")
    return specs


def patched_windows(model: torch.nn.Module, *, effective: bool = False) -> torch.Tensor:
    """The (num_layers, num_query_heads) windows given to :func:`patch` (or, with
    ``effective=True``, the windows that run after the layers' own sliding windows)."""
    rows = [spec.windows if effective else spec.requested for spec in layer_specs(model)]
    return torch.tensor(rows, dtype=torch.int64)


def layer_windows_for(
    model: torch.nn.Module, windows: torch.Tensor, sink_tokens: int, backend: str = "auto"
) -> list[LayerWindows]:
    """What each layer of ``model`` would run given the (num_layers, num_query_heads) ``windows``."""
    return [
        LayerWindows.build(tuple(int(w) for w in row), sink_tokens, backend, layer_window)
        for layer_window, row in zip(layer_sliding_windows(model), windows.tolist())
    ]


def executed_coverage(model: torch.nn.Module, seq_len: int, specs: Sequence[LayerWindows] | None = None) -> tuple[float, float]:
    """ACR and causal coverage of what a patched model runs at ``seq_len`` (or of ``specs``, see
    :func:`layer_windows_for`): every layer's windows after its own sliding window, with the
    sinks that layer keeps (none in a sliding layer)."""
    specs = layer_specs(model) if specs is None else specs
    heads = sum(len(spec.windows) for spec in specs)
    ratio = sum(acr(spec.windows, seq_len, sink_tokens=spec.sink_tokens) * len(spec.windows) for spec in specs)
    full = seq_len * (seq_len + 1) // 2
    pairs = sum(causal_pairs(w, seq_len, sink_tokens=spec.sink_tokens) for spec in specs for w in spec.windows)
    return ratio / heads, pairs / (full * heads)


def window_pairs(
    candidates: Sequence[int], seq_len: int, sink_tokens: int, layer_window: int | None = None
) -> list[int]:
    """Allowed (query, key) pairs of one head per candidate window, sinks counted, as a layer
    with ``layer_window`` executes it (:func:`aah.windows.layer_rule`)."""
    windows, sinks = layer_rule(candidates, sink_tokens, layer_window)
    return [causal_pairs(w, seq_len, sink_tokens=sinks) for w in windows]


def uniform_window_for_budget(
    budget: float, seq_len: int, *, sink_tokens: int = 0, layer_windows: Sequence[int | None] | None = None
) -> int:
    """The largest window ``W`` whose causal coverage at ``seq_len`` (with sinks) is ``<= budget``.

    With ``layer_windows`` (each layer's own sliding window, ``None`` for none) the coverage
    is the executed one of ``W`` in every layer: ``min(W, sliding window)`` without sinks in a
    sliding layer (:func:`window_pairs`), averaged over the layers.
    """
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    smallest = causal_coverage([1], seq_len, sink_tokens=sink_tokens)
    if budget < smallest:
        raise ValueError(
            f"budget {budget} is below the causal coverage of a window of 1 with {sink_tokens} "
            f"sink tokens at length {seq_len} ({smallest:.4f})"
        )
    layers = [None] if not layer_windows else list(layer_windows)
    full = seq_len * (seq_len + 1) // 2

    def coverage(w: int) -> float:
        return sum(window_pairs([w], seq_len, sink_tokens, lw)[0] for lw in layers) / (len(layers) * full)

    lo, hi = 1, seq_len  # coverage grows with W: find the last W within the budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if coverage(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
