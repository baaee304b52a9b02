"""Synthetic long-range retrieval tasks for a causal LM, generated offline and seeded.

Every sample is a prompt of token ids of the model's own tokenizer plus the answers its greedy
continuation must contain. The tasks follow the passkey test of Landmark Attention and the
synthetic tasks of RULER:

* ``passkey``: repetitive filler ("The grass is green. The sky is blue. ..."), one sentence
  "The pass key is NNNNN. Remember it. NNNNN is the pass key." at the requested depth, then
  "What is the pass key? The pass key is"; the answer is the 5-digit number.
* ``niah_single``: the same filler, one needle "One of the special magic numbers for KEY is:
  NNNNNNN." and the question for KEY; the answer is the 7-digit number.
* ``niah_multikey``: four needles with different keys; one of them (the one at the requested
  depth) is asked.
* ``niah_multivalue``: four needles with one key and four numbers (the first at the requested
  depth); every number must be given.
* ``niah_text``: ``niah_single`` with natural text (the held-out ``val`` split of the
  bundled Shakespeare corpus) instead of repetitive filler.
* ``vt``: variable tracking: a chain "VAR A = 12345." ... "VAR B = VAR A." ... of four
  variables in the filler (the first assignment at the requested depth, the others after it);
  every variable that holds the value must be named.

``length`` is the whole context in tokens: the prompt takes ``length - max_new_tokens`` and
the greedy answer the rest, so a sample fits the model's context. The depth is the share of the filler (the haystack, between the task's
introduction and its question) that comes before the needle. The filler is added in whole sentences (lines, for
natural text) and needles go between them, at the boundary nearest to the requested depth; a
sample records the depth it really got. Everything is deterministic
from ``(seed, task, length, depth index, trial)``.

The calibration in :mod:`aah.hf.calibration.answer_loss` uses other filler, needle wording and
key formats (see there), so the windows are not tuned to these templates.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "TASKS",
    "REPEAT_FILLER",
    "Sample",
    "build_sample",
    "build_samples",
    "check_tasks",
    "is_correct",
    "Template",
]

TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "niah_text", "vt")

#: The Landmark Attention passkey filler, one sentence per unit.
REPEAT_FILLER = (
    " The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.", " There and back again.",
)
#: The corpus (and split) of ``niah_text``'s natural filler: held out from calibration text.
TEXT_FILLER = ("shakespeare", "val")

_KEY_WORDS = (
    "amber", "brisk", "cobalt", "dusty", "eager", "fabled", "gentle", "hollow", "ivory", "jolly", "keen", "lunar",
    "mellow", "noble", "olive", "polar", "quiet", "rapid", "silent", "tidal", "urban", "vivid", "woven", "young",
)
_KEY_NOUNS = (
    "anchor", "bridge", "canyon", "dragon", "ember", "falcon", "garden", "harbor", "island", "jungle", "kettle",
    "lantern", "meadow", "needle", "orchard", "pepper", "quartz", "river", "saddle", "temple", "valley", "willow",
)


@dataclass(frozen=True)
class Sample:
    """One prompt and what its greedy continuation must contain."""

    task: str
    length: int  # the whole context in tokens: prompt + max_new_tokens
    depth: float  # the requested depth of the asked needle, in [0, 1]
    trial: int
    input_ids: tuple[int, ...]
    answers: tuple[str, ...]  # every one must appear as a whole word of the output
    max_new_tokens: int
    needle_depth: float  # where the asked needle really went: the share of the filler before it

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Template:
    """The wording of one family of retrieval prompts (the evaluation's, or the calibration's)."""

    intro: str
    needle: Callable[[str, str], str]  # (key, value) -> needle sentence
    question: Callable[[str, int], str]  # (key, number of values) -> question text
    max_new_tokens: int = 10
    answers_per_key: int = 1
    filler: str = "repeat"  # "repeat" or "text"
    distractors: int = 0  # needles with other keys


def _magic_question(key: str, count: int) -> str:
    if count == 1:
        return (f" What is the special magic number for {key} mentioned in the provided text?"
                f" The special magic number for {key} mentioned in the provided text is")
    return (f" What are all the special magic numbers for {key} mentioned in the provided text?"
            f" The special magic numbers for {key} mentioned in the provided text are")


_NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them."
               " I will quiz you about the numbers afterwards.\n")
_MAGIC = Template(
    intro=_NIAH_INTRO,
    needle=lambda key, value: f" One of the special magic numbers for {key} is: {value}.",
    question=_magic_question,
)

TEMPLATES: dict[str, Template] = {
    "passkey": Template(
        intro=("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it."
               " I will quiz you about the important information there.\n"),
        needle=lambda key, value: f" The pass key is {value}. Remember it. {value} is the pass key.",
        question=lambda key, count: " What is the pass key? The pass key is",
        max_new_tokens=8,
    ),
    "niah_single": _MAGIC,
    "niah_multikey": Template(**{**_MAGIC.__dict__, "distractors": 3}),
    "niah_multivalue": Template(**{**_MAGIC.__dict__, "answers_per_key": 4, "max_new_tokens": 44}),
    "niah_text": Template(**{**_MAGIC.__dict__, "filler": "text"}),
}


def check_tasks(tasks: Sequence[str]) -> tuple[str, ...]:
    """``tasks`` as a tuple, or ``ValueError`` naming the unknown ones and the allowed values."""
    tasks = tuple(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks must be among {', '.join(TASKS)}; got {', '.join(unknown) or 'none'}")
    return tasks


def is_correct(sample: Sample, output: str) -> bool:
    """Whether every answer of ``sample`` is a whole word (letters and digits) of ``output``."""
    words = set(re.findall(r"[A-Za-z0-9]+", output))
    return all(answer in words for answer in sample.answers)


class TokenCache:
    """Token ids of text pieces, memoised per tokenizer (a piece is tokenized on its own)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[str, tuple[int, ...]] = {}

    def __call__(self, text: str) -> tuple[int, ...]:
        ids = self._cache.get(text)
        if ids is None:
            ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            self._cache[text] = ids
        return ids

    def prefix(self) -> tuple[int, ...]:
        """The special tokens the tokenizer puts before a text (a BOS token, or nothing)."""
        with_special = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        plain = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        return tuple(with_special[: len(with_special) - len(plain)]) if with_special[-len(plain):] == plain else ()


