"""Held-out quality, speed and KV memory of a patched model against full attention.

Up to four settings of one model: ``full`` (transformers' own SDPA attention and its default
dynamic cache), ``own`` (for a model with sliding layers of its own, such as Gemma 3: its own
windows, the sliding window on sliding layers and the whole context on global layers, run through
the bridge and its window cache, :func:`own_setting`), ``aah`` (the calibrated windows with their
sinks and the window cache) and ``uniform`` (one window for every head, at the executed causal
coverage of ``aah``). ``own`` against ``full`` is what the bridge's execution alone gains; ``aah``
against ``own`` what the windows' choice gains on top. For each:

* perplexity on held-out token blocks (teacher forcing over whole blocks, no cache; the loss taken
  from the final hidden states through the LM head a chunk of rows at a time, :func:`block_nll`),
  and for each ratio of perplexities a 95% interval paired by block (Student-t over the blocks'
  differences of mean log-likelihood, exponentiated), so more blocks narrow it;
* served perplexity on the same blocks: each block prefilled in one call into a fresh cache of
  the setting, as a user serving it reads a prompt (kept keys included: the prefill's tail rows
  read every key, and with rolling kept keys each block of ``prefill_block`` rows reads the far
  keys chosen for it), the next-token loss taken from that prefill's hidden states through the
  LM head a chunk of rows at a time (:func:`served_block_nll`);
* prefill tokens/s: one block through the model with a fresh cache, the logits of its last
  position only (``logits_to_keep=1``, as ``generate`` prefills);
* decode tokens/s: greedy steps at ``decode_batch`` after a prompt of ``seq_len - new_tokens``
  tokens; the settings take turns within each round (one process, interleaved), and the
  median round counts;
* KV bytes held by the cache after that prompt.

At batch 1 a decode step of a small model is dominated by reading the weights, so window
savings show at larger batches and contexts; the report says which batch was measured.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ...report.stats import paired_difference
from .._transformers import require
from ..bridge.cache import cache_memory_bytes, cache_route, new_cache
from ..bridge.kept_keys import KeptKeys, executed_read_coverage, kept_coverage
from ..bridge.patch import patch, unpatch
from ..bridge.spec import (
    executed_coverage,
    kv_heads,
    layer_sliding_windows,
    layer_specs,
    layer_windows_for,
    num_query_heads,
    uniform_window_for_budget,
)

__all__ = [
    "HEAD_CHUNK_ROWS", "Setting", "block_nll", "check_chunk_rows", "check_head", "chunked_nll", "evaluate_settings",
    "final_hidden", "has_own_windows", "head_logits", "last_logits", "markdown_table", "own_setting", "perplexity",
    "served_block_nll", "summary", "uniform_setting",
]

#: Rows of a block whose logits :func:`block_nll` and :func:`served_block_nll` compute at once by
#: default (with a vocabulary of 262k, 256 float rows are 268 MB).
HEAD_CHUNK_ROWS = 256


@dataclass(frozen=True)
class Setting:
    """One way to run the model: ``windows`` None means full attention; ``kept_keys`` keeps far
    keys in the window cache (:mod:`aah.hf.bridge.kept_keys`)."""

    name: str
    windows: torch.Tensor | None
    sink_tokens: int = 0
    kept_keys: KeptKeys | None = None

    def apply(self, model) -> None:
        if hasattr(model, "_aah_previous_attn_implementation"):
            unpatch(model)
        if self.windows is not None:
            patch(model, self.windows, sink_tokens=self.sink_tokens)

    def new_cache(self, model):
        if self.windows is None:
            return require("transformers.cache_utils").DynamicCache(config=model.config)
        return new_cache(model, kept_keys=self.kept_keys)


@torch.no_grad()
def block_nll(
    model, blocks: torch.Tensor, *, chunk_rows: int = HEAD_CHUNK_ROWS, desc: str | None = None
) -> list[float]:
    """Mean next-token negative log-likelihood of each block (B, T) of token ids, read without a cache.

    The model's forward computes the logits of the last position only; its base model's final
    hidden states of every position are kept from that call and the LM head (:func:`head_logits`)
    reads them ``chunk_rows`` rows at a time (:func:`chunked_nll`), so no more than ``chunk_rows``
    rows of logits exist at once. ``ValueError`` for a model whose forward transforms its logits in
    a way :func:`head_logits` does not know (as :func:`served_block_nll`)."""
    return _block_losses(model, blocks, lambda ids: model(ids, use_cache=False, logits_to_keep=1).logits[:, -1],
                         chunk_rows, desc)


def nll_perplexity(nll: list[float]) -> float:
    """Perplexity of blocks of equal length from their mean negative log-likelihoods: exp of the mean."""
    return math.exp(statistics.fmean(nll))


def perplexity(model, blocks: torch.Tensor, *, desc: str | None = None) -> float:
    """exp(mean next-token negative log-likelihood) over every position of every block."""
    return nll_perplexity(block_nll(model, blocks, desc=desc))


def ppl_ratio_interval(nll: list[float], reference_nll: list[float]) -> list[float] | None:
    """95% interval of the perplexity ratio of two settings on the same blocks: ``exp`` of the
    Student-t interval of the per-block differences of mean log-likelihood (``None`` with one block)."""
    diff = paired_difference(dict(enumerate(nll)), dict(enumerate(reference_nll)))
    if diff is None or diff.ci is None:
        return None
    return [math.exp(diff.ci[0]), math.exp(diff.ci[1])]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.no_grad()
def last_logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits (B, V) of the last position of ``ids`` after the cached prefix, computing no others."""
    return model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


