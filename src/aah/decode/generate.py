"""Autoregressive generation with the per-window KV cache (paper section 5.8).

:func:`generate` decodes greedily (``temperature=0``) or by sampling, with the
ring-buffer cache of :mod:`aah.decode.cache` (one prefill of the prompt, then one token
per step) or, with ``use_cache=False``, by recomputing the whole prefix at every
step; both give the same tokens up to floating-point ties. The model runs in
evaluation mode without gradients, so the head controller's windows stay fixed.

:func:`cache_memory_report` tells, without allocating anything, how much memory
the cache of a model takes next to a full cache of the same length.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from .cache import kv_capacities

if TYPE_CHECKING:  # pragma: no cover - the model imports the decode engine, not the reverse
    from ..model import GPT

__all__ = ["generate", "iter_tokens", "cache_memory_report"]


def _check_prompt(model: GPT, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    if not isinstance(prompt_ids, torch.Tensor):
        raise TypeError(f"prompt_ids must be a LongTensor, got {type(prompt_ids).__name__}")
    if prompt_ids.dtype.is_floating_point or prompt_ids.dtype.is_complex or prompt_ids.dtype == torch.bool:
        raise ValueError(f"prompt_ids must hold integer token ids, got dtype {prompt_ids.dtype}")
    if prompt_ids.dim() not in (1, 2) or prompt_ids.shape[-1] == 0 or prompt_ids.numel() == 0:
        raise ValueError(f"prompt_ids must have shape (T,) or (B, T) with T >= 1, got {tuple(prompt_ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    vocab = model.config.vocab_size
    if bool((prompt_ids < 0).any()) or bool((prompt_ids >= vocab).any()):
        raise ValueError(f"prompt_ids must lie in [0, {vocab})")
    limit = model.config.max_seq_len
    fed = prompt_ids.shape[-1] + max(max_new_tokens - 1, 0)
    if fed > limit:
        raise ValueError(
            f"prompt of {prompt_ids.shape[-1]} tokens + {max_new_tokens} new tokens needs {fed} "
            f"positions, more than the model's max_seq_len {limit}"
        )
    return prompt_ids.long()


def _next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Pick one token per row from ``logits`` (B, V): argmax, or a sample at ``temperature``.

    ``top_k`` keeps the ``k`` most likely tokens; ``top_p`` then keeps the
    smallest set of most likely tokens whose probability reaches ``p`` (nucleus
    sampling; the most likely token is always kept).
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if generator is not None and probs.device != generator.device:
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """``ValueError`` naming the setting unless ``temperature`` is finite and >= 0, ``top_k`` a
    positive int (or None) and ``top_p`` in (0, 1] (or None)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def generate(
    model: GPT,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """Continue ``prompt_ids`` by ``max_new_tokens`` tokens; returns prompt and continuation.

    ``prompt_ids`` is (T,) or (B, T) (every row of a batch has the same
    length); the result has the same rank and ``T + max_new_tokens`` columns.
    ``temperature=0`` is greedy decoding; otherwise tokens are sampled from
    ``softmax(logits / temperature)``, restricted to the ``top_k`` most likely
    tokens when ``top_k`` is given and to the nucleus of mass ``top_p`` when
    ``top_p`` is given, drawing from ``generator``. The tokens fed
    to the model (``T + max_new_tokens - 1``) must fit in its ``max_seq_len``.
    The model is put in evaluation mode for the call and restored afterwards.
    """
    ids = _check_prompt(model, prompt_ids, max_new_tokens)
    squeeze = ids.dim() == 1
    new = list(
        iter_tokens(
            model, ids if not squeeze else ids[None], max_new_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, generator=generator, use_cache=use_cache,
        )
    )
    ids = ids.to(model.embed.weight.device)
    out = torch.cat([ids if not squeeze else ids[None]] + [t[:, None] for t in new], dim=1)
    return out[0] if squeeze else out


def iter_tokens(
    model: GPT,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    cache_out: list | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the new tokens one step at a time: a LongTensor (B,) per step, for streaming.

    ``prompt_ids`` is (B, T); the arguments are those of :func:`generate`.
    The model runs in evaluation mode without gradients while the iterator
    runs and gets its previous mode back when it ends. With ``cache_out`` (a
    list), the cache is appended to it once created (to report its memory).
    """
    check_sampling(temperature, top_k, top_p)
    ids = _check_prompt(model, prompt_ids, max_new_tokens)
    if ids.dim() != 2:
        raise ValueError(f"prompt_ids must have shape (B, T), got {tuple(ids.shape)}")
    if max_new_tokens == 0:
        return
    ids = ids.to(model.embed.weight.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            cache = None
            if use_cache:
                cache = model.new_cache(ids.shape[0], ids.shape[1] + max_new_tokens - 1)
                if cache_out is not None:
                    cache_out.append(cache)
                logits, _ = model(ids, cache=cache)
            else:
                logits, _ = model(ids)
            tokens = [ids]
            for step in range(max_new_tokens):
                nxt = _next_token(logits[:, -1], temperature, top_k, generator, top_p)
                yield nxt
                if step == max_new_tokens - 1:
                    break
                tokens.append(nxt[:, None])
                if cache is not None:
                    logits, _ = model(nxt[:, None], cache=cache)
                else:
                    logits, _ = model(torch.cat(tokens, dim=1))
    finally:
        model.train(was_training)


def cache_memory_report(
    model: GPT, batch: int, max_len: int | None = None, *, dtype: torch.dtype | None = None
) -> dict:
    """Memory of the per-window cache of ``model`` against a full cache, computed without allocating.

    Returns ``windows`` (layers x query heads), ``capacities`` (layers x KV
    heads), ``head_dim``, ``bytes_per_element``, ``memory_bytes`` (the ring
    buffers: ``sum C * head_dim * 2 * batch * bytes``), ``full_memory_bytes``
    (``layers * KV heads * max_len * head_dim * 2 * batch * bytes``) and
    ``ratio`` (the first over the second). Equal to what
    ``model.new_cache(batch, max_len)`` reports.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    limit = model.config.max_seq_len
    max_len = limit if max_len is None else max_len
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= limit:
        raise ValueError(f"max_len must be an int in [1, {limit}], got {max_len!r}")
    dtype = model.embed.weight.dtype if dtype is None else dtype
    element = torch.empty((), dtype=dtype).element_size()
    layers = model.attention_layers()
    head_dim = layers[0].head_dim
    windows = [[min(w, max_len) for w in attn.current_windows(max_len)] for attn in layers]
    capacities = [list(kv_capacities(w, attn.num_kv_heads, max_len)) for w, attn in zip(windows, layers)]
    per_entry = head_dim * 2 * batch * element
    memory = sum(sum(caps) for caps in capacities) * per_entry
    full = sum(attn.num_kv_heads for attn in layers) * max_len * per_entry
    return {
        "batch": batch,
        "max_len": max_len,
        "dtype": str(dtype).removeprefix("torch."),
        "head_dim": head_dim,
        "bytes_per_element": element,
        "windows": windows,
        "capacities": capacities,
        "memory_bytes": memory,
        "full_memory_bytes": full,
        "ratio": memory / full,
    }