_TOKENS: dict[int, TokenCache] = {}


def token_cache(tokenizer) -> TokenCache:
    """The :class:`TokenCache` of ``tokenizer`` (one per tokenizer object)."""
    found = _TOKENS.get(id(tokenizer))
    if found is None or found.tokenizer is not tokenizer:
        found = _TOKENS[id(tokenizer)] = TokenCache(tokenizer)
    return found


@lru_cache(maxsize=4)
def corpus_lines(corpus: str, split: str) -> tuple[str, ...]:
    """The non-empty lines of a corpus split, each as a filler unit starting with a newline."""
    from ...data.corpora import load_corpus

    lines = []
    for doc in load_corpus(corpus, split).documents:
        lines.extend("\n" + line.strip() for line in doc.text.splitlines() if line.strip())
    if not lines:
        raise ValueError(f"corpus {corpus!r} ({split} split) has no text")
    return tuple(lines)


def _filler_units(kind: str, rng: random.Random, text_source: tuple[str, str]) -> Callable[[int], str]:
    """unit(i): the i-th filler unit, repetitive sentences or consecutive corpus lines from a seeded offset."""
    if kind == "repeat":
        return lambda i: REPEAT_FILLER[i % len(REPEAT_FILLER)]
    lines = corpus_lines(*text_source)
    start = rng.randrange(len(lines))
    return lambda i: lines[(start + i) % len(lines)]


