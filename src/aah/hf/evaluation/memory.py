"""The process's peak resident memory, as ``aah hf eval``, ``retrieval`` and ``calibrate`` report it."""

from __future__ import annotations

import resource
import sys

__all__ = ["format_bytes", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """The largest resident set this process has held since it started, in bytes
    (``resource.getrusage``'s ``ru_maxrss``: kibibytes on Linux, bytes on macOS). It includes
    everything the process did before the call: the model's load, its weights and the tokenizer
    as well as the measurement."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def format_bytes(count: int) -> str:
    """``count`` bytes in GiB with two decimals (MiB below 1 GiB), for the summary lines."""
    if count >= 1 << 30:
        return f"{count / (1 << 30):.2f} GiB"
    return f"{count / (1 << 20):.0f} MiB"
