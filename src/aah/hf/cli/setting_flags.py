"""The flags ``aah hf eval`` and ``aah hf retrieval`` share for the windowed settings: sink tokens
other than the windows file's, and kept keys (:mod:`aah.hf.bridge.kept_keys`)."""

from __future__ import annotations

import argparse

from ...cli_flags import add_sink_tokens
from ...errors import CLIError

__all__ = ["add_setting_flags", "kept_keys_config", "setting_flags"]


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--sink-tokens``, ``--tail-tokens``, ``--kept-keys``, ``--kept-pool``, ``--prefill-kept``
    and ``--prefill-block``."""
    add_sink_tokens(parser, default=None,
                    help="sink tokens of the aah and uniform settings instead of the windows file's: the first "
                         "N prompt tokens stay visible to every head (for example a task instruction at the start)")
    parser.add_argument("--tail-tokens", type=int, metavar="N",
                        help="with --kept-keys: the last N prompt tokens of the aah and uniform settings read every "
                             "earlier key (ours, docs/hf.md 'Kept keys')")
    parser.add_argument("--kept-keys", type=int, metavar="K",
                        help="with --tail-tokens: each KV head keeps in its cache the K far keys those tokens read "
                             "most (scores max-pooled over --kept-pool neighbouring positions)")
    parser.add_argument("--kept-pool", type=int, metavar="P",
                        help="with --kept-keys: odd width of the max-pooling of the key scores (default 7; 1: none)")
    parser.add_argument("--prefill-kept", type=int, metavar="K",
                        help="with --kept-keys: rolling kept keys, each block of --prefill-block prompt rows also "
                             "reads the K far keys per KV head that the previous block's last --tail-tokens rows "
                             "read most (default 0: off; ours, docs/hf.md 'Rolling kept keys')")
    parser.add_argument("--prefill-block", type=int, metavar="N",
                        help="with --prefill-kept: prompt rows per block (default 512)")


def setting_flags(args: argparse.Namespace):
    """``(sink_tokens, kept_keys)`` of the flags, checked: ``--sink-tokens`` (None: the windows
    file's) and the :class:`aah.hf.bridge.kept_keys.KeptKeys` (None without kept keys)."""
    return args.sink_tokens, _kept_keys(args)


def _kept_keys(args: argparse.Namespace):
    """The :class:`aah.hf.bridge.kept_keys.KeptKeys` of the flags (``--tail-tokens`` and ``--kept-keys``
    both or neither), or ``None``."""
    from ..bridge.kept_keys import kept_keys_from

    try:
        return kept_keys_from(vars(args), lambda name: "--" + name.replace("_", "-"))
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def kept_keys_config(kept) -> dict:
    """The JSON config keys ``tail_tokens``, ``kept_keys``, ``kept_pool``, ``prefill_kept`` and
    ``prefill_block`` (None without kept keys; ``prefill_block`` None without rolling kept keys)."""
    return {
        "tail_tokens": None if kept is None else kept.tail_tokens,
        "kept_keys": None if kept is None else kept.keys_per_head,
        "kept_pool": None if kept is None else kept.pool_width,
        "prefill_kept": None if kept is None else kept.prefill_keys,
        "prefill_block": None if kept is None or not kept.prefill_keys else kept.prefill_block,
    }
