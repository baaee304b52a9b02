"""The compiled decode step (CPU): the Python functions that call it.

One decode step is small: per layer a token's query against, per head, the
last ``W`` cached keys (paper section 5.8, windowed execution at inference),
and one row through each weight matrix. In PyTorch it takes some fifty
operator calls per layer, whose fixed costs outweigh the keys a short window
saves. ``csrc/`` holds the compiled replacements:

* :func:`ring_decode`: attention of one query per head over each head's
  window of its KV head's ring, in spans of at most 256 entries spread over
  the threads and joined exactly by their maxima and sums; with
  :class:`KeptSlots`, each KV head's kept keys (far keys a prefill chose to
  keep, :mod:`aah.hf.bridge.kept_keys`) join the same softmax as more spans;
* :func:`ring_decode_packed`: the rotary embedding, the ring write and that
  attention, from a layer's packed QKV projection: the attention part of
  :func:`decode_block`, callable alone for its tests;
* :func:`linear_rows`: a linear layer for a few rows (:func:`linear` picks it),
  each weight row read once for all rows, with GELU or ReLU applied on the
  way out;
* :func:`decode_block`: a whole pre-norm block of :mod:`aah.model` (norms,
  projections, attention, MLP, residuals) in one call, which is what
  ``GPT.forward`` runs for each layer of a decode step;
* :func:`paged_attention`: per-head windows and sink tokens over a paged KV
  cache, the attention :mod:`aah.vllm` runs inside vLLM.

:mod:`aah.decode.extension` builds and loads them (:func:`load`); without them the
PyTorch paths run, with the same results (tested against each other).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

from .extension import decode_step_label, load, unavailable_reason
from .route import inference_reason

__all__ = ["ACTIVATIONS", "LINEAR_ROWS_MAX", "decode_step_label", "linear", "linear_rows", "load", "ring_decode", "ring_decode_packed", "decode_block", "Block", "BLOCK_PARTS", "KeptSlots", "Rings", "paged_attention", "unavailable_reason"]


class KeptSlots(NamedTuple):
    """Kept keys beside a layer's rings, as the compiled steps read them
    (:func:`aah.decode.rings.pack_kept` builds them from a prefill's kept keys).

    ``keys``, ``values`` (B, K, D): contiguous, in the rings' dtype; ``valid`` (B, K) bool:
    which entries of each row hold a key; ``start``, ``count`` (H_kv,) int64 on the CPU: KV
    head ``g``'s entries are slots ``start[g] .. start[g] + count[g]``. Every query head
    reading KV head ``g`` reads its valid entries in the same softmax as its window and sinks
    (they must never be among those: no key is counted twice).
    """

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    start: torch.Tensor
    count: torch.Tensor


def _kept(kept: KeptSlots | None) -> tuple[torch.Tensor | None, ...]:
    """The five kept-key arguments of the compiled steps (``None`` each: no kept keys)."""
    return (None,) * 5 if kept is None else tuple(kept)


def ring_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ring_start: torch.Tensor,
    capacity: torch.Tensor,
    windows: torch.Tensor,
    length: int,
    scale: float,
    *,
    sinks: int = 0,
    lse: torch.Tensor | None = None,
    kept: KeptSlots | None = None,
) -> torch.Tensor:
    """Attention of ``q`` (B, H, D) over the last ``min(W_h, length, C)`` entries of each head's ring.

    ``keys`` and ``values`` (B, S, D) hold every KV head's ring, KV head ``g``
    in slots ``ring_start[g] .. ring_start[g] + capacity[g]`` with position
    ``p`` in slot ``p % capacity[g]``; query head ``h`` reads KV head
    ``h // (H // H_kv)`` with window ``windows[h]``; ``length`` positions are
    written (the newest included). With ``sinks`` the ``sinks`` slots before
    each ring hold positions ``0 .. sinks - 1``, and a head also reads those
    that lie before its window (:func:`aah.windows.visible`). With ``kept``
    (:class:`KeptSlots`) a head also reads the valid kept keys of its KV head, in the same
    softmax. Returns (B, H, D); with ``lse`` (a float32 (B, H) tensor) also writes there each
    row's log-sum-exp of its scaled scores (over every key it read), with which more keys can
    join the same softmax. Raises ``RuntimeError`` when the extension is not available (see
    :func:`load`).
    """
    return _module().ring_decode(
        q, keys, values, ring_start, capacity, windows, int(length), int(sinks), float(scale), lse, *_kept(kept)
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    keys_transposed: bool,
    token_request: torch.Tensor,
    token_position: torch.Tensor,
    block_table: torch.Tensor,
    windows: torch.Tensor,
    sinks: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` (N, H, D) over a paged KV cache, each head with its window and the sinks.

    Token ``t`` belongs to request ``token_request[t]`` (a row of ``block_table``, int32, the
    pages of its keys in order) at position ``token_position[t]``; query head ``h`` reads KV
    head ``h // (H // K)`` of ``key_cache``/``value_cache`` (blocks, K, block_size, D), keys
    ``j <= p`` with ``p - j < windows[h]`` or ``j < sinks``. With ``keys_transposed`` each key
    page holds ``K^T``. ``query`` and ``out`` may be views whose last axis alone is contiguous.
    Returns ``out`` (a new (N, H, D) tensor when not given). Raises ``RuntimeError`` when the
    extension is not available (see :func:`load`).
    """
    return _module().paged_attention(
        query, key_cache, value_cache, bool(keys_transposed), token_request, token_position, block_table,
        windows, int(sinks), float(scale), out,
    )


class Rings(NamedTuple):
    """A layer's ring buffers as the compiled steps read them (:meth:`aah.decode.rings.RingStore.rings`).

    ``keys``, ``values`` (B, S, D): every KV head's ring, KV head ``g`` in slots
    ``ring_start[g] .. ring_start[g] + capacity[g]``; ``unread`` (1, S) float32:
    a row in which the step writes 0.0 at each slot it fills (the stores keep their own
    record of the positions held); ``windows``
    (H,): each query head's window. The index tensors are int64.
    """

    keys: torch.Tensor
    values: torch.Tensor
    unread: torch.Tensor
    ring_start: torch.Tensor
    capacity: torch.Tensor
    windows: torch.Tensor


def _tables(reference: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables for the extension: empty tensors stand for no rotary embedding."""
    if cos is None or sin is None:
        empty = reference.new_empty(0, dtype=torch.float32)
        return empty, empty
    return cos, sin


def ring_decode_packed(
    qkv: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rings: Rings,
    length: int,
    scale: float,
    *,
    sinks: int = 0,
    kept: KeptSlots | None = None,
) -> torch.Tensor:
    """One whole decode step of a layer from its packed QKV projection; returns (B, H * D).

    ``qkv`` (B, (H + 2 H_kv) D) holds the query heads, key heads and value heads
    of position ``length - 1``. With ``cos`` and ``sin`` (rotary tables,
    (positions, D), or the new position's row alone, (1, D); ``None`` for no
    rotary embedding) the query and the key are rotated at that position as
    :class:`aah.attention.RotaryEmbedding` does (rotate-half). The key and value
    go into slot ``(length - 1) % C`` of their KV head's ring (and that slot of
    ``rings.unread`` becomes 0; the sink slots are not written); then the query
    attends as :func:`ring_decode` with ``sinks`` and ``kept``.
    """
    return _module().ring_decode_packed(
        qkv, *_tables(qkv, cos, sin), *rings, int(length), int(sinks), float(scale), *_kept(kept)
    )


#: The projections and norms of a block, in the order of :attr:`Block.weights` (a weight and a bias each).
BLOCK_PARTS = ("norm1", "qkv", "key", "value", "out", "norm2", "gate", "up", "down")


class Block(NamedTuple):
    """What :func:`decode_block` needs of a pre-norm block besides its cache.

    ``weights``: a weight and a bias for each of :data:`BLOCK_PARTS`, ``None``
    where absent (:meth:`of` builds them from the modules). ``qkv`` is the packed projection (:class:`aah.model.Block`)
    or, with ``key`` and ``value``, the query projection alone (a Llama-style layer);
    ``up`` gives the gate then the value of ``swiglu`` or, with ``gate``, the value alone.
    ``norm``: ``layernorm`` or ``rmsnorm``; ``eps``: the two norms' epsilons;
    ``activation``: ``gelu``, ``relu`` or ``swiglu`` (``silu(gate) * value``).
    """

    weights: list[torch.Tensor | None]
    norm: str
    eps: tuple[float, float]
    activation: str

    @classmethod
    def of(
        cls, dtype: torch.dtype, norm: str, eps: tuple[float, float], activation: str,
        **modules: torch.nn.Module | None,
    ) -> Block | None:
        """The block of the modules named by :data:`BLOCK_PARTS` (missing names: absent), or
        ``None`` when one of their tensors is not a contiguous tensor of ``dtype``."""
        unknown = set(modules) - set(BLOCK_PARTS)
        if unknown:
            raise ValueError(f"unknown block parts {sorted(unknown)}; expected some of {BLOCK_PARTS}")
        weights = []
        for part in BLOCK_PARTS:
            module = modules.get(part)
            params = {} if module is None else module._parameters
            weights += [params.get("weight"), params.get("bias")]
        if not all(t is None or (t.dtype == dtype and t.is_contiguous()) for t in weights):
            return None
        return cls(weights, norm, eps, activation)


def decode_block(
    x: torch.Tensor, block: Block, cos: torch.Tensor | None, sin: torch.Tensor | None, rings: Rings,
    length: int, scale: float, *, sinks: int = 0, kept: KeptSlots | None = None,
) -> torch.Tensor:
    """One decode step of a pre-norm block, ``x + out(attn(qkv(norm1(x))))`` then ``x + down(act(up(norm2(x))))``.

    ``x`` (B, d_model) at position ``length - 1``; the attention is
    :func:`ring_decode_packed` (the arguments after ``block`` are its own, ``kept`` included).
    Returns the block's output (B, d_model).
    """
    return _module().decode_block(
        x, block.weights, block.norm, float(block.eps[0]), float(block.eps[1]), block.activation,
        *_tables(x, cos, sin), *rings, int(length), int(sinks), float(scale), *_kept(kept),
    )


#: Activations :func:`linear_rows` and :func:`linear` can apply to their output.
ACTIVATIONS = ("none", "gelu", "relu")


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none"
) -> torch.Tensor:
    """``activation(x @ weight.T + bias)`` for ``x`` (N, I) of a few rows, reading ``weight`` (O, I) once.

    ``activation`` is one of :data:`ACTIVATIONS`; ``gelu`` is the exact (erf) form.
    """
    return _module().linear_rows(x, weight, bias, activation)


def _module():
    module = load()
    if module is None:
        raise RuntimeError(f"the compiled decode step is not available: {unavailable_reason()}")
    return module


#: Up to this many rows, :func:`linear` runs :func:`linear_rows` (on 2 CPU cores it beats the
#: general matrix product up to 8 rows in float32 and 16 in bfloat16; ``aah bench decode``).
LINEAR_ROWS_MAX = 8


def linear(layer: torch.nn.Linear, x: torch.Tensor, activation: str = "none") -> torch.Tensor:
    """``activation(layer(x))``; in inference on CPU, for at most :data:`LINEAR_ROWS_MAX` rows, in :func:`linear_rows`.

    That is a decode step's case: one row per sequence. Anything else (a
    gradient to keep, many rows, another device or dtype, a subclass of
    ``nn.Linear``, forward hooks, autocast, no compiled step) is the layer's
    own forward.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    weight = layer.weight
    rows = x.numel() // weight.shape[1] if weight.shape[1] else 0
    module = None
    if (
        0 < rows <= LINEAR_ROWS_MAX
        and type(layer) is torch.nn.Linear  # a subclass or wrapper may compute something else
        and x.dtype == weight.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.is_contiguous()
        and inference_reason(x, layer) is None
    ):
        module = load()
    if module is not None:
        y = module.linear_rows(x.reshape(rows, weight.shape[1]).contiguous(), weight, layer.bias, activation)
        return y.view(*x.shape[:-1], weight.shape[0])
    y = layer(x)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "relu":
        return F.relu(y)
    return y
