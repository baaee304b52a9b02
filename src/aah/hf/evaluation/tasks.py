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
introduction and its question) that comes before the needle. The filler is added in whole units (a sentence of
``repeat``, a line of the other fillers) and needles go between them, at the boundary nearest to the requested depth; a
sample records the depth it really got. Everything is deterministic
from ``(seed, task, length, depth index, trial)`` and the filler.

Fillers (the haystack's genre, ``filler=`` of :func:`build_sample`, ``aah hf retrieval --filler``);
all are built offline from what is installed and are deterministic from the sample's seeded rng:

============  ==================================================================================
``repeat``    the default: Landmark Attention's five sentences ("The grass is green. The sky is
              blue. ...") over and over; one unit is a sentence
``prose``     consecutive lines of the King James Bible (``bible`` corpus, held-out ``val``
              split: the calibration's needles lie in its ``train`` split) from a seeded line
``dialogue``  consecutive lines of Shakespeare (``shakespeare`` corpus, ``val`` split) from a
              seeded line: the filler of ``niah_text``
``code``      consecutive non-blank lines of Python source from a seeded line: the standard
              library modules of :data:`CODE_MODULES`, in that order, as the running Python
              ships them (lines with a run of five or more digits left out)
``table``     Markdown table rows made from fixed word lists ("| Lisbon | granary | 1846 | 312
              | 72.5 |"), a header row before every 30 to 50 rows; numbers of at most 4 digits
``list``      to-do and packing lists made from fixed word lists: a title line ("Errands for
              Tuesday:") and 3 to 9 items, bulleted ("- pack the spare ladder") or numbered
              ("3. call the ferry office"); numbers of one digit
============  ==================================================================================

Every filler but ``repeat`` is line-based: its units start with a newline, and so do the
needles and the question, which thus start their own line. The needles (keys and values) of a
sample do not depend on the filler: the rng draws them first and only then what the filler
needs (a start line, or the seed of the generated rows), so one ``(seed, task, length, depth
index, trial)`` asks the same fact under every filler and only the haystack changes, and
``repeat`` (which draws nothing) gives the samples it always gave. ``niah_text`` has its own
filler, ``dialogue``: it accepts ``repeat`` (the default) or ``dialogue`` and is the same sample
under both; with another filler ask ``niah_single``. The fillers' numbers never have five or
more digits, so none reads as an answer (5-digit pass keys and variable values, 7-digit magic
numbers).

The calibration in :mod:`aah.hf.calibration.answer_loss` uses other filler, needle wording and
key formats (see there), so the windows are not tuned to these templates.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "TASKS",
    "FILLERS",
    "CODE_MODULES",
    "REPEAT_FILLER",
    "Sample",
    "build_sample",
    "build_samples",
    "check_filler",
    "check_tasks",
    "filler_units",
    "is_correct",
    "Template",
]

TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "niah_text", "vt")

#: The Landmark Attention passkey filler, one sentence per unit.
REPEAT_FILLER = (
    " The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.", " There and back again.",
)
#: The haystack genres (see the module's docstring); ``repeat`` is the default.
FILLERS = ("repeat", "prose", "dialogue", "code", "table", "list")
#: The corpus and split of the corpus fillers: held out from calibration text.
CORPUS_FILLERS = {"prose": ("bible", "val"), "dialogue": ("shakespeare", "val")}
#: The corpus (and split) of ``niah_text``'s natural filler.
TEXT_FILLER = CORPUS_FILLERS["dialogue"]
#: The standard library modules whose source the ``code`` filler reads, in this order.
CODE_MODULES = (
    "textwrap", "json.decoder", "json.encoder", "csv", "difflib", "calendar", "fractions", "shlex", "heapq",
    "bisect", "graphlib", "sched", "queue", "glob", "reprlib", "string", "argparse",
)

_KEY_WORDS = (
    "amber", "brisk", "cobalt", "dusty", "eager", "fabled", "gentle", "hollow", "ivory", "jolly", "keen", "lunar",
    "mellow", "noble", "olive", "polar", "quiet", "rapid", "silent", "tidal", "urban", "vivid", "woven", "young",
)
_KEY_NOUNS = (
    "anchor", "bridge", "canyon", "dragon", "ember", "falcon", "garden", "harbor", "island", "jungle", "kettle",
    "lantern", "meadow", "needle", "orchard", "pepper", "quartz", "river", "saddle", "temple", "valley", "willow",
)


# The generated fillers' words; none is a word of the needles' keys.
_CITIES = (
    "Lisbon", "Oslo", "Quito", "Nairobi", "Hanoi", "Perth", "Lima", "Tunis", "Riga", "Dakar", "Porto", "Cusco",
    "Bergen", "Ghent", "Turku", "Cork", "Graz", "Kyoto", "Pune", "Accra", "Hobart", "Leeds", "Dublin", "Krakow",
)
_SITES = (
    "granary", "lighthouse", "market", "station", "library", "museum", "theatre", "mill", "chapel", "tower",
    "school", "bakery", "arsenal", "observatory", "pier", "foundry", "cellar", "stable", "gallery", "brewery",
)
_TABLE_HEADER = "\n| city | site | built | visitors | rating |\n| --- | --- | --- | --- | --- |"
_LIST_TITLES = (
    "Errands for {day}:", "Packing list for {city}:", "To do before {day}:", "Shopping list for {day}:",
    "Checklist for the {site} in {city}:", "Notes for {day} morning:",
)
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_VERBS = (
    "pack", "check", "fix", "clean", "label", "return", "order", "sort", "paint", "wrap", "count", "move", "oil",
    "measure", "borrow", "polish", "replace", "fold", "weigh", "tie",
)
_THINGS = (
    "ladder", "basket", "blanket", "bucket", "drawer", "fence", "gate", "jacket", "kite", "mirror", "parcel",
    "rope", "shovel", "teapot", "toolbox", "umbrella", "wagon", "window", "boots", "candles",
)
_COLOURS = ("blue", "red", "green", "spare", "old", "small", "heavy", "striped", "glass", "paper", "brass", "tall")
_OFFICES = ("ferry", "post", "tax", "land", "school", "rail", "census", "weather", "customs")


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
    filler: str = "repeat"  # the haystack's genre, one of FILLERS

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
    filler: str | None = None  # the task's own filler (one of FILLERS), or None: the one asked for
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
    "niah_text": Template(**{**_MAGIC.__dict__, "filler": "dialogue"}),
}


def check_tasks(tasks: Sequence[str]) -> tuple[str, ...]:
    """``tasks`` as a tuple, or ``ValueError`` naming the unknown ones and the allowed values."""
    tasks = tuple(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks must be among {', '.join(TASKS)}; got {', '.join(unknown) or 'none'}")
    return tasks


def check_filler(filler: str, tasks: Sequence[str] = ()) -> str:
    """``filler``, or ``ValueError`` naming the allowed values (or, for a task with a filler of its
    own, ``niah_text``, naming the task to ask instead)."""
    if filler not in FILLERS:
        raise ValueError(f"filler must be one of {', '.join(FILLERS)}; got {filler!r}")
    for task in tasks:
        own = task_filler(task, filler)
        if filler not in ("repeat", own):
            raise ValueError(f"{task} has its own filler, {own}; for the {filler} filler ask niah_single")
    return filler


def task_filler(task: str, filler: str = "repeat") -> str:
    """The filler ``task``'s samples get when ``filler`` is asked for: the task's own, if it has one."""
    template = TEMPLATES.get(task)
    return template.filler if template is not None and template.filler is not None else filler


def is_correct(sample: Sample, output: str) -> bool:
    """Whether every answer of ``sample`` is a whole word (letters and digits) of ``output``."""
    words = set(re.findall(r"[A-Za-z0-9]+", output))
    return all(answer in words for answer in sample.answers)


class TokenCache:
    """Token ids of text pieces, memoised per tokenizer (a piece is tokenized on its own). The
    memo is emptied when it reaches ``max_pieces`` (generated fillers make new pieces without end)."""

    def __init__(self, tokenizer, max_pieces: int = 1 << 18) -> None:
        self.tokenizer = tokenizer
        self.max_pieces = max_pieces
        self._cache: dict[str, tuple[int, ...]] = {}

    def __call__(self, text: str) -> tuple[int, ...]:
        ids = self._cache.get(text)
        if ids is None:
            ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(self._cache) >= self.max_pieces:
                self._cache.clear()
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


_LONG_NUMBER = re.compile(r"\d{5,}")


@lru_cache(maxsize=1)
def code_lines() -> tuple[str, ...]:
    """The non-blank lines of the source of :data:`CODE_MODULES`, in order, each as a unit starting
    with a newline (right-stripped, indentation kept); lines with a run of 5 or more digits are left out."""
    lines = []
    for name in CODE_MODULES:
        try:
            source = inspect.getsource(importlib.import_module(name))
        except (OSError, TypeError) as exc:
            raise FileNotFoundError(f"the code filler reads the source of the standard library module {name}, "
                                    f"which this Python does not ship ({exc})") from None
        lines.extend("\n" + line.rstrip() for line in source.splitlines()
                     if line.strip() and not _LONG_NUMBER.search(line))
    return tuple(lines)


def _table_rows(rng: random.Random) -> Iterator[str]:
    while True:
        yield _TABLE_HEADER
        for _ in range(rng.randrange(30, 51)):
            yield (f"\n| {rng.choice(_CITIES)} | {rng.choice(_SITES)} | {rng.randrange(1700, 2025)} | "
                   f"{rng.randrange(10, 1000)} | {rng.randrange(10, 100)}.{rng.randrange(10)} |")


def _list_items(rng: random.Random) -> Iterator[str]:
    while True:
        title = rng.choice(_LIST_TITLES).format(day=rng.choice(_DAYS), city=rng.choice(_CITIES),
                                                site=rng.choice(_SITES))
        yield "\n" + title
        numbered = rng.random() < 0.5
        for n in range(1, rng.randrange(3, 10) + 1):
            if rng.random() < 0.25:
                item = f"call the {rng.choice(_OFFICES)} office"
            else:
                item = f"{rng.choice(_VERBS)} the {rng.choice(_COLOURS)} {rng.choice(_THINGS)}"
            yield f"\n{n}. {item}" if numbered else f"\n- {item}"


def _stream(units: Iterator[str]) -> Callable[[int], str]:
    """unit(i) of an endless generator, whatever order the units are asked in."""
    made: list[str] = []

    def unit(i: int) -> str:
        while len(made) <= i:
            made.append(next(units))
        return made[i]

    return unit


def filler_units(filler: str, rng: random.Random) -> Callable[[int], str]:
    """unit(i): the i-th unit of ``filler``'s haystack. ``repeat`` draws nothing from ``rng``; a
    corpus or ``code`` filler draws its start line, ``table`` and ``list`` the seed of their rows."""
    check_filler(filler)
    if filler == "repeat":
        return lambda i: REPEAT_FILLER[i % len(REPEAT_FILLER)]
    if filler in ("table", "list"):
        rows = _table_rows if filler == "table" else _list_items
        return _stream(rows(random.Random(rng.getrandbits(64))))
    lines = code_lines() if filler == "code" else corpus_lines(*CORPUS_FILLERS[filler])
    start = rng.randrange(len(lines))
    return lambda i: lines[(start + i) % len(lines)]


def _own_lines(filler: str, needles: list[tuple[float, str]], question: str) -> tuple[list[tuple[float, str]], str]:
    """Needles and question as the filler takes them: each on its own line for a line-based filler
    (all but ``repeat``), as they are for ``repeat``."""
    if filler == "repeat":
        return needles, question
    return [(d, "\n" + text.lstrip()) for d, text in needles], "\n" + question.lstrip()


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
    filler: str = "repeat",
) -> Sample:
    """One sample of ``task`` whose prompt and answer fill ``length`` tokens, needle at ``depth``,
    in the haystack of ``filler`` (one of :data:`FILLERS`; ``niah_text`` takes its own)."""
    check_tasks([task])
    check_filler(filler, [task])
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    filler = task_filler(task, filler)
    # The seed leaves the filler out: the needles are the same under every filler (drawn first).
    rng = _seeded(seed, task, length, depth_index, trial)
    tok = token_cache(tokenizer)
    if task == "vt":
        return _variable_tracking(tok, rng, length, depth, trial, filler)
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
    needles, question = _own_lines(filler, needles, template.question(key, len(values)))
    units = filler_units(filler, rng)
    ids, depths = assemble(tok, budget, units, needles, template.intro, question)
    return Sample(task, length, depth, trial, tuple(prefix) + tuple(ids), tuple(values), template.max_new_tokens,
                  depths[0], filler)


def _variable_tracking(tok: TokenCache, rng: random.Random, length: int, depth: float, trial: int,
                       filler: str) -> Sample:
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
    needles, question = _own_lines(filler, needles, question)
    ids, depths = assemble(tok, length - max_new - len(prefix), filler_units(filler, rng), needles, intro, question)
    return Sample("vt", length, depth, trial, tuple(prefix) + tuple(ids), tuple(names), max_new, depths[0], filler)


def build_samples(
    tokenizer,
    tasks: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    *,
    seed: int = 0,
    filler: str = "repeat",
) -> list[Sample]:
    """Every (task, length, depth, trial) sample, in that order; ``trials`` samples per cell, in
    the haystack of ``filler``."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    check_filler(filler, check_tasks(tasks))
    return [
        build_sample(tokenizer, task, length, depth, seed=seed, depth_index=d, trial=t, filler=filler)
        for task in check_tasks(tasks)
        for length in lengths
        for d, depth in enumerate(depths)
        for t in range(trials)
    ]
