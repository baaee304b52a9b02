"""Statistics behind the report tables: seed means, seed-paired differences, window buckets.

The paper reports single seed-0 numbers (Tables 4, 5 and 6, sections 7.2-7.6).
This module supplies what is needed to report several seeds honestly:

* :func:`mean` and :func:`sample_std` (``n - 1`` denominator; undefined for one value);
* :func:`paired_difference`: the difference of a regime to the full-attention
  reference, **paired by seed**. Only seeds present in both groups are used;
  per seed ``d_s = x_regime(s) - x_full(s)`` (negative = lower than full
  attention), and the 95% confidence interval is the Student-t interval
  ``mean(d) +/- t_{0.975, n-1} * sd(d) / sqrt(n)``. With one common seed the
  difference is reported without an interval;
* :func:`t_quantile_975`: the two-sided 95% Student-t quantile, written out
  here so that no statistics library is needed: exact tabulated values for
  1-30 degrees of freedom and, above 30, the Cornish-Fisher expansion of the
  t quantile around the normal quantile (Abramowitz & Stegun 26.7.5), which
  is within 1e-5 of the exact value there;
* :func:`bucket_fractions`: the share of (layer, head) assignments falling on
  each candidate window, the quantity drawn in the paper's Figure 4
  (section 7.4). Windows are matched exactly; a window that is not one of the
  candidates is counted in an ``"other"`` bucket, which is present only when
  it is non-empty (no rounding to a neighbouring candidate, so an unexpected
  window is visible rather than hidden).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..windows import OTHER_BUCKET, bucket_fractions

__all__ = [
    "OTHER_BUCKET",
    "PairedDifference",
    "acr_from_fractions",
    "bucket_fractions",
    "bucket_sort_key",
    "mean",
    "mean_fractions",
    "paired_difference",
    "sample_std",
    "t_quantile_975",
]


# Two-sided 95% (upper 0.975) quantiles of Student's t for 1..30 degrees of freedom.
_T975_TABLE = (
    12.706204736,
    4.302652730,
    3.182446305,
    2.776445105,
    2.570581836,
    2.446911851,
    2.364624252,
    2.306004135,
    2.262157163,
    2.228138852,
    2.200985160,
    2.178812830,
    2.160368656,
    2.144786688,
    2.131449546,
    2.119905299,
    2.109815578,
    2.100922040,
    2.093024054,
    2.085963447,
    2.079613845,
    2.073873068,
    2.068657610,
    2.063898562,
    2.059538553,
    2.055529439,
    2.051830516,
    2.048407142,
    2.045229642,
    2.042272456,
)
_Z975 = 1.959963984540054  # upper 0.975 quantile of the standard normal


def t_quantile_975(df: int) -> float:
    """Upper 0.975 quantile of Student's t with ``df`` degrees of freedom (95% two-sided)."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be a positive int, got {df!r}")
    if df <= len(_T975_TABLE):
        return _T975_TABLE[df - 1]
    return _cornish_fisher_t(_Z975, df)


def _cornish_fisher_t(z: float, df: int) -> float:
    """t quantile from the normal quantile ``z`` by the Cornish-Fisher expansion in ``1/df``."""
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def mean(values: Iterable[float]) -> float | None:
    """Arithmetic mean, or ``None`` for no values."""
    vals = [float(v) for v in values]
    return sum(vals) / len(vals) if vals else None


def sample_std(values: Iterable[float]) -> float | None:
    """Sample standard deviation (``n - 1`` denominator), or ``None`` for fewer than two values."""
    vals = [float(v) for v in values]
    if len(vals) < 2:
        return None
    m = sum(vals) / len(vals)
    return math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


@dataclass(frozen=True)
class PairedDifference:
    """A seed-paired difference ``regime - reference`` and its 95% Student-t interval."""

    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float
    std: float | None
    half_width: float | None

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def ci(self) -> tuple[float, float] | None:
        """``(low, high)`` of the 95% interval, or ``None`` with a single seed."""
        if self.half_width is None:
            return None
        return (self.mean - self.half_width, self.mean + self.half_width)

    @property
    def significant(self) -> bool | None:
        """Whether the 95% interval excludes 0; ``None`` when there is no interval."""
        ci = self.ci
        if ci is None:
            return None
        return ci[0] > 0 or ci[1] < 0


def paired_difference(
    values: Mapping[int, float], reference: Mapping[int, float]
) -> PairedDifference | None:
    """Difference ``values[s] - reference[s]`` over the seeds ``s`` present in both.

    Returns ``None`` when no seed is shared. With ``n >= 2`` shared seeds the
    half-width is ``t_{0.975, n-1} * sd / sqrt(n)``; with one it is ``None``.
    """
    seeds = tuple(sorted(set(values) & set(reference)))
    if not seeds:
        return None
    diffs = tuple(float(values[s]) - float(reference[s]) for s in seeds)
    m = sum(diffs) / len(diffs)
    sd = sample_std(diffs)
    half = None if sd is None else t_quantile_975(len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return PairedDifference(seeds=seeds, differences=diffs, mean=m, std=sd, half_width=half)


def bucket_sort_key(key: str) -> tuple[int, int]:
    """Order bucket keys numerically, with ``"other"`` last."""
    return (1, 0) if key == OTHER_BUCKET else (0, int(key))


def mean_fractions(fractions: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Average several bucket-fraction dicts; a bucket missing from one dict counts as 0 there."""
    if not fractions:
        return {}
    keys = sorted({k for f in fractions for k in f}, key=bucket_sort_key)
    return {k: sum(float(f.get(k, 0.0)) for f in fractions) / len(fractions) for k in keys}


def acr_from_fractions(fractions: Mapping[str, float], seq_len: int) -> float | None:
    """ACR reconstructed from bucket fractions as ``sum_W f_W * min(W, T) / T`` (paper Table 6).

    Returns ``None`` when some mass sits in the ``"other"`` bucket (its windows are unknown).
    """
    if float(fractions.get(OTHER_BUCKET, 0.0)) > 0 or seq_len <= 0:
        return None
    return sum(float(f) * min(int(w), seq_len) / seq_len for w, f in fractions.items()
               if w != OTHER_BUCKET)