def _base_model(model) -> torch.nn.Module:
    """The module whose output's first field is the hidden states the model's LM head reads:
    its base model (``LlamaModel`` of a ``LlamaForCausalLM``)."""
    decoder = model.base_model
    if decoder is model:
        raise ValueError(f"{type(model).__name__} has no base model apart from its LM head: no served perplexity")
    return decoder


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Float logits of final hidden states ``hidden`` (..., hidden size), as the causal-LM forwards of
    transformers compute them from their base model's output: the LM head, then where the config
    asks for it Gemma's ``final_logit_softcapping`` (``cap * tanh(logits / cap)``), Cohere's
    ``logit_scale`` (a product) or Granite's ``logits_scaling`` (a quotient).
    :func:`served_block_nll` checks the result against the model's own logits of each block's
    last position."""
    logits = model.get_output_embeddings()(hidden).float()
    config = model.config.get_text_config()
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)):
        logits = logits * scale
    divisor = getattr(config, "logits_scaling", None)
    if isinstance(divisor, (int, float)):
        logits = logits / divisor
    return logits


def check_head(model, computed: torch.Tensor, own: torch.Tensor) -> None:
    """``ValueError`` unless ``computed`` (:func:`head_logits` of a position) are the model's ``own``
    logits of that position, within the rounding of the model's dtype."""
    tol = max(1e-4, 4 * torch.finfo(own.dtype).eps)
    own = own.float()
    error = (computed - own).abs().max().item()
    if not error <= tol * (1.0 + own.abs().max().item()):
        raise ValueError(
            f"{type(model).__name__} computes its logits otherwise than its LM head followed by the final "
            f"transforms served perplexity applies (largest difference {error:.3g}); no served perplexity for it"
        )


def check_chunk_rows(chunk_rows) -> None:
    """``ValueError`` unless ``chunk_rows`` (rows of logits computed at once) is an integer >= 1."""
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an integer >= 1, got {chunk_rows!r}")


@contextmanager
def final_hidden(model) -> Iterator[list[torch.Tensor]]:
    """While open, every forward of ``model`` appends its base model's final hidden states
    (B, T, hidden size: what the LM head reads) to the yielded list."""
    captured: list[torch.Tensor] = []
    handle = _base_model(model).register_forward_hook(lambda module, args, output: captured.append(output[0]))
    try:
        yield captured
    finally:
        handle.remove()


def chunked_nll(model, hidden: torch.Tensor, labels: torch.Tensor, *, chunk_rows: int = HEAD_CHUNK_ROWS) -> float:
    """Summed negative log-likelihood of ``labels`` (N,) from final hidden states ``hidden`` (N, hidden
    size), the logits computed by :func:`head_logits` ``chunk_rows`` rows at a time."""
    check_chunk_rows(chunk_rows)
    total = 0.0
    for start in range(0, hidden.shape[0], chunk_rows):
        stop = min(hidden.shape[0], start + chunk_rows)
        logits = head_logits(model, hidden[start:stop])
        total += F.cross_entropy(logits, labels[start:stop].to(logits.device), reduction="sum").item()
    return total


