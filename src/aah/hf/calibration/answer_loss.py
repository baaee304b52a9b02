"""What a head's window costs on long-range retrieval: an answer-token loss on synthetic needles.

The calibration sequences are built from other material than the evaluation of
:mod:`aah.hf.evaluation.tasks`, so windows are not tuned to its templates:

* filler: lines of natural text from the ``train`` split of a calibration corpus (the Bible
  by default; the evaluation uses repetitive sentences and held-out Shakespeare);
* needles: "Note for later: the access code of the LOCKER locker is ABC-1234." with an
  adjective-colour LOCKER name and a code of three capitals, a dash and four digits (the
  evaluation asks for 5- and 7-digit numbers and 5-letter variables), two distractor needles
  with other lockers, the asked needle at a depth spread over 10-90 %;
* question and teacher-forced answer: "Question: what is the access code of the LOCKER
  locker? Answer: the access code of the LOCKER locker is ABC-1234."
* with ``instruction`` (the sequences of :mod:`aah.hf.calibration.repair`), the context opens
  with :data:`CALIBRATION_INSTRUCTION`, as real retrieval prompts open with one, worded unlike
  the evaluation's introductions.

For each sequence the context and the question but its last token are read once at full
attention into a cache. Then, for every knapsack item (a KV group or a head) of every layer
and every candidate window, the positions that predict the answer (the question's last token
and the answer but its last) are read again from that cache with only that item's heads at
that window (sinks kept), and the rise of the answer tokens' negative log-likelihood over full
attention is recorded (floored at 0, averaged over sequences, per answer token). The windows
thus apply where retrieval happens, at the queries that must reach back to the needle to
produce the answer; the filler, needle and question are read at full attention. Each item is
judged alone, with every other head at full attention (as the KL estimate of
:mod:`aah.hf.calibration.window_kl` judges each head alone).

The item's loss is shared equally among its heads, so that summing a (L, H, K) table over
an item's heads (what :func:`aah.hf.calibration.policies.budgeted_windows` does) gives it back.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ...windows import visible
from .._transformers import require
from ..bridge.attention import attend_without_cache
from ..bridge.spec import LayerWindows, attention_modules, layer_sinks, layer_sliding_window
from ..evaluation.tasks import assemble, corpus_lines, token_cache

__all__ = ["CALIBRATION_FILLER", "CALIBRATION_INSTRUCTION", "RetrievalSequence", "answer_token_nll", "calibration_sequences", "measure_answer_loss", "window_probe"]

#: The corpus and split the calibration needles are buried in.
CALIBRATION_FILLER = ("bible", "train")

_ADJECTIVES = ("rusty", "narrow", "square", "heavy", "tiny", "crooked", "shiny", "wooden", "painted", "locked")
_COLOURS = ("scarlet", "teal", "ochre", "violet", "indigo", "crimson", "beige", "maroon", "lime", "silver")
_PROBE = "aah_probe"
_PROMPT_BACKEND = "strips"
#: The opening of the repair's calibration sequences: an instruction, as retrieval prompts have,
#: worded unlike any of the evaluation's introductions.
CALIBRATION_INSTRUCTION = ("Read the passage below. A few notes are written into it; keep each of them in mind,"
                           " because a question about one note follows the passage.\n")


@dataclass(frozen=True)
class RetrievalSequence:
    """A calibration sequence: ``context`` ids, then ``question`` ids, then the ``answer`` ids."""

    context: tuple[int, ...]
    question: tuple[int, ...]
    answer: tuple[int, ...]


def _code(rng: random.Random) -> str:
    letters = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3))
    return f"{letters}-{rng.randrange(1000, 10000)}"


def calibration_sequences(
    tokenizer, seq_len: int, count: int, *, seed: int = 0, filler: tuple[str, str] = CALIBRATION_FILLER,
    instruction: bool = False,
) -> list[RetrievalSequence]:
    """``count`` sequences of ``seq_len`` tokens (context + question + answer), asked needle at
    depths spread evenly over 10-90 %, deterministic from ``seed``. With ``instruction`` the
    context opens with :data:`CALIBRATION_INSTRUCTION` (the sequences of the retrieval repair)."""
    if count < 1:
        raise ValueError(f"need at least one retrieval sequence, got {count}")
    tok = token_cache(tokenizer)
    lines = corpus_lines(*filler)
    prefix = tok.prefix()
    out = []
    for i in range(count):
        rng = random.Random(f"calibration/{seed}/{seq_len}/{i}")
        depth = 0.1 + 0.8 * (i + 0.5) / count
        lockers = rng.sample([f"{a} {c}" for a in _ADJECTIVES for c in _COLOURS], 3)
        codes = [_code(rng) for _ in lockers]
        needles = [(depth, f"\nNote for later: the access code of the {lockers[0]} locker is {codes[0]}.")]
        needles += [(rng.uniform(0.05, 0.95), f"\nNote for later: the access code of the {name} locker is {code}.")
                    for name, code in zip(lockers[1:], codes[1:])]
        question = tok(f"\nQuestion: what is the access code of the {lockers[0]} locker?\nAnswer: the access code "
                       f"of the {lockers[0]} locker is")
        answer = tok(f" {codes[0]}.")
        start = rng.randrange(len(lines))
        context, _ = assemble(tok, seq_len - len(prefix) - len(question) - len(answer),
                              lambda j, s=start: lines[(s + j) % len(lines)], needles,
                              CALIBRATION_INSTRUCTION if instruction else "", "")
        out.append(RetrievalSequence(tuple(prefix) + tuple(context), question, answer))
    return out


@contextmanager
def window_probe(model: torch.nn.Module, sink_tokens: int):
    """Switch ``model`` to an exact attention whose heads can be given windows per layer.

    Yields ``set_windows(by_layer)``: ``by_layer`` maps a layer to its windows ((B, H) or (1, H):
    one per row of the batch and query head, sinks kept); every other layer runs full causal
    attention (each within its own sliding window, where the layer has one).
    """
    transformers = require()
    modules = attention_modules(model)
    contexts = {id(m): layer_sliding_window(model, m) for m in modules}
    active: dict[int, torch.Tensor] = {}

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        q_len, k_len = query.shape[2], key.shape[2]
        qpos = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
        kpos = torch.arange(k_len, device=query.device)[None, :]
        context = contexts[id(module)]
        windows = active.get(module.layer_idx)
        if q_len == k_len and windows is None and context is None:
            # A whole prompt at full attention (a context read): causal SDPA, no (T, T) mask.
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
        if q_len == k_len and (windows is None or windows.shape[0] == 1):
            # A whole prompt in a sliding layer, or windowed (the repair's context read), runs as a
            # patched layer runs it: the strip kernel skips the work outside the windows and sinks
            # instead of masking it, and no (T, T) mask exists.
            row = (k_len,) * query.shape[1] if windows is None else tuple(int(w) for w in windows[0])
            spec = LayerWindows.build(row, sink_tokens, _PROMPT_BACKEND, context)
            return attend_without_cache(query, key, value, None, scaling, spec).transpose(1, 2).contiguous(), None
        mask = visible(qpos, kpos, k_len if context is None else context)[None, None]
        if windows is not None:
            w = windows.to(query.device)[:, :, None, None]  # (B, H, 1, 1)
            sinks = layer_sinks(sink_tokens, context)
            mask = mask & visible(qpos, kpos, w, sinks)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register(_PROBE, attention)
    transformers.masking_utils.AttentionMaskInterface.register(_PROBE, transformers.masking_utils.sdpa_mask)
    previous = model.config._attn_implementation

    def set_windows(by_layer: Mapping[int, torch.Tensor]) -> None:
        active.clear()
        active.update(by_layer)

    model.set_attn_implementation(_PROBE)
    try:
        yield set_windows
    finally:
        model.set_attn_implementation(previous)


def answer_token_nll(model, cache, inputs: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """(B,) summed NLL of ``answer`` (A,) predicted from each row of ``inputs`` (B, A) read after
    the cached tokens; the cache is cut back afterwards."""
    logits = model(inputs, past_key_values=cache, use_cache=True).logits
    cache.crop(-inputs.shape[1])
    labels = answer[None].expand(inputs.shape[0], -1)
    return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(-1)


@torch.no_grad()
def measure_answer_loss(
    model: torch.nn.Module,
    sequences: Sequence[RetrievalSequence],
    candidates: Sequence[int],
    *,
    sink_tokens: int,
    items: Sequence[Sequence[int]],
    progress: bool = False,
    full_nll: list[float] | None = None,
) -> torch.Tensor:
    """(L, H, K) rise of the answer tokens' NLL per answer token when one item's heads take each
    candidate window at the positions that predict the answer, shared equally among the item's heads.

    All (item, candidate) variants of one layer run as one batch over a cache of the context
    repeated for each of them. ``full_nll``, when given, receives each sequence's summed answer
    NLL at full attention (the reference of :mod:`aah.hf.calibration.repair`).
    """
    dynamic_cache = require("transformers.cache_utils").DynamicCache
    modules = attention_modules(model)
    heads = model.config.num_attention_heads
    totals = torch.zeros(len(modules), heads, len(candidates), dtype=torch.float64)
    answer_tokens = 0
    with window_probe(model, sink_tokens) as set_windows, tqdm(
        total=len(sequences) * len(modules), desc="calibrate retrieval (answer loss)", disable=not progress
    ) as bar:
        for seq in sequences:
            ids = torch.tensor([seq.context + seq.question + seq.answer], dtype=torch.int64, device=model.device)
            read = ids.shape[1] - len(seq.answer) - 1  # cached: context and question but its last token
            inputs, answer = ids[:, read:-1], ids[0, read + 1 :]
            answer_tokens += len(seq.answer)
            # Candidates at or above the sequence's length are full attention: no loss.
            variants = [(i, c) for i in range(len(items)) for c, w in enumerate(candidates) if w < ids.shape[1]]
            if not variants:
                bar.update(len(modules))
                continue
            windows = torch.full((len(variants), heads), 1 << 30, dtype=torch.int64)
            for v, (i, c) in enumerate(variants):
                windows[v, list(items[i])] = int(candidates[c])
            # Full layers everywhere (no config): a sliding layer's own cache could not be cut back
            # after each answer, and the probe's masks keep each layer's sliding window.
            cache = dynamic_cache()
            set_windows({})
            model(ids[:, :read], past_key_values=cache, use_cache=True, logits_to_keep=1)  # the cache alone counts
            base = float(answer_token_nll(model, cache, inputs, answer)[0])
            if full_nll is not None:
                full_nll.append(base)
            cache.batch_repeat_interleave(len(variants))
            batch = inputs.expand(len(variants), -1)
            for layer in range(len(modules)):
                set_windows({layer: windows})
                rise = (answer_token_nll(model, cache, batch, answer).double() - base).clamp_min(0.0).cpu()
                for v, (i, c) in enumerate(variants):
                    totals[layer, list(items[i]), c] += float(rise[v]) / len(items[i])
                bar.update()
            set_windows({})
    return (totals / answer_tokens).float()
