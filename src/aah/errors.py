"""The one error path of the ``aah`` command line.

A command raises :class:`CLIError` for every failure a user can cause or fix (bad input, a
missing file, a damaged run folder). :func:`aah.cli.main` prints it as one line on stderr,
prefixed with the command's name, and exits with status 2. Anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

__all__ = ["CLIError", "EXIT_USAGE"]

#: Exit status of an expected failure (the same status argparse uses for bad arguments).
EXIT_USAGE = 2


class CLIError(Exception):
    """An expected failure of a command: shown as one line, exit status 2."""
