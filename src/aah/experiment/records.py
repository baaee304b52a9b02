"""Run records: the files kept of a finished run, and the checksum manifest that vouches for them.

A record folder (``aah experiment --records DIR``: ``DIR/<row>/seed<k>``) holds
:data:`RECORD_FILES` and, written last, ``manifest.json``::

    {"format": 1,
     "files": {"config.yaml": {"bytes": 1534, "sha256": "9f2c..."}, "eval.json": {...}, ...}}

:func:`copy_record` assembles a record in a staging folder, writes the manifest there once
every file is in place, and renames the folder into place. :func:`verify_record` checks a
record against its manifest: a missing manifest (a record never completed), a missing file,
another size (truncated) or another sha256 (edited) raises :class:`RecordError` naming the
file. A record is never used unverified. Run folders themselves carry no manifest: ``aah
train`` and ``aah eval`` go on writing into them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

from ..data._files import atomic_path
from ..errors import CLIError
from ..train.checkpoint import sha256_file

__all__ = ["MANIFEST", "RECORD_FILES", "RecordError", "copy_record", "verify_record", "write_json",
           "write_manifest"]

#: What a record keeps of a finished run: everything the report reads, no checkpoints.
RECORD_FILES = ("config.yaml", "meta.json", "metrics.jsonl", "eval.json")
MANIFEST = "manifest.json"
#: Version of the manifest's layout.
FORMAT = 1


class RecordError(CLIError):
    """A record that is incomplete, damaged or unreadable; the message names the file and why."""


def write_json(path: Path, data: dict) -> None:
    """``data`` as indented JSON with sorted keys, written atomically with the user's umask."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_manifest(folder: Path) -> Path:
    """Write ``folder/manifest.json``: the size and sha256 of every other file of the folder."""
    folder = Path(folder)
    files = {
        path.name: {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
        for path in sorted(folder.iterdir())
        if path.is_file() and path.name != MANIFEST and not path.name.startswith(".")
    }
    write_json(folder / MANIFEST, {"format": FORMAT, "files": files})
    return folder / MANIFEST


def _manifest_files(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecordError(f"{path} is missing (the record was never completed)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RecordError(f"{path} cannot be read ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(e, dict) and Path(n).name == n for n, e in files.items()):
        raise RecordError(f"{path} does not hold a manifest of file names")
    return files


def verify_record(folder: Path, required: Iterable[str] = ()) -> None:
    """Check every file of the record ``folder`` against its manifest, which must list ``required``.

    Raises :class:`RecordError` naming the first file that is missing, unreadable, of another
    size or of another sha256.
    """
    folder = Path(folder)
    files = _manifest_files(folder)
    for name in required:
        if name not in files:
            raise RecordError(f"{folder / MANIFEST} does not list {name}")
    for name, entry in sorted(files.items()):
        path = folder / name
        try:
            size = path.stat().st_size
            digest = sha256_file(path) if size == entry.get("bytes") else None
        except FileNotFoundError:
            raise RecordError(f"{path} is missing") from None
        except OSError as exc:
            raise RecordError(f"{path} cannot be read ({exc.strerror or exc})") from None
        if size != entry.get("bytes"):
            raise RecordError(f"{path} has {size} bytes, {MANIFEST} records {entry.get('bytes')} (truncated?)")
        if digest != entry.get("sha256"):
            raise RecordError(f"{path} does not match its sha256 in {MANIFEST} (the file was changed)")


def copy_record(source: Path, dest: Path, *, manifest: bool) -> None:
    """Copy :data:`RECORD_FILES` from ``source`` to ``dest``, replacing ``dest`` in one rename.

    With ``manifest`` (``dest`` is a record) the manifest is written last, once every file is
    in place. Copies take the user's umask, not the permissions of ``source``.
    """
    staging = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in RECORD_FILES:
        shutil.copyfile(source / name, staging / name)
    if manifest:
        write_manifest(staging)
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
