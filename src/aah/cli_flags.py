"""The flags several ``aah`` commands share, each defined here once: one meaning, one default, one check.

- ``--windows-file FILE``: a windows file written by ``aah hf calibrate`` (required);
- ``--windows W1,W2,...``: one window per head, a comma list of positive ints;
- ``--json FILE``: also write the results as JSON to FILE (``-``: stdout);
- ``--sink-tokens N``: the first N positions every head sees, an int >= 0 (default 4);
- ``--seq-len T``: tokens per sequence, an int >= 2 (default 4096);
- ``--new-tokens N``: tokens generated after each prompt, an int >= 1 (default 32);
- ``--decode-batch N``: prompts decoded together, an int >= 1 (default 4).

Every path a command will write (``--json``, ``--out``, ``--heatmap``, ``--answers``,
``--records``) is checked while the command line is read, before any work starts
(:func:`add_output`): the folder it goes in exists and may be written, a file is not a
directory (nor a folder a file), and a file's suffix is one the command can write. So a long run
is never thrown away at its last step.

A command adds a flag with its ``add_*`` function. The flag's ``type`` callable parses and checks
the text while argparse reads the command line; a bad value raises :class:`FlagError`, a
:class:`~aah.errors.CLIError` that :func:`aah.cli.main` prints as one line (the command, the
flag and the values it takes) with exit status 2. ``default=`` is there for the few commands
whose flag means "take it from elsewhere" (``None``); ``tests/test_cli_flags.py`` lists them.

With ``--json -`` the JSON alone goes to stdout, instead of the command's table. Old spellings
are refused with the new name: ``--windows FILE`` in a command that reads a windows file, and
``--json`` without a file.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import CLIError
from .hf.bridge.spec import DEFAULT_SINK_TOKENS

__all__ = [
    "DEFAULTS", "FlagError", "add_decode_batch", "add_json", "add_new_tokens", "add_output", "add_seq_len",
    "add_sink_tokens", "add_windows", "add_windows_file", "existing_file", "output_problem", "refuse", "write_json",
]

#: The default of each shared flag (``--windows-file`` is required; ``--windows`` and ``--json`` are off).
DEFAULTS = {
    "--windows-file": None,
    "--windows": None,
    "--json": None,
    "--sink-tokens": DEFAULT_SINK_TOKENS,
    "--seq-len": 4096,
    "--new-tokens": 32,
    "--decode-batch": 4,
}


class FlagError(CLIError):
    """A bad value of a flag, found while the command line is read; ``prog`` names the command."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


def _add(parser, flag: str, parse: Callable[[str], object], takes: str, into=None, **kwargs) -> None:
    """Add ``flag`` to ``parser`` (or to its group ``into``): ``parse`` turns the text into the
    value or raises ``ValueError``, and a bad text is refused as taking ``takes``."""

    def checked(text: str):
        try:
            return parse(text)
        except ValueError:
            raise FlagError(parser.prog, f"{flag} takes {takes}; got {text!r}") from None

    checked.flag = flag  # the shared flag this type parses (tests/test_cli_flags.py looks)
    (into or parser).add_argument(flag, type=checked, **kwargs)


def _int_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if int(text) < least:
            raise ValueError(text)
        return int(text)

    return parse


def _windows(text: str) -> tuple[int, ...]:
    return tuple(_int_at_least(1)(w) for w in text.split(","))


def existing_file(flag: str, text: str) -> str:
    """``text`` if it names a readable file; else ``CLIError`` saying it is missing or a directory."""
    path = Path(text)
    if path.is_dir():
        raise CLIError(f"{flag}: {text} is a directory, not a file")
    if not path.is_file():
        raise CLIError(f"{flag}: no file {text}")
    return text


def output_problem(text: str, *, folder: bool = False, suffixes: Sequence[str] = ()) -> str | None:
    """Why ``text`` cannot be written as a file (or, with ``folder``, made a folder), or ``None``."""
    path = Path(text)
    if not text:
        return "no path given"
    if folder:
        if path.exists() and not path.is_dir():
            return "it is a file, not a folder"
        parent = next(p for p in (path, *path.parents) if p.exists())  # the nearest folder that exists
        if not parent.is_dir():
            return f"{parent} is a file, not a folder"
    else:
        if path.is_dir():
            return "it is a directory"
        if suffixes and path.suffix.lower() not in suffixes:
            return f"its suffix must be one of {', '.join(suffixes)}"
        parent = path.parent
        if not parent.is_dir():
            return f"no folder {parent}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the folder {parent} cannot be written"
    return None


