"""What each attention layer runs inside vLLM: windows file, tensor-parallel slice, window classes.

Pure Python and PyTorch (no vLLM import), so the rules are testable anywhere.

* The windows file (made by ``aah hf calibrate``) holds one window per query head and layer and
  the number of sink tokens ``S``. Query ``i`` attends key ``j`` when ``j <= i`` and
  (``i - j < W`` or ``j < S``), the convention of :mod:`aah.hf` (paper section 5.8, windowed
  execution at inference, with the sink tokens of the pretrained bridge).
* A layer with its own sliding window keeps it: a head's window is ``min(W, layer window)``
  and that layer keeps no sinks (:func:`aah.windows.layer_rule`).
* With tensor parallelism, rank ``r`` of ``tp`` holds query heads
  ``[r * H / tp, (r + 1) * H / tp)`` and KV heads ``[r * K / tp, (r + 1) * K / tp)`` (or, when
  ``K < tp``, the one KV head ``r * K // tp``, replicated), as vLLM's linear layers split them.
* A layer's local query heads are grouped into :class:`WindowClass` es: the heads that read one
  KV head with one window. With ``kv_group`` windows (the default of calibration) that is one
  class per KV head.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..windows import layer_rule

__all__ = [
    "CONFIG_KEY", "ENV_VAR", "LayerPlan", "WindowClass", "plan_layer", "rank_heads",
    "resolve_windows_path",
]

#: The environment variable naming the windows file (takes precedence over the model config).
ENV_VAR = "AAH_WINDOWS"
#: The key of the model's ``config.json`` naming the windows file (relative to the model folder).
CONFIG_KEY = "aah_windows"


@dataclass(frozen=True)
class WindowClass:
    """Local query heads ``q_heads`` that read local KV head ``kv_head`` with window ``window``."""

    kv_head: int
    q_heads: tuple[int, ...]
    window: int


@dataclass(frozen=True)
class LayerPlan:
    """What one layer runs on this rank: its window classes and the sinks it keeps."""

    classes: tuple[WindowClass, ...]
    sink_tokens: int
    windows: tuple[int, ...]  # one per local query head, after the layer's sliding window


def rank_heads(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> tuple[range, range]:
    """The global query heads and KV heads that rank ``rank`` of ``tp_size`` holds."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank must be in [0, tensor_parallel_size={tp_size}), got {rank}")
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={tp_size}")
    per_rank = num_heads // tp_size
    queries = range(rank * per_rank, (rank + 1) * per_rank)
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"num_key_value_heads={num_kv_heads} is not divisible by tensor_parallel_size={tp_size}")
        kv_per_rank = num_kv_heads // tp_size
        return queries, range(rank * kv_per_rank, (rank + 1) * kv_per_rank)
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size} is not divisible by num_key_value_heads={num_kv_heads}")
    kv = rank * num_kv_heads // tp_size
    return queries, range(kv, kv + 1)


def plan_layer(
    windows: torch.Tensor | list[int] | tuple[int, ...],
    *,
    num_kv_heads: int,
    sink_tokens: int,
    layer_window: int | None,
    tp_size: int = 1,
    rank: int = 0,
) -> LayerPlan:
    """The plan of one layer on one rank.

    ``windows`` is the layer's row of the windows file (one window per *global* query head),
    ``num_kv_heads`` the model's global KV heads and ``layer_window`` the layer's own sliding
    window (``None`` or ``<= 0`` for none).
    """
    row = [int(w) for w in (windows.tolist() if isinstance(windows, torch.Tensor) else windows)]
    if any(w < 1 for w in row):
        raise ValueError(f"windows must be >= 1, got {row}")
    queries, kvs = rank_heads(len(row), num_kv_heads, tp_size, rank)
    local, sinks = layer_rule([row[h] for h in queries], int(sink_tokens), layer_window)
    per_kv = len(local) // len(kvs)
    classes = []
    for kv in range(len(kvs)):
        heads = range(kv * per_kv, (kv + 1) * per_kv)
        for window in sorted({local[h] for h in heads}):
            classes.append(WindowClass(kv, tuple(h for h in heads if local[h] == window), window))
    return LayerPlan(tuple(classes), sinks, tuple(local))


def resolve_windows_path(model_dir: str | os.PathLike | None, hf_config: Any) -> Path | None:
    """The windows file to serve: ``$AAH_WINDOWS``, else ``config.aah_windows`` (relative paths
    are taken from the model folder), else ``None`` (the plugin then runs vanilla attention)."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return Path(env).expanduser()
    name = getattr(hf_config, CONFIG_KEY, None)
    if not name:
        return None
    path = Path(str(name)).expanduser()
    if not path.is_absolute() and model_dir is not None:
        path = Path(model_dir) / path
    return path
