"""A key-value recall task mixed into real text: predictions that need far context.

Some blocks of a text corpus carry *recall episodes*: ``pairs`` key-value
definitions ``#k37=qfz;`` placed at random points of the block, each queried
once later in the same block as ``?k37=qfz;``. The value bytes of a query can
only be predicted by looking back at its definition, at a *distance* (query
value start minus definition value start, in tokens) drawn over the whole block
from :data:`DISTANCES`, so some of them exceed ``T/4`` and ``T/2``: a head whose
window is shorter than the distance cannot see the definition (paper section 5:
what a per-head window cuts off).

Construction of block ``i`` (byte tokens only; a block is ``T + 1`` tokens, the
``T`` inputs and the last target, as :class:`~aah.data.loader.TokenDataset` cuts
them):

1. whether the block carries episodes, the distances, the positions, the keys
   and the values are drawn from ``numpy.random.Generator(PCG64(SeedSequence(
   [seed, split, i])))``: a function of the recall seed, the split and the block
   index only, so every regime and every training seed sees the same blocks;
2. the episode positions are filled with the episode bytes and every other
   position with the text of the plain block ``i`` in order (the text that no
   longer fits at the end is dropped).

A fraction ``fraction * T / (2 * pairs * E)`` of the blocks carries episodes
(``E`` bytes per episode), so ``fraction`` is the share of all tokens that lie
in episodes. Values are ``value_len`` lowercase letters. Keys (distinct within a
block) are written as ``keys`` says: ``digits``, ``k00`` .. ``k99`` between the
marker and ``=`` (``#k37=qfz;``: the query's value follows ``=``, as in every
episode, so finding the definition takes matching three bytes back); or
``byte``, one byte of ``0x80`` .. ``0xff``, which plain ASCII text never holds,
right before the value (``#\x9bqfz;``: the value follows a byte that occurs
nowhere else in the block but in its definition, the case a single induction
head solves).

:meth:`RecallDataset.annotations` labels every target: :data:`TEXT` (a byte of
the corpus), :data:`MARKUP` (definition bytes and the query's ``?k37=`` and
``;``: not predictable from far context, or not the measured part), or
:data:`VALUE` (a value byte of a query), with the distance and the query number
of value bytes, from which recall accuracy (all value bytes of a query right) is
computed by :mod:`aah.evaluate.recall`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .loader import TokenDataset

__all__ = [
    "DISTANCES",
    "KEY_FORMATS",
    "MARKUP",
    "RECALL_CORPORA",
    "RecallDataset",
    "RecallSpec",
    "TEXT",
    "VALUE",
    "distance_bucket",
    "episode_length",
    "BUCKET_NAMES",
]

#: Recall corpora and the plain corpus whose text they are built on.
RECALL_CORPORA = {"shakespeare_recall": "shakespeare", "bible_recall": "bible"}
#: How the definition-to-query distance is drawn: uniform over the possible
#: distances, or log-uniform (as many distances in [d, 2d) as in [2d, 4d)).
DISTANCES = ("uniform", "log_uniform")
#: How keys are written: ``k00``..``k99`` then ``=``, or one byte of 0x80..0xff.
KEY_FORMATS = ("digits", "byte")
#: Annotation codes of a target.
TEXT, MARKUP, VALUE = 0, 1, 2
#: Distance buckets of the recall accuracy, as fractions of the block length T.
BUCKET_NAMES = ("lt_quarter", "quarter_half", "gt_half")

_KEY_DIGITS = 2
_MAX_PAIRS = {"digits": 10**_KEY_DIGITS, "byte": 128}
_FIRST_KEY_BYTE = 0x80
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
_SPLIT_CODE = {"train": 0, "val": 1, "all": 2}
_PLACEMENT_TRIES = 400


def episode_length(value_len: int, keys: str = "digits") -> int:
    """Bytes of one episode: ``#k37=`` (5) or ``#`` and the key byte (2), the value, ``;``."""
    return (2 + _KEY_DIGITS + 1 if keys == "digits" else 2) + value_len + 1


def distance_bucket(distance: np.ndarray | int, seq_len: int) -> np.ndarray:
    """Bucket index (0: ``< T/4``, 1: ``T/4 .. < T/2``, 2: ``>= T/2``) of distances at block length ``T``."""
    d = np.asarray(distance) * 4
    return (d >= seq_len).astype(np.int64) + (d >= 2 * seq_len).astype(np.int64)