def assemble(
    tok: TokenCache,
    budget: int,
    units: Callable[[int], str],
    needles: Sequence[tuple[float, str]],
    intro: str,
    question: str,
) -> tuple[list[int], list[float]]:
    """(ids, depths): intro, filler with each ``(depth, text)`` needle at the unit boundary nearest
    to its depth, question; ``budget`` tokens at most. ``depths[i]`` is where needle ``i`` really
    went: the share of the filler tokens before it."""
    head, tail = tok(intro), tok(question)
    needle_ids = [tok(text) for _, text in needles]
    room = budget - len(head) - len(tail) - sum(len(n) for n in needle_ids)
    if room < 0:
        raise ValueError(f"a context of {budget} prompt tokens cannot hold this task's needles and question")
    filler: list[tuple[int, ...]] = []
    used = 0
    while True:
        unit = tok(units(len(filler)))
        if used + len(unit) > room:
            break
        filler.append(unit)
        used += len(unit)
    bounds = [0]
    for unit in filler:
        bounds.append(bounds[-1] + len(unit))
    # Needles in depth order; ties keep their given order.
    order = sorted(range(len(needles)), key=lambda i: needles[i][0])
    at_boundary = {}
    for i in order:
        target = needles[i][0] * used
        at_boundary[i] = min(range(len(bounds)), key=lambda b: abs(bounds[b] - target))
    ids: list[int] = list(head)
    pending = sorted(order, key=lambda i: (at_boundary[i], order.index(i)))
    p = 0
    for b in range(len(bounds)):
        while p < len(pending) and at_boundary[pending[p]] == b:
            ids.extend(needle_ids[pending[p]])
            p += 1
        if b < len(filler):
            ids.extend(filler[b])
    ids.extend(tail)
    return ids, [bounds[at_boundary[i]] / max(used, 1) for i in range(len(needles))]


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(_KEY_WORDS)}-{rng.choice(_KEY_NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _variable(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name


def _seeded(seed: int, task: str, length: int, depth_index: int, trial: int) -> random.Random:
    return random.Random(f"{seed}/{task}/{length}/{depth_index}/{trial}")


def build_sample(
    tokenizer,
    task: str,
    length: int,
    depth: float,
    *,
    seed: int = 0,
    depth_index: int = 0,
    trial: int = 0,
    text_source: tuple[str, str] = TEXT_FILLER,
) -> Sample:
    """One sample of ``task`` whose prompt and answer fill ``length`` tokens, needle at ``depth``."""
    check_tasks([task])
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = _seeded(seed, task, length, depth_index, trial)
    tok = token_cache(tokenizer)
    if task == "vt":
        return _variable_tracking(tok, rng, length, depth, trial, depth_index)
    template = TEMPLATES[task]
    prefix = tok.prefix()
    budget = length - template.max_new_tokens - len(prefix)
    digits = 5 if task == "passkey" else 7
    taken: set[str] = set()
    key = _key(rng, taken)
    values = [_number(rng, digits) for _ in range(template.answers_per_key)]
    needles = [(depth, template.needle(key, values[0]))]
    needles += [(rng.uniform(0.05, 0.95), template.needle(key, v)) for v in values[1:]]
    needles += [(rng.uniform(0.05, 0.95), template.needle(_key(rng, taken), _number(rng, digits)))
                for _ in range(template.distractors)]
    question = template.question(key, len(values))
    if template.filler == "text":  # natural text comes in lines: needles and question start their own
        needles = [(d, "\n" + text.lstrip()) for d, text in needles]
        question = "\n" + question.lstrip()
    units = _filler_units(template.filler, rng, text_source)
    ids, depths = assemble(tok, budget, units, needles, template.intro, question)
    return Sample(task, length, depth, trial, tuple(prefix) + tuple(ids), tuple(values), template.max_new_tokens,
                  depths[0])


def _variable_tracking(tok: TokenCache, rng: random.Random, length: int, depth: float, trial: int,
                       depth_index: int) -> Sample:
    """A chain of four variables holding one 5-digit value; the first assignment at ``depth``."""
    hops, max_new = 4, 30
    prefix = tok.prefix()
    taken: set[str] = set()
    names = [_variable(rng, taken) for _ in range(hops)]
    value = _number(rng, 5)
    later = sorted(rng.uniform(depth, max(depth, 0.95)) for _ in range(hops - 1))
    needles = [(depth, f" VAR {names[0]} = {value}.")]
    needles += [(d, f" VAR {names[i + 1]} = VAR {names[i]}.") for i, d in enumerate(later)]
    intro = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n")
    question = (f" Question: Find all variables that are assigned the value {value} in the text above."
                f" Answer: According to the chain(s) of variable assignment in the text above, {hops} variables"
                f" are assigned the value {value}, they are:")
    ids, depths = assemble(tok, length - max_new - len(prefix), _filler_units("repeat", rng, TEXT_FILLER),
                           needles, intro, question)
    return Sample("vt", length, depth, trial, tuple(prefix) + tuple(ids), tuple(names), max_new, depths[0])


def build_samples(
    tokenizer,
    tasks: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    *,
    seed: int = 0,
) -> list[Sample]:
    """Every (task, length, depth, trial) sample, in that order; ``trials`` samples per cell."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    return [
        build_sample(tokenizer, task, length, depth, seed=seed, depth_index=d, trial=t)
        for task in check_tasks(tasks)
        for length in lengths
        for d, depth in enumerate(depths)
        for t in range(trials)
    ]
