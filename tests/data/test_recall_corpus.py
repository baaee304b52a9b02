"""The recall corpus (aah.data.recall) and its config knobs; its metrics are tested in tests/evaluate/."""

from __future__ import annotations

import re

import numpy as np
import pytest

from aah.config import ConfigError, load_config
from aah.data.loader import TokenDataset
from aah.data.recall import MARKUP, TEXT, VALUE, RecallDataset, RecallSpec, episode_length

T = 256


def _base(num_blocks: int = 40, seq_len: int = T) -> TokenDataset:
    # Plain "text": uppercase letters and spaces only, so every episode byte is recognisable.
    rng = np.random.default_rng(123)
    alphabet = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ ", dtype=np.uint8)
    return TokenDataset(alphabet[rng.integers(0, len(alphabet), num_blocks * seq_len + 1)], seq_len)


#: An episode's key, by key format: ``k37=`` or one byte of 0x80..0xff.
KEY_PATTERN = {"digits": rb"k(\d\d)=", "byte": rb"([\x80-\xff])"}


def _parse(block: bytes, keys: str = "digits") -> tuple[dict, list]:
    """Definitions {key: (value start, value)} and queries [(key, value start, value)] of a block."""
    key = KEY_PATTERN[keys]
    defs = {m.group(1): (m.start(2), m.group(2)) for m in re.finditer(rb"#" + key + rb"([a-z]+);", block)}
    queries = [(m.group(1), m.start(2), m.group(2)) for m in re.finditer(rb"\?" + key + rb"([a-z]+);", block)]
    return defs, queries


SPEC = RecallSpec(fraction=0.12, pairs=4, value_len=3, seed=7)


@pytest.mark.parametrize("keys", ["digits", "byte"])
def test_episodes_are_well_formed_and_annotated_as_parsed(keys):
    spec = RecallSpec(fraction=0.12 if keys == "digits" else 0.08, pairs=4, value_len=3, seed=7, keys=keys)
    assert spec.episode_len == (9 if keys == "digits" else 6)
    ds = RecallDataset(_base(), spec, "train")
    blocks = list(range(len(ds)))
    windows = ds.window(blocks)
    kind, distance, query = ds.annotations(blocks)
    seen_far = 0
    for row, w in enumerate(windows):
        raw = bytes(w.astype(np.uint8))
        defs, queries = _parse(raw, keys)
        if not queries:
            assert not defs and (kind[row] == TEXT).all()
            continue
        assert len(defs) == len(queries) == spec.pairs  # distinct keys, each defined and queried once
        expect_value = np.zeros(T + 1, dtype=bool)
        expect_dist = np.full(T + 1, -1)
        for key, start, value in queries:
            def_start, def_value = defs[key]
            assert value == def_value and def_start < start
            expect_value[start : start + len(value)] = True
            expect_dist[start : start + len(value)] = start - def_start
            seen_far += (start - def_start) * 2 >= T
        # targets are tokens 1..T of the block
        np.testing.assert_array_equal(kind[row] == VALUE, expect_value[1:])
        np.testing.assert_array_equal(distance[row], expect_dist[1:])
        assert set(np.unique(query[row][expect_value[1:]])) == set(range(spec.pairs))
        episode = np.zeros(T + 1, dtype=bool)
        for m in re.finditer(rb"[#?]" + KEY_PATTERN[keys] + rb"[a-z]+;", raw):
            episode[m.start() : m.end()] = True
        np.testing.assert_array_equal(kind[row] != TEXT, episode[1:])
        assert ((kind[row] == MARKUP) == (episode[1:] & ~expect_value[1:])).all()
    assert seen_far > 0  # some queries look back more than T/2


def test_crowded_blocks_place_every_pair():
    # The most pairs the spec allows at T = 128 (half the block in episodes, every block
    # carrying them): random placement alone fails on about one block in 10,000, here 2961.
    seq_len, pairs = 128, 5
    spec = RecallSpec(fraction=2 * pairs * 6 / seq_len, pairs=pairs, value_len=3, seed=0, keys="byte")
    spec.validate(seq_len)
    ds = RecallDataset(_base(3000, seq_len), spec, "train")
    blocks = list(range(2900, 3000))
    kind, distance, _ = ds.annotations(blocks)
    for w, row_kind in zip(ds.window(blocks), kind):
        defs, queries = _parse(bytes(w.astype(np.uint8)), "byte")
        assert len(defs) == len(queries) == pairs
        assert (row_kind == VALUE).sum() == pairs * 3
    assert (distance[kind == VALUE] >= 6).all()