@dataclass(frozen=True)
class RecallSpec:
    """Knobs of the recall task (``data.recall_*`` in a run config; docs/data.md)."""

    fraction: float = 0.1
    pairs: int = 8
    value_len: int = 3
    distance: str = "uniform"
    seed: int = 0
    keys: str = "digits"

    @property
    def episode_len(self) -> int:
        return episode_length(self.value_len, self.keys)

    def validate(self, seq_len: int, prefix: str = "data.recall_") -> None:
        """Raise ``ValueError`` naming the field for knobs that cannot work at block length ``seq_len``."""
        if self.keys not in KEY_FORMATS:
            raise ValueError(f"{prefix}keys: must be one of {', '.join(KEY_FORMATS)}; got {self.keys!r}")
        most_pairs = _MAX_PAIRS[self.keys]
        if not 1 <= self.pairs <= most_pairs:
            raise ValueError(f"{prefix}pairs: must be in 1..{most_pairs} (distinct {self.keys} keys), got {self.pairs}")
        if self.value_len < 1:
            raise ValueError(f"{prefix}value_len: must be >= 1, got {self.value_len}")
        if self.distance not in DISTANCES:
            raise ValueError(f"{prefix}distance: must be one of {', '.join(DISTANCES)}; got {self.distance!r}")
        if self.seed < 0:
            raise ValueError(f"{prefix}seed: must be >= 0, got {self.seed}")
        per_block = 2 * self.pairs * self.episode_len
        if per_block * 2 > seq_len + 1:
            raise ValueError(
                f"{prefix}pairs: {self.pairs} pairs of {self.episode_len}-byte episodes take "
                f"{per_block} of the {seq_len + 1} tokens of a block; at most half may be episodes, so use "
                f"at most {(seq_len + 1) // (4 * self.episode_len)} pairs or a longer data.seq_len"
            )
        most = per_block / seq_len
        if not 0.0 < self.fraction <= most:
            raise ValueError(
                f"{prefix}fraction: must be in (0, {most:.4f}] (every block carrying {self.pairs} pairs), "
                f"got {self.fraction}"
            )

    def block_share(self, seq_len: int) -> float:
        """Fraction of the blocks that carry episodes."""
        return min(1.0, self.fraction * seq_len / (2 * self.pairs * self.episode_len))


@dataclass(frozen=True)
class _Episodes:
    starts: np.ndarray  # (2P,) first byte of each episode: definitions then queries
    content: np.ndarray  # (2P, E) the episode bytes
    distances: np.ndarray  # (P,) query value start - definition value start


def _nearest_free_pair(
    occupied: np.ndarray, E: int, d: int, lo: int, hi: int, rng: np.random.Generator, pairs: int
) -> tuple[int, int]:
    """A free (start, distance) for one pair when random tries found none: the distance nearest
    ``d`` at which both episodes fit, a start drawn among those that fit (crowded blocks only)."""
    L = occupied.size
    busy = np.concatenate([[0], np.cumsum(occupied)])
    free = busy[E:] - busy[:-E] == 0  # free[a]: positions a .. a+E-1 are free
    for dist in sorted(range(lo, hi + 1), key=lambda x: (abs(x - d), x)):
        starts = np.flatnonzero(free[: L - E - dist + 1] & free[dist : L - E + 1])
        if starts.size:
            return int(starts[rng.integers(0, starts.size)]), dist
    raise RuntimeError(f"could not place {pairs} recall pairs in a block of {L} tokens; use fewer data.recall_pairs")


