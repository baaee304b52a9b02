"""The data caches' files: their folder, and atomic writes (a temporary name, then :func:`os.replace`).

A file written atomically gets the permissions of any new file (``0o666`` less the user's
umask), not the ``0o600`` of :func:`tempfile.mkstemp`: records and caches shared with other
users stay readable to them when the umask says so.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "default_cache_dir"]


def default_cache_dir() -> Path:
    """``$AAH_CACHE_DIR`` if set, else ``~/.cache/aah``."""
    env = os.environ.get("AAH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "aah"


def _new_temporary(final: Path) -> Path:
    """Create an empty file of a fresh name next to ``final``; the system applies the umask to ``0o666``."""
    while True:
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path`` atomically.

    On any error the temporary file is removed and ``path`` is left untouched, so
    readers only ever see a missing file or a complete one. The file gets ``mode``
    when given, else ``0o666 & ~umask`` like any file the user creates.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temporary(final)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
