"""The data caches' files: their folder, and atomic writes (a temporary name, then :func:`os.replace`)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "default_cache_dir"]


def default_cache_dir() -> Path:
    """``$AAH_CACHE_DIR`` if set, else ``~/.cache/aah``."""
    env = os.environ.get("AAH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "aah"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], mode: int = 0o644) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path`` atomically.

    On any error the temporary file is removed and ``path`` is left untouched, so
    readers only ever see a missing file or a complete one.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
