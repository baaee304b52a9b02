"""The masks of the bridge's masked path, all from the one window rule of :mod:`aah.windows`.

transformers hands the attention function a causal-and-padding mask (or a custom 4-D mask);
:func:`visible_keys` reads which keys each query may see at all (and, for packed rows, only
its own document, :func:`packed_documents`), and :func:`allowed_keys` applies each head's
window and the sinks to it with :func:`aah.windows.visible_among`. :func:`padded_spans` finds
the rows of a plainly padded prompt, which the windowed kernels then read one row at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...windows import visible_among

__all__ = ["allowed_keys", "packed_documents", "padded_spans", "visible_keys"]


def packed_documents(
    position_ids: torch.Tensor | None, q_len: int, kv_len: int, attention_mask: torch.Tensor | None = None
) -> torch.Tensor | None:
    """(B, T) document index of each token of a packed row, or ``None`` when no row is packed.

    A row is packed when its ``position_ids`` restart between two real tokens (a token's
    position is not its predecessor's plus one), as transformers detects packing; the restarts
    that left padding makes next to padding positions do not count. Only a call whose queries
    are all its keys (a prompt) can be packed.
    """
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[1] != q_len or q_len < 2:
        return None
    restarts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(restarts.any()):
        return None
    if attention_mask is not None:
        if q_len != kv_len or attention_mask.dim() != 4 or attention_mask.shape[-1] != kv_len:
            return None
        real = visible_keys(1, kv_len, attention_mask[:, :, -1:], position_ids.device)[:, 0, 0]  # (B, T)
        restarts = restarts & real[:, 1:] & real[:, :-1]
    if not bool(restarts.any()):
        return None
    starts = torch.cat([torch.zeros_like(restarts[:, :1]), restarts], dim=1)
    return starts.cumsum(dim=1)


def visible_keys(
    q_len: int,
    kv_len: int,
    attention_mask: torch.Tensor | None,
    device: torch.device,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean (B or 1, 1, Tq, Tk): the keys each query may see at all, before any window.

    That is the given causal-and-padding mask (boolean, or additive with 0 where visible:
    transformers' own, a ``StaticCache``'s, or a custom 4-D mask), or, without one, causality
    for queries at the last ``q_len`` of ``kv_len`` positions (one query sees every key, as
    transformers means a missing mask; longer query blocks are given only their own keys by
    :func:`attend_without_cache`); and, for packed rows
    (``documents``, (B, Tk) with the queries the keys), only the query's own document.
    """
    if attention_mask is None:
        qpos = torch.arange(kv_len - q_len, kv_len, device=device)
        visible = (torch.arange(kv_len, device=device)[None, :] <= qpos[:, None])[None, None]
    else:
        if attention_mask.dim() != 4 or attention_mask.shape[-2:] != (q_len, kv_len):
            raise ValueError(
                f"aah.hf takes 4-D attention masks of shape (B, 1, {q_len}, {kv_len}), got {tuple(attention_mask.shape)}"
            )
        if attention_mask.dtype == torch.bool:
            visible = attention_mask
        else:
            hidden = ~torch.isfinite(attention_mask) | (attention_mask <= torch.finfo(attention_mask.dtype).min / 2)
            if bool((~hidden & (attention_mask != 0)).any()):
                raise ValueError(
                    "aah.hf takes additive 4-D masks of 0 (visible) and -inf or the dtype's minimum (hidden) "
                    "only; a mask with other values is a bias that per-head windows cannot keep exact"
                )
            visible = attention_mask == 0
        visible = visible.to(device)
        if q_len == kv_len and bool(torch.triu(visible, diagonal=1).any()):
            raise ValueError(
                "aah.hf takes causal 4-D masks only (no query may see a later key): a window is counted "
                "back from the query"
            )
        if visible.shape[1] != 1:
            raise ValueError(f"aah.hf takes one mask for all heads (B, 1, Tq, Tk), got {tuple(visible.shape)}")
    if documents is not None:
        documents = documents.to(device)
        same = documents[:, -q_len:, None] == documents[:, None, :]  # (B, Tq, Tk)
        visible = visible & same[:, None]
    return visible


def allowed_keys(windows: Sequence[int], sinks: int, visible: torch.Tensor) -> torch.Tensor:
    """Boolean (B or 1, H, Tq, Tk) mask of the keys each head's queries attend.

    ``visible`` (B or 1, 1, Tq, Tk) says which keys a query may see at all (:func:`visible_keys`);
    the window rule over them is :func:`aah.windows.visible_among`.
    """
    return visible_among(visible, windows, sinks)


def padded_spans(visible: torch.Tensor) -> list[tuple[int, int]] | None:
    """Where each row of a padded prompt holds its tokens, if the mask is plain padding.

    ``visible`` (B, 1, T, T) from :func:`visible_keys` for a prompt read without a cache. The
    positions that see themselves hold tokens; when those of every row form one run
    ``[first, stop)`` (left or right padding) and each of them sees exactly the tokens of that run
    up to itself, a row is an unpadded prompt of ``stop - first`` tokens shifted by ``first`` (its
    windows and sinks counted from ``first``, as :func:`aah.windows.visible_among` counts them).
    Returns one ``(first, stop)`` per row (``(0, 0)`` for a row without tokens), or ``None`` for any
    other mask (packed documents, custom masks).
    """
    if visible.dim() != 4 or visible.shape[1] != 1 or visible.shape[-1] != visible.shape[-2]:
        return None
    real = visible[:, 0].diagonal(dim1=-2, dim2=-1)  # (B, T)
    spans = []
    for row in range(visible.shape[0]):
        held = real[row].nonzero().flatten()
        if held.numel() == 0:
            spans.append((0, 0))
            continue
        first, stop = int(held[0]), int(held[-1]) + 1
        count = stop - first
        rows = visible[row, 0, first:stop]
        causal = torch.ones(count, count, dtype=torch.bool, device=visible.device).tril()
        if (held.numel() != count or int(rows.sum()) != count * (count + 1) // 2
                or not bool(torch.equal(rows[:, first:stop], causal))):
            return None
        spans.append((first, stop))
    return spans