def test_text_bytes_are_the_plain_block_in_order():
    base = _base()
    ds = RecallDataset(base, SPEC, "train")
    blocks = np.arange(len(ds))
    plain, mixed = base.window(blocks), ds.window(blocks)
    for row in range(len(blocks)):
        raw = bytes(mixed[row].astype(np.uint8))
        text = re.sub(rb"[#?]k\d\d=[a-z]+;", b"", raw)
        assert text == bytes(plain[row].astype(np.uint8))[: len(text)]


def test_deterministic_from_the_recall_seed_only():
    base = _base()
    a = RecallDataset(base, SPEC, "train").window(range(10))
    b = RecallDataset(base, SPEC, "train").window(range(10))
    np.testing.assert_array_equal(a, b)
    other_seed = RecallDataset(base, RecallSpec(fraction=0.12, pairs=4, seed=8), "train").window(range(10))
    assert not np.array_equal(a, other_seed)
    val = RecallDataset(base, SPEC, "val").window(range(10))
    assert not np.array_equal(a, val)
    # a block's content does not depend on which other blocks are asked for with it
    np.testing.assert_array_equal(RecallDataset(base, SPEC, "train").window([3]), a[3:4])


def test_fraction_of_tokens_in_episodes():
    spec = RecallSpec(fraction=0.06, pairs=4, value_len=3, seed=1)
    ds = RecallDataset(_base(num_blocks=400), spec, "train")
    kind, _, _ = ds.annotations(range(len(ds)))
    share = float((kind != TEXT).mean())
    assert abs(share - spec.fraction) < 0.015
    assert ds.spec.block_share(T) == pytest.approx(0.06 * T / (2 * 4 * episode_length(3)))


def test_log_uniform_distances_are_shorter_than_uniform():
    base = _base(num_blocks=200)
    dists = {}
    for name in ("uniform", "log_uniform"):
        ds = RecallDataset(base, RecallSpec(fraction=0.12, pairs=4, distance=name), "train")
        _, d, _ = ds.annotations(range(len(ds)))
        dists[name] = np.median(d[d >= 0])
    assert dists["log_uniform"] < 0.6 * dists["uniform"]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (RecallSpec(pairs=0), "data.recall_pairs"),
        (RecallSpec(pairs=20, fraction=0.1), "data.recall_pairs"),
        (RecallSpec(value_len=0), "data.recall_value_len"),
        (RecallSpec(distance="far"), "data.recall_distance"),
        (RecallSpec(fraction=0.5, pairs=4), "data.recall_fraction"),
        (RecallSpec(fraction=0.0, pairs=4), "data.recall_fraction"),
        (RecallSpec(keys="letters"), "data.recall_keys"),
        (RecallSpec(keys="byte", pairs=129), "data.recall_pairs"),
    ],
)
def test_spec_errors_name_the_field(spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        spec.validate(T)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("data.recall_distance=far", "data.recall_distance"),
        ("data.recall_pairs=200", "data.recall_pairs"),
        ("data.recall_fraction=0.9", "data.recall_fraction"),
        ("data.tokenizer=bpe", "data.tokenizer"),
        ("data.recall_keys=letters", "data.recall_keys"),
    ],
)
def test_config_rejects_bad_recall_knobs(override, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(None, ["data.corpus=shakespeare_recall", override])


def test_config_recall_spec_round_trip():
    cfg = load_config(None, ["data.corpus=shakespeare_recall", "data.recall_pairs=6", "data.recall_seed=3"])
    spec = cfg.data.recall_spec()
    assert (spec.pairs, spec.seed, spec.fraction, spec.keys) == (6, 3, 0.1, "digits")
    cfg = load_config(None, ["data.corpus=shakespeare_recall", "data.recall_keys=byte", "data.recall_fraction=0.09"])
    assert cfg.data.recall_spec().keys == "byte"