def _block_losses(model, blocks: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor], chunk_rows: int,
                  desc: str | None) -> list[float]:
    """Mean next-token loss of each block: ``forward(ids)`` runs the model on the block (1, T) and
    returns its own logits of the last position, which :func:`head_logits` of the captured final
    hidden states must reproduce; the loss of every other position comes from those hidden states
    ``chunk_rows`` rows at a time."""
    check_chunk_rows(chunk_rows)
    out = []
    with final_hidden(model) as captured:
        for block in tqdm(blocks, desc=desc, disable=desc is None, leave=False):
            ids = block[None].to(model.device)
            captured.clear()
            own_last = forward(ids)
            hidden = captured[-1]
            check_head(model, head_logits(model, hidden[:, -1]), own_last)
            predicted = ids.shape[1] - 1
            total = chunked_nll(model, hidden[0, :predicted], ids[0, 1:], chunk_rows=chunk_rows)
            out.append(total / predicted)
    return out


@torch.no_grad()
def served_block_nll(
    model, setting: Setting, blocks: torch.Tensor, *, chunk_rows: int = HEAD_CHUNK_ROWS, desc: str | None = None
) -> list[float]:
    """Mean next-token negative log-likelihood of each block (B, T) as ``setting`` serves it.

    ``model`` runs ``setting`` (:meth:`Setting.apply`). Each block is prefilled in one call into a
    fresh :meth:`Setting.new_cache`, through the model's own forward with the logits of the last
    position only; the base model's final hidden states of every position are kept from that call,
    and the LM head (:func:`head_logits`) reads them ``chunk_rows`` rows at a time, so no more than
    ``chunk_rows`` rows of logits exist at once. The loss is that of ``block_nll``: every position
    but the last predicts the next token. The head's logits of the last position must equal those
    the model's forward returned for it (``ValueError`` otherwise: a model whose forward transforms
    its logits in a way :func:`head_logits` does not know)."""
    return _block_losses(model, blocks, lambda ids: last_logits(model, ids, setting.new_cache(model)),
                         chunk_rows, desc)


