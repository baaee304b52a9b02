"""The one window convention of AAH, band masks, and the coverage figures.

A head with window ``W`` lets query position ``i`` attend key positions ``j``
with ``i - W < j <= i``: ``W`` keys including the query itself. ``W >= T`` is
ordinary causal attention. This is the convention of Hugging Face's
``sliding_window_overlay`` and of flash-attn's ``window_size=(W - 1, 0)``.

With ``S`` sink tokens the first ``S`` positions stay visible as well: query
``i`` also attends key ``j`` when ``j < S`` (and ``j <= i``). Pretrained models
park attention on their first tokens and need this; ``S = 0`` (the default, and
the paper's regimes) is the plain window.

Three coverage figures are kept apart (paper section 5.10 defines the first):

* ``acr``: the paper's rectangular proxy ``sum T * min(W, T) / (L * H * T^2)``,
  a routing diagnostic;
* ``causal_coverage``: allowed (query, key) pairs over the causal triangle
  ``T (T + 1) / 2``, i.e. what an ideal kernel would compute;
* executed coverage: what a backend really computed; each backend reports it
  (see :mod:`aah.backends`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "as_window_tensor",
    "check_sink_tokens",
    "band_mask",
    "visible",
    "visible_among",
    "cut_off",
    "layer_rule",
    "kv_group_reach",
    "acr",
    "causal_coverage",
    "causal_pairs",
    "candidate_windows",
    "window_tuple",
    "bucket_fractions",
    "OTHER_BUCKET",
]

#: Bucket of windows that are not among the candidates.
OTHER_BUCKET = "other"

WindowsLike = torch.Tensor | Sequence[int]


def as_window_tensor(windows: WindowsLike, *, name: str = "windows") -> torch.Tensor:
    """Validate ``windows`` and return it as a CPU int64 tensor of shape (H,) or (L, H).

    Raises ``ValueError`` naming the problem for non-integer dtypes, wrong
    ranks, empty tensors and non-positive windows.
    """
    if not isinstance(windows, torch.Tensor):
        try:
            windows = torch.as_tensor(list(windows))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name} must be integers, got {windows!r}") from exc
    if windows.dtype.is_floating_point or windows.dtype.is_complex or windows.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {windows.dtype}")
    if windows.dim() not in (1, 2):
        raise ValueError(
            f"{name} must be 1-D (one window per head) or 2-D (layers, heads), "
            f"got shape {tuple(windows.shape)}"
        )
    if windows.numel() == 0:
        raise ValueError(f"{name} must not be empty")
    windows = windows.detach().to("cpu", torch.int64)
    if bool((windows <= 0).any()):
        raise ValueError(f"{name} must be positive, got {windows.tolist()}")
    return windows


def window_tuple(windows: WindowsLike, num_heads: int | None = None) -> tuple[int, ...]:
    """Validated 1-D windows as a tuple of Python ints (hashable, no device syncs later)."""
    w = as_window_tensor(windows)
    if w.dim() != 1:
        raise ValueError(f"windows must be 1-D here (one per head), got shape {tuple(w.shape)}")
    if num_heads is not None and w.numel() != num_heads:
        raise ValueError(f"windows has {w.numel()} entries but there are {num_heads} heads")
    return tuple(int(x) for x in w.tolist())


def _check_seq_len(seq_len: int) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    return seq_len


def check_sink_tokens(sink_tokens: int) -> int:
    """Validate the number of sink tokens: an int ``>= 0``."""
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
    return sink_tokens


def visible(
    q_pos: torch.Tensor | int,
    k_pos: torch.Tensor | int,
    windows: torch.Tensor | int,
    sinks: int = 0,
    first_real: torch.Tensor | int = 0,
) -> torch.Tensor:
    """The window rule, the one every mask and kernel of AAH follows: may query ``q_pos`` read key ``k_pos``?

    ``True`` where ``first_real <= k_pos <= q_pos`` and (``q_pos - k_pos < W`` or
    ``k_pos < first_real + sinks``): the key lies in the query's window of ``W``
    positions (the query included) or is one of the first ``sinks`` real tokens.
    ``first_real`` is where a row's real tokens start (left padding before it is
    never read). Every argument broadcasts against the others.
    """
    q_pos, k_pos = torch.as_tensor(q_pos), torch.as_tensor(k_pos)
    causal = (k_pos <= q_pos) & (k_pos >= first_real)
    return causal & ((q_pos - k_pos < windows) | (k_pos < first_real + sinks))


def cut_off(q_pos: torch.Tensor | int, k_pos: torch.Tensor | int, windows: torch.Tensor | int, sinks: int = 0) -> torch.Tensor:
    """The keys a window cuts off, ``0 <= k_pos <= q_pos - W`` and ``k_pos >= sinks``: those query ``q_pos`` sees
    in full causal context but not under :func:`visible` (the arguments broadcast as there)."""
    q_pos = torch.as_tensor(q_pos)
    return visible(q_pos, k_pos, q_pos + 1) & ~visible(q_pos, k_pos, windows, sinks)


def visible_among(seen: torch.Tensor, windows: torch.Tensor | Sequence[int], sinks: int = 0) -> torch.Tensor:
    """The window rule over the keys a query may see at all: (..., H, Tq, Tk) bool.

    ``seen`` (..., 1, Tq, Tk) says which keys each query may see before any window: causality,
    a row's padding, its own document in a packed row, or a custom mask. A query sits at the
    last key it may see (itself); it keeps the seen keys of :func:`visible` for its head's
    window, and the first ``sinks`` keys it may see (a row's or a document's sink tokens, which
    equal ``first_real + sinks`` of :func:`visible` where the seen keys are contiguous). A query
    that may see nothing (a padding position) is given key 0, so that a softmax stays finite.
    """
    k_pos = torch.arange(seen.shape[-1], device=seen.device)
    own = torch.where(seen, k_pos, -1).amax(dim=-1, keepdim=True)  # (..., 1, Tq, 1)
    w = torch.as_tensor(list(windows) if not isinstance(windows, torch.Tensor) else windows, device=seen.device)
    allowed = seen & visible(own, k_pos, w.view(-1, 1, 1))
    if sinks:
        allowed = allowed | (seen & (seen.cumsum(dim=-1) <= sinks))
    return allowed | ((own < 0) & (k_pos == 0))


def layer_rule(requested: Sequence[int], sink_tokens: int, layer_window: int | None) -> tuple[tuple[int, ...], int]:
    """The windows and sinks a layer really runs: ``(windows, sinks)``.

    A head never sees more than its layer allows: in a layer with its own sliding window
    (Mistral, Qwen3's and Gemma's sliding layers; ``None`` or ``<= 0`` for none) each window is
    capped by it and the layer keeps no sinks, since it must not see beyond that window.
    """
    windows = tuple(int(w) for w in requested)
    if layer_window is None or layer_window <= 0:
        return windows, sink_tokens
    return tuple(min(w, int(layer_window)) for w in windows), 0


def kv_group_reach(windows: Sequence[int], num_kv_heads: int) -> tuple[int, ...]:
    """The largest window of each KV group: what its KV head must hold for its query heads.

    Query head ``h`` reads KV head ``h // (H / H_kv)`` (the grouping of :func:`aah.attend`).
    """
    wins = [int(w) for w in windows]
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
    if len(wins) % num_kv_heads:
        raise ValueError(f"{len(wins)} query heads cannot be split among {num_kv_heads} KV heads")
    group = len(wins) // num_kv_heads
    return tuple(max(wins[g * group:(g + 1) * group]) for g in range(num_kv_heads))


def band_mask(
    windows: WindowsLike,
    seq_len: int,
    device: torch.device | str | None = None,
    *,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Boolean mask of shape (H, T, T); ``True`` where query ``i`` may attend key ``j`` (:func:`visible`)."""
    w = as_window_tensor(windows)
    if w.dim() != 1:
        raise ValueError(f"band_mask takes 1-D windows (one per head), got shape {tuple(w.shape)}")
    t = _check_seq_len(seq_len)
    s = check_sink_tokens(sink_tokens)
    pos = torch.arange(t, device=device)
    return visible(pos[:, None], pos[None, :], w.to(device)[:, None, None], s)