class RecallDataset(TokenDataset):
    """The blocks of ``base`` with recall episodes written in (see the module docstring)."""

    def __init__(self, base: TokenDataset, spec: RecallSpec, split: str = "train") -> None:
        spec.validate(base.seq_len)
        if split not in _SPLIT_CODE:
            raise ValueError(f"split must be one of {', '.join(_SPLIT_CODE)}, got {split!r}")
        super().__init__(base.tokens, base.seq_len)
        self.spec = spec
        self.split = split
        self.episode_len = spec.episode_len
        self._share = spec.block_share(base.seq_len)

    # ------------------------------------------------------------------ generation
    def _rng(self, block: int) -> np.random.Generator:
        seq = np.random.SeedSequence([int(self.spec.seed), _SPLIT_CODE[self.split], int(block)])
        return np.random.Generator(np.random.PCG64(seq))

    def _distance(self, rng: np.random.Generator, lo: int, hi: int) -> int:
        if self.spec.distance == "uniform":
            return int(rng.integers(lo, hi + 1))
        return int(min(hi, max(lo, round(float(np.exp(rng.uniform(np.log(lo), np.log(hi + 1))))))))

    def _episodes(self, block: int) -> _Episodes | None:
        rng = self._rng(block)
        if rng.random() >= self._share:
            return None
        P, E, L = self.spec.pairs, self.episode_len, self.seq_len + 1
        lo, hi = E, L - E  # the query starts after its definition ends and ends inside the block
        occupied = np.zeros(L, dtype=bool)
        def_starts, query_starts, dists = [], [], []
        wanted = sorted((self._distance(rng, lo, hi) for _ in range(P)), reverse=True)
        for d in wanted:  # the longest first: they have the fewest places
            for attempt in range(_PLACEMENT_TRIES):
                if attempt and attempt % 40 == 0:
                    d = self._distance(rng, lo, hi)  # this distance does not fit among the others
                a = int(rng.integers(0, L - E - d + 1))
                if not (occupied[a : a + E].any() or occupied[a + d : a + d + E].any()):
                    break
            else:
                a, d = _nearest_free_pair(occupied, E, d, lo, hi, rng, P)
            occupied[a : a + E] = True
            occupied[a + d : a + d + E] = True
            def_starts.append(a)
            query_starts.append(a + d)
            dists.append(d)
        keys = rng.choice(_MAX_PAIRS[self.spec.keys], size=P, replace=False)
        values = _LETTERS[rng.integers(0, len(_LETTERS), size=(P, self.spec.value_len))]
        content = np.empty((2 * P, E), dtype=np.int64)
        for p in range(P):
            if self.spec.keys == "digits":
                key = b"k%0*d=" % (_KEY_DIGITS, int(keys[p]))
            else:
                key = bytes([_FIRST_KEY_BYTE + int(keys[p])])
            body = np.frombuffer(key, dtype=np.uint8).astype(np.int64)
            tail = np.concatenate([body, values[p].astype(np.int64), [ord(";")]])
            content[p] = np.concatenate([[ord("#")], tail])
            content[P + p] = np.concatenate([[ord("?")], tail])
        return _Episodes(np.asarray(def_starts + query_starts), content, np.asarray(dists))

    def window(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        plain = super().window(indices)
        out = plain.copy()
        E = self.episode_len
        for row, block in enumerate(np.asarray(indices, dtype=np.int64).reshape(-1)):
            ep = self._episodes(int(block))
            if ep is None:
                continue
            mask = np.zeros(self.seq_len + 1, dtype=bool)
            for s in ep.starts:
                mask[s : s + E] = True
            text = plain[row]
            out[row, ~mask] = text[: int((~mask).sum())]
            for s, c in zip(ep.starts, ep.content):
                out[row, s : s + E] = c
        return out

    def annotations(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(kind, distance, query)`` arrays of shape ``(len(indices), seq_len)``, one per target.

        ``kind`` is :data:`TEXT`, :data:`MARKUP` or :data:`VALUE`; ``distance`` the
        definition-to-query distance of a value byte (-1 elsewhere); ``query`` the
        number (0..pairs-1) of the query a value byte belongs to (-1 elsewhere).
        Target ``t`` is token ``t + 1`` of the block.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        L, E, P, V = self.seq_len + 1, self.episode_len, self.spec.pairs, self.spec.value_len
        kind = np.full((idx.size, L), TEXT, dtype=np.int8)
        distance = np.full((idx.size, L), -1, dtype=np.int64)
        query = np.full((idx.size, L), -1, dtype=np.int64)
        for row, block in enumerate(idx):
            ep = self._episodes(int(block))
            if ep is None:
                continue
            for s in ep.starts:
                kind[row, s : s + E] = MARKUP
            for p in range(P):
                v0 = int(ep.starts[P + p]) + E - 1 - V  # first value byte of query p
                kind[row, v0 : v0 + V] = VALUE
                distance[row, v0 : v0 + V] = ep.distances[p]
                query[row, v0 : v0 + V] = p
        return kind[:, 1:], distance[:, 1:], query[:, 1:]