@torch.no_grad()
def evaluate_settings(
    model,
    settings: list[Setting],
    blocks: torch.Tensor,
    *,
    decode_batch: int = 8,
    new_tokens: int = 16,
    rounds: int = 3,
    progress: bool = True,
    chunk_rows: int = HEAD_CHUNK_ROWS,
) -> dict[str, dict]:
    """Per-setting ``ppl``, ``block_nll``, ``served_ppl``, ``served_block_nll``, ``prefill_tok_s``,
    ``decode_tok_s``, ``decode_route``, ``kv_bytes``, ``acr``, ``causal_coverage``, ``executed_coverage``.
    A setting's kept keys (:mod:`aah.hf.bridge.kept_keys`) count in its coverage figures, timings, KV
    bytes and served perplexity (:func:`served_block_nll`); its perplexity ``ppl`` reads the blocks
    without a cache (:func:`block_nll`), so with the windows alone. Both perplexities compute
    ``chunk_rows`` rows of logits at a time."""
    seq_len = blocks.shape[1]
    if new_tokens < 1 or new_tokens >= seq_len:
        raise ValueError(f"new_tokens must be in [1, {seq_len - 1}], got {new_tokens}")
    results: dict[str, dict] = {}
    for setting in settings:
        setting.apply(model)
        nll = block_nll(model, blocks, chunk_rows=chunk_rows, desc=f"perplexity {setting.name}" if progress else None)
        served = served_block_nll(model, setting, blocks, chunk_rows=chunk_rows,
                                  desc=f"served perplexity {setting.name}" if progress else None)
        results[setting.name] = {"ppl": nll_perplexity(nll), "block_nll": nll,
                                 "served_ppl": nll_perplexity(served), "served_block_nll": served}
        results[setting.name].update(setting_coverage(model, setting, seq_len))

    prompt = blocks[:1].to(model.device)
    prefill = {s.name: [] for s in settings}
    for _ in tqdm(range(rounds), desc="prefill rounds", disable=not progress, leave=False):
        for setting in settings:
            setting.apply(model)
            cache = setting.new_cache(model)
            prefill[setting.name].append(_timed(lambda c=cache: last_logits(model, prompt, c)))

    context = seq_len - new_tokens
    rows = blocks[torch.arange(decode_batch) % blocks.shape[0], :context].to(model.device)
    caches, last = {}, {}
    for setting in tqdm(settings, desc=f"decode prompts (batch {decode_batch})", disable=not progress, leave=False):
        setting.apply(model)
        caches[setting.name] = setting.new_cache(model)
        last[setting.name] = last_logits(model, rows, caches[setting.name]).argmax(-1, keepdim=True)
        results[setting.name]["kv_bytes"] = cache_memory_bytes(caches[setting.name])
    steps_per_round = max(1, new_tokens // rounds)
    decode = {s.name: [] for s in settings}
    for _ in tqdm(range(rounds), desc="decode rounds", disable=not progress, leave=False):
        for setting in settings:
            setting.apply(model)
            cache, token = caches[setting.name], last[setting.name]

            def steps(cache=cache, token=token, name=setting.name):
                nxt = token
                for _ in range(steps_per_round):
                    nxt = last_logits(model, nxt, cache).argmax(-1, keepdim=True)
                last[name] = nxt

            decode[setting.name].append(_timed(steps))
    for setting in settings:
        results[setting.name]["decode_route"] = cache_route(caches[setting.name])
        results[setting.name]["prefill_tok_s"] = seq_len / statistics.median(prefill[setting.name])
        results[setting.name]["decode_tok_s"] = decode_batch * steps_per_round / statistics.median(decode[setting.name])
    if hasattr(model, "_aah_previous_attn_implementation"):
        unpatch(model)
    return results


def setting_coverage(model, setting: Setting, seq_len: int) -> dict[str, float]:
    """``acr``, ``causal_coverage`` and ``executed_coverage`` of ``setting`` as ``model``, patched
    with it, runs a ``seq_len`` prompt: 1 for full attention; with kept keys, counting those and the
    tail rows (:func:`aah.hf.bridge.kept_keys.kept_coverage`), and every pair the prefill reads
    (:func:`aah.hf.bridge.kept_keys.executed_read_coverage`)."""
    if setting.windows is None:
        return {"acr": 1.0, "causal_coverage": 1.0, "executed_coverage": 1.0}
    specs, kept = layer_specs(model), setting.kept_keys
    ratio, coverage = executed_coverage(model, seq_len) if kept is None else kept_coverage(
        specs, seq_len, kept, kv_heads(model))
    executed = executed_read_coverage(specs, seq_len, kept, kv_heads(model))
    return {"acr": ratio, "causal_coverage": coverage, "executed_coverage": executed}


def effective_coverage(model, setting: Setting, seq_len: int) -> float:
    """Causal coverage of ``setting`` on ``model`` as it runs: after the layers' own sliding
    windows, with the sinks each layer keeps."""
    return executed_coverage(model, seq_len, layer_windows_for(model, setting.windows, setting.sink_tokens))[1]


def uniform_setting(model, aah: Setting, seq_len: int) -> Setting:
    """One window for every head, the largest whose executed causal coverage is within that of ``aah``."""
    coverage = effective_coverage(model, aah, seq_len)
    window = uniform_window_for_budget(
        coverage, seq_len, sink_tokens=aah.sink_tokens, layer_windows=layer_sliding_windows(model)
    )
    return Setting("uniform", torch.full_like(aah.windows, window), aah.sink_tokens, aah.kept_keys)


def has_own_windows(model) -> bool:
    """Whether some layer of ``model`` has a sliding window of its own (what
    :attr:`aah.hf.bridge.spec.LayerWindows.layer_window` holds), so that :func:`own_setting` applies."""
    ones = torch.ones(len(layer_sliding_windows(model)), num_query_heads(model), dtype=torch.int64)
    return any(spec.layer_window is not None for spec in layer_windows_for(model, ones, 0))


def own_setting(model, context: int, name: str = "own") -> Setting:
    """The model's own attention run through the bridge: each layer's own sliding window
    (:attr:`aah.hf.bridge.spec.LayerWindows.layer_window`) on its sliding layers, ``context`` (the
    whole context: at least every position a prompt and its answer reach) on the others, no sinks
    and no kept keys. The windows are those the layers execute (:func:`aah.hf.bridge.spec.layer_windows_for`
    caps ``context`` by each layer's own window). ``ValueError`` for a model without sliding layers
    of its own: there its own attention is full attention, which ``full`` measures."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be an integer >= 1, got {context!r}")
    if not has_own_windows(model):
        config = model.config.get_text_config()
        raise ValueError(
            f"{type(model).__name__} has no sliding layers of its own (sliding_window "
            f"{getattr(config, 'sliding_window', None)!r}, no sliding layer types): its own attention is full "
            "attention, which the full setting measures"
        )
    whole = torch.full((len(layer_sliding_windows(model)), num_query_heads(model)), context, dtype=torch.int64)
    return Setting(name, torch.tensor([spec.windows for spec in layer_windows_for(model, whole, 0)]), 0)


def summary(results: dict[str, dict]) -> dict:
    """The top-level ratios of ``aah`` against ``full`` (and ``uniform``'s perplexity ratio; with
    ``own``, its ratios against ``full`` and those of ``aah`` against it).

    Perplexity ratios come with a 95% interval paired by held-out block (``*_ci``, ``None``
    with one block); ``served_ppl_ratio`` is that of the served perplexities;
    ``aah_vs_uniform_ppl_ratio`` compares the two windowed settings. ``own_*`` compare ``own``
    (the model's own windows through the bridge) with ``full`` (transformers' own attention and
    cache): what execution alone gains; ``aah_vs_own_*`` compare ``aah`` with ``own``: what the
    choice of windows gains on the same execution.
    """
    full, aah = results["full"], results["aah"]
    out = {
        "ppl_ratio": aah["ppl"] / full["ppl"],
        "ppl_ratio_ci": ppl_ratio_interval(aah["block_nll"], full["block_nll"]),
        "served_ppl_ratio": aah["served_ppl"] / full["served_ppl"],
        "served_ppl_ratio_ci": ppl_ratio_interval(aah["served_block_nll"], full["served_block_nll"]),
        "prefill_speedup": aah["prefill_tok_s"] / full["prefill_tok_s"],
        "decode_speedup": aah["decode_tok_s"] / full["decode_tok_s"],
        "kv_bytes_ratio": aah["kv_bytes"] / full["kv_bytes"],
    }
    if "uniform" in results:
        uniform = results["uniform"]
        uniform["ppl_ratio"] = uniform["ppl"] / full["ppl"]
        uniform["ppl_ratio_ci"] = ppl_ratio_interval(uniform["block_nll"], full["block_nll"])
        out["aah_vs_uniform_ppl_ratio"] = aah["ppl"] / uniform["ppl"]
        out["aah_vs_uniform_ppl_ratio_ci"] = ppl_ratio_interval(aah["block_nll"], uniform["block_nll"])
    if "own" in results:
        own = results["own"]
        out.update({
            "own_ppl_ratio": own["ppl"] / full["ppl"],
            "own_served_ppl_ratio": own["served_ppl"] / full["served_ppl"],
            "own_prefill_speedup": own["prefill_tok_s"] / full["prefill_tok_s"],
            "own_decode_speedup": own["decode_tok_s"] / full["decode_tok_s"],
            "own_kv_bytes_ratio": own["kv_bytes"] / full["kv_bytes"],
            "aah_vs_own_ppl_ratio": aah["ppl"] / own["ppl"],
            "aah_vs_own_ppl_ratio_ci": ppl_ratio_interval(aah["block_nll"], own["block_nll"]),
            "aah_vs_own_prefill_speedup": aah["prefill_tok_s"] / own["prefill_tok_s"],
            "aah_vs_own_decode_speedup": aah["decode_tok_s"] / own["decode_tok_s"],
            "aah_vs_own_kv_bytes_ratio": aah["kv_bytes"] / own["kv_bytes"],
        })
    return out


def markdown_table(results: dict[str, dict]) -> str:
    """A markdown table, one row per setting: its perplexity and served perplexity, each with its
    ratio to ``full``'s and the 95% interval paired by block, then speeds, KV bytes and coverage."""
    lines = [
        "| setting | perplexity | ppl / full (95% CI) | served perplexity | served / full (95% CI) | prefill tok/s "
        "| decode tok/s | decode route | KV MB | ACR | causal coverage | executed coverage |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    full = results["full"]

    def ratio(r: dict, ppl: str, nll: str, name: str) -> str:
        ci = ppl_ratio_interval(r[nll], full[nll]) if name != "full" else None
        return f"{r[ppl] / full[ppl]:.4f}" + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")

    for name, r in results.items():
        lines.append(
            f"| {name} | {r['ppl']:.3f} | {ratio(r, 'ppl', 'block_nll', name)} | {r['served_ppl']:.3f} | "
            f"{ratio(r, 'served_ppl', 'served_block_nll', name)} | {r['prefill_tok_s']:.1f} | "
            f"{r['decode_tok_s']:.1f} | {r['decode_route']} | {r['kv_bytes'] / 1e6:.1f} | {r['acr']:.3f} | {r['causal_coverage']:.3f} | "
            f"{r['executed_coverage']:.3f} |"
        )
    return "\n".join(lines)