def add_output(parser, flag: str, *, folder: bool = False, suffixes: Sequence[str] = (), stdout: bool = False,
               bare: str | None = None, **kwargs) -> None:
    """Add ``flag``, a path the command writes, checked before any work (see the module docstring).
    ``stdout``: ``-`` means standard output; ``bare``: the message for the flag given no path."""

    def checked(text: str) -> str:
        if bare is not None and text == "":
            raise FlagError(parser.prog, bare)
        problem = None if stdout and text == "-" else output_problem(text, folder=folder, suffixes=suffixes)
        if problem is not None:
            raise FlagError(parser.prog, f"{flag}: cannot write {text!r}: {problem}")
        return text

    checked.flag = flag
    parser.add_argument(flag, type=checked, **kwargs)


def _add_int(parser, flag: str, least: int, meaning: str, default: int | None, help: str | None, metavar="N"):
    _add(parser, flag, _int_at_least(least), f"an int >= {least}", default=default, metavar=metavar,
         help=help or f"{meaning} (default {default})")


def add_windows_file(parser) -> None:
    """``--windows-file FILE`` (required), and the old ``--windows FILE`` refused with the new name."""
    def windows_file(text: str) -> str:
        try:
            return existing_file("--windows-file", text)
        except CLIError as exc:
            raise FlagError(parser.prog, f"{exc} (a windows file written by aah hf calibrate)") from None

    windows_file.flag = "--windows-file"
    parser.add_argument("--windows-file", type=windows_file, required=True, metavar="FILE",
                        help="windows file written by aah hf calibrate")
    refuse(parser, "--windows", f"--windows takes a comma list of windows now, which {parser.prog} does not; "
                                "pass the windows file as --windows-file FILE")


def add_windows(parser, *, into=None) -> None:
    """``--windows W1,W2,...``, a tuple of ints >= 1; ``into``: a group of ``parser`` to add it to."""
    _add(parser, "--windows", _windows, "a comma-separated list of positive ints W1,W2,...", into=into,
         metavar="W1,W2,...", help="comma-separated windows, one per head")


def add_json(parser) -> None:
    """``--json FILE``, ``-`` for stdout; a bare ``--json`` (its old spelling) is refused."""
    add_output(parser, "--json", stdout=True, nargs="?", const="", metavar="FILE",
               bare="--json takes FILE, as --json FILE (a file in an existing folder) or --json - (stdout)",
               help="also write the results as JSON to FILE ('-': print the JSON alone on stdout)")


def add_sink_tokens(parser, *, default: int | None = DEFAULTS["--sink-tokens"], help: str | None = None) -> None:
    """``--sink-tokens N``; ``default=None`` (and a ``help`` that says why) where the command reads them elsewhere."""
    _add_int(parser, "--sink-tokens", 0, "the first N positions stay visible to every head", default, help)


def add_seq_len(parser, *, default: int | None = DEFAULTS["--seq-len"], help: str | None = None) -> None:
    """``--seq-len T``; ``default=None`` (and a ``help`` that says how) where the command derives it."""
    _add_int(parser, "--seq-len", 2, "tokens per sequence", default, help, metavar="T")


def add_new_tokens(parser) -> None:
    """``--new-tokens N``."""
    _add_int(parser, "--new-tokens", 1, "tokens generated after each prompt", DEFAULTS["--new-tokens"], None)


def add_decode_batch(parser) -> None:
    """``--decode-batch N``."""
    _add_int(parser, "--decode-batch", 1, "prompts decoded together", DEFAULTS["--decode-batch"], None)


def refuse(parser, flag: str, message: str) -> None:
    """Refuse the old spelling ``flag`` (with or without a value) with ``message``, which names the new one."""

    def refused(text: str):
        raise FlagError(parser.prog, message)

    refused.refuses = flag
    parser.add_argument(flag, type=refused, nargs="?", const="", dest="refused_" + flag.strip("-").replace("-", "_"),
                        help=argparse.SUPPRESS)


def write_json(path: str | None, report: dict) -> None:
    """Write ``report`` as JSON to ``path`` (a ``--json`` value): ``-`` prints it, ``None`` writes nothing."""
    if path is None:
        return
    text = json.dumps(report, indent=2)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")