def causal_pairs(window: int, seq_len: int, *, sink_tokens: int = 0) -> int:
    """Allowed (query, key) pairs for one head: ``sum_i |{j <= i : i - j < W or j < S}|``."""
    t = _check_seq_len(seq_len)
    w = min(int(window), t)
    s = min(check_sink_tokens(sink_tokens), t)
    # Rows 0..w-1 see i+1 keys (a triangle), the remaining rows see w keys each.
    pairs = w * (w + 1) // 2 + (t - w) * w
    # Row i >= w sees the sinks j < min(S, i - w + 1) on top of its window.
    if s and t > w:
        cap = min(s, t - w)  # rows i = w .. t-1 add min(S, i - w + 1) keys
        pairs += cap * (cap + 1) // 2 + (t - w - cap) * s
    return pairs


def acr(windows: WindowsLike, seq_len: int, *, sink_tokens: int = 0) -> float:
    """The paper's rectangular Attention Coverage Ratio: mean of ``min(W + S, T) / T``.

    With ``S = 0`` this is section 5.10's figure. With sinks it counts the keys a
    head keeps (window plus sinks), which is also its share of a KV cache.
    """
    w = as_window_tensor(windows)
    t = _check_seq_len(seq_len)
    s = check_sink_tokens(sink_tokens)
    return float((w + s).clamp(max=t).double().mean().item() / t)


