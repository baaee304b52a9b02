"""``flex``: per-head local windows through PyTorch FlexAttention with one block mask.

Backend-realized local attention in the sense of the AAH-v3 paper (section
7.7). Geometry: :func:`aah.windows.visible` (``kv <= q and kv > q - W[h]``) per head, in
128 x 128 tiles; the rule is a FlexAttention ``mask_mod`` that looks the window up by head index, so ONE block mask and ONE
compiled kernel serve all heads, whatever mix of windows the controller chose
(the grouped execution of section 5.8 without splitting the heads).

* The block mask (128 x 128 tiles) is built analytically from the band
  geometry, without evaluating the predicate on every (query, key) pair (the
  tests check it equals ``create_block_mask``), and cached per (sequence
  length, windows, device) in a small LRU. Each mask closes over its own
  window tensor; the predicate's code is shared, so changing windows does not
  recompile the kernel.
  ``separate_full_blocks`` semantics are kept: tiles wholly inside the band are
  "full" (no mask evaluation), tiles the band edge crosses are "partial".
* Sinks (``sink_tokens = S > 0``): the predicate is ``visible`` with sinks,
  ``kv <= q and (kv > q - W[h] or kv < S)`` (``S`` a tensor, so every sink
  count shares the kernel) and the tile maps add the sink column tiles; one
  extra key tile per query tile row for ``S <= 128``. ``S = 0`` keeps the
  plain predicate and mask.
* ``flex_attention`` is compiled once per process, lazily, on first use.
* Grouped-query attention goes through ``enable_gqa=True`` (no KV expansion).
* On CPU, PyTorch has only the forward pass of compiled FlexAttention, so this
  backend reports ``supports_backward() == False`` there and ``aah.attend``
  refuses requests that need gradients.

Executed coverage is the computed tiles (full plus partial) times each tile's
area (clipped to the sequence), over the causal triangle ``T (T + 1) / 2``.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections import OrderedDict
from typing import Any

import torch

from ..windows import visible
from .base import AttentionBackend, BackendUnavailable

__all__ = ["FlexBackend", "FLEX_BLOCK", "band_block_mask", "band_tiles"]

FLEX_BLOCK = 128
_MASK_CACHE_SIZE = 16

_compiled_flex: Any = None
_mask_cache: OrderedDict[tuple, Any] = OrderedDict()


def _import_error() -> str | None:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        return f"torch.nn.attention.flex_attention cannot be imported ({exc}); it needs torch >= 2.5"
    return None


def band_tiles(
    window: int, seq_len: int, block: int = FLEX_BLOCK, *, sink_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile maps of one head's band: ``(partial, full)`` boolean tensors of shape (nq, nkv).

    A tile is full when every (query, key) pair of its padded ``block x block``
    area is allowed, partial when some but not all are. Padding beyond the
    sequence counts as not allowed (as in ``create_block_mask``), so a tile that
    reaches past the end of the sequence is never full. With ``sink_tokens = S``
    the keys ``j < S`` are allowed too (``j <= i``).
    """
    n = -(-seq_len // block)
    starts = torch.arange(n) * block
    q_lo = starts[:, None]  # first query of the tile row
    q_hi = torch.clamp(starts + block, max=seq_len)[:, None] - 1  # last real query
    k_lo = starts[None, :]
    k_hi = torch.clamp(starts + block, max=seq_len)[None, :] - 1
    any_allowed = (k_lo <= q_hi) & (k_hi > q_lo - window)
    padded = (starts + block > seq_len)
    outside = k_lo > q_hi - window  # every pair of the tile is inside the window (or a sink, below)
    if sink_tokens:
        any_allowed |= (k_lo < sink_tokens) & (k_lo <= q_hi)
        # Too-far-back keys k_lo .. min(k_hi, q_hi - W) of the last row must all be sinks.
        outside |= torch.minimum(k_hi, q_hi - window) < sink_tokens
    all_allowed = (k_hi <= q_lo) & outside & ~padded[:, None] & ~padded[None, :]
    return any_allowed & ~all_allowed, all_allowed


def _tile_areas(seq_len: int, block: int) -> torch.Tensor:
    """Real (query, key) pairs in each tile: rows times columns, clipped to the sequence."""
    n = -(-seq_len // block)
    sizes = torch.clamp(seq_len - torch.arange(n) * block, max=block)
    return sizes[:, None] * sizes[None, :]


def executed_tile_pairs(window: int, seq_len: int, block: int = FLEX_BLOCK, *, sink_tokens: int = 0) -> int:
    """Score entries FlexAttention computes for one head: area of its full and partial tiles."""
    partial, full = band_tiles(window, seq_len, block, sink_tokens=sink_tokens)
    return int(((partial | full) * _tile_areas(seq_len, block)).sum())


def _indices(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks, indices) in BlockMask layout for a (H, nq, nkv) tile map."""
    num = tiles.sum(-1).to(torch.int32)
    # Stable sort puts the selected kv blocks first, in increasing order.
    order = torch.sort((~tiles).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num[None], order[None]


def _window_mask_mod(windows: torch.Tensor) -> Any:
    """:func:`aah.windows.visible` as a ``mask_mod``, the window looked up by head index.

    Every mask gets its own closure over its own window tensor; the code is the
    same, so the compiled kernel is reused (no recompilation when windows change).
    """

    def local_causal(b, h, q_idx, kv_idx):
        return visible(q_idx, kv_idx, windows[h])

    return local_causal


def _sink_mask_mod(windows: torch.Tensor, sinks: torch.Tensor) -> Any:
    """:func:`aah.windows.visible` with ``S`` sinks as a ``mask_mod``, the window looked up by head.

    ``S`` is a 0-d tensor, so masks with different sink counts share one compiled kernel.
    """

    def local_causal_sinks(b, h, q_idx, kv_idx):
        return visible(q_idx, kv_idx, windows[h], sinks)

    return local_causal_sinks


def band_block_mask(
    windows: tuple[int, ...], seq_len: int, device: torch.device | str, *, sink_tokens: int = 0
) -> Any:
    """The BlockMask for per-head ``windows`` (and ``sink_tokens``) at ``seq_len``, built from
    the band geometry.

    Cached per (seq_len, windows, sinks, device); the least recently used of
    more than a few masks is dropped.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = torch.device(device)
    key = (seq_len, tuple(windows), str(device)) + ((sink_tokens,) if sink_tokens else ())
    cached = _mask_cache.get(key)
    if cached is not None:
        _mask_cache.move_to_end(key)
        return cached
    window_tensor = torch.tensor(windows, dtype=torch.int64, device=device)
    if sink_tokens:
        mask_mod = _sink_mask_mod(window_tensor, torch.tensor(sink_tokens, dtype=torch.int64, device=device))
    else:
        mask_mod = _window_mask_mod(window_tensor)
    maps = [band_tiles(w, seq_len, sink_tokens=sink_tokens) for w in windows]
    partial = torch.stack([p for p, _ in maps])
    full = torch.stack([f for _, f in maps])
    kv_num, kv_idx = _indices(partial)
    full_num, full_idx = _indices(full)
    mask = BlockMask.from_kv_blocks(
        kv_num.to(device),
        kv_idx.to(device),
        full_num.to(device),
        full_idx.to(device),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(seq_len, seq_len),
    )
    _mask_cache[key] = mask
    while len(_mask_cache) > _MASK_CACHE_SIZE:
        _mask_cache.popitem(last=False)
    return mask


def _flex():
    """``torch.compile(flex_attention)``, compiled once per process on first use."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


class FlexBackend(AttentionBackend):
    name = "flex"
    description = (
        "compiled FlexAttention with one per-head block mask (window looked up by head); "
        "forward only on CPU"
    )

    def unavailable_reason(self, device):
        reason = _import_error()
        if reason is not None:
            return reason
        device = torch.device(device)
        if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return "compiling FlexAttention for CPU needs a C++ compiler (g++ or clang++) on PATH"
        if device.type not in ("cpu", "cuda"):
            return f"FlexAttention runs on CPU and CUDA only, not {device.type}"
        if device.type == "cuda" and importlib.util.find_spec("triton") is None:
            return "compiling FlexAttention for CUDA needs triton, which is not installed"
        return None

    def supports_backward(self, device):
        # torch's compiled FlexAttention has no CPU backward (NotImplementedError).
        return torch.device(device).type != "cpu"

    def attend(self, q, k, v, windows, scale, sink_tokens=0):
        seq_len = q.shape[2]
        if q.device.type == "cpu":
            if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
                raise BackendUnavailable(
                    "backend 'flex' has no backward pass on cpu; call it under torch.no_grad() "
                    "or pick another backend"
                )
            # FlexAttention refuses CPU inputs that require grad even under no_grad.
            q, k, v = q.detach(), k.detach(), v.detach()
        mask = band_block_mask(windows, seq_len, q.device, sink_tokens=sink_tokens)
        return _flex()(
            q, k, v, block_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )

    def executed_coverage(self, windows, seq_len, sink_tokens=0):
        triangle = seq_len * (seq_len + 1) / 2
        pairs = [executed_tile_pairs(w, seq_len, sink_tokens=sink_tokens) for w in windows]
        return sum(pairs) / (len(pairs) * triangle)