def causal_coverage(windows: WindowsLike, seq_len: int, *, sink_tokens: int = 0) -> float:
    """Allowed (query, key) pairs over the full causal triangle, averaged over heads (and layers)."""
    w = as_window_tensor(windows)
    t = _check_seq_len(seq_len)
    full = t * (t + 1) / 2
    pairs = [causal_pairs(x, t, sink_tokens=sink_tokens) for x in w.flatten().tolist()]
    return float(sum(pairs) / (len(pairs) * full))


def candidate_windows(seq_len: int, num: int = 4) -> tuple[int, ...]:
    """The paper's ladder ``T / 2^(num-1), ..., T / 2, T`` (``[512, 1024, 2048, 4096]`` at 4096)."""
    t = _check_seq_len(seq_len)
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    ladder = tuple(max(1, t >> (num - 1 - i)) for i in range(num))
    if len(set(ladder)) != len(ladder):
        raise ValueError(f"seq_len {t} is too short for {num} distinct windows")
    return ladder


def bucket_fractions(windows: object, candidates: Sequence[int]) -> dict[str, float]:
    """Share of assignments on each candidate window in a (layers, heads) window grid.

    ``windows`` may be nested lists or an array of any shape; every entry is one
    (layer, head) assignment. Keys are the candidate windows as strings, in
    ascending order, each present even when its share is 0, plus ``"other"``
    when some windows are not candidates.
    """
    flat = _flatten_ints(windows)
    if not flat:
        raise ValueError("the window grid is empty")
    cands = sorted({int(c) for c in candidates})
    counts = dict.fromkeys(cands, 0)
    other = 0
    for w in flat:
        if w in counts:
            counts[w] += 1
        else:
            other += 1
    out = {str(c): counts[c] / len(flat) for c in cands}
    if other:
        out[OTHER_BUCKET] = other / len(flat)
    return out


def _flatten_ints(grid: object) -> list[int]:
    if isinstance(grid, (int, float)) and not isinstance(grid, bool):
        return [int(grid)]
    if hasattr(grid, "tolist"):
        grid = grid.tolist()
    if isinstance(grid, (list, tuple)):
        out: list[int] = []
        for item in grid:
            out.extend(_flatten_ints(item))
        return out
    raise ValueError(f"windows must be integers, got {grid!r}")
