"""Building and loading the compiled decode step: the C++ sources in ``csrc/``, built once per machine.

The extension is built with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja) the first time a process needs it, into ``$TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), in a folder named after the torch
version, the CPU capability and a hash of the sources and their location. It
takes about a minute once per machine, copy of the package and source version;
later processes load the built library from that folder directly. A build runs
in a private temporary folder beside it, which is renamed into place when done,
under a lock the operating system drops when the process dies: a build killed
midway leaves only a temporary folder, removed by the next build. A build that
fails is remembered there too (a ``FAILED`` marker, the whole compiler output in
``build.log``, named by the one warning and by :func:`unavailable_reason`), so
later processes do not try again; set ``AAH_RING_KERNEL_RETRY=1`` or delete the
folder to build again. Without a C++ compiler (``$CXX``, else ``c++`` or ``g++``)
or ninja, nothing is built. In all these cases the PyTorch paths run, with the
same results (tested against each other). ``AAH_RING_KERNEL=0`` turns it off.
:mod:`aah.decode.ring_decode` holds the functions that call the extension.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

import torch

try:
    import fcntl  # the build lock; without it (Windows) builds are not serialised
except ImportError:  # pragma: no cover
    fcntl = None

__all__ = ["decode_step_label", "load", "unavailable_reason"]

_NAME = "aah_ring_decode"
_CSRC = Path(__file__).with_name("csrc")
_MAIN_SOURCE = "decode_step.cpp"  # it includes the headers beside it
_LIBRARY_SUFFIX = ".pyd" if os.name == "nt" else ".so"
_FAILED = "FAILED"  # in a build folder: the build failed (holds its first error line)
_LOG = "build.log"  # beside it: the failed build's whole output
_SCRATCH = ".tmp"  # suffix of the private folder a build runs in
_RETRY = "AAH_RING_KERNEL_RETRY"  # =1: build again although a build of these sources failed
_state: dict[str, object] = {}  # "module" or "error", once tried


class _Unavailable(Exception):
    """Why the compiled step cannot be had, as :func:`unavailable_reason` says it."""


class _BuildFailed(_Unavailable):
    """The build of these sources failed (now or in an earlier process): worth a warning."""


def _capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        return "DEFAULT"


def _flags() -> list[str]:
    """Optimised, vectorised (``-ffast-math``: the kernels use no infinities) and threaded; AVX2, or
    AVX-512 with 512-bit vectors, where the CPU has it."""
    flags = ["-O3", "-ffast-math", "-fopenmp"]  # OpenMP: ATen's parallel_for runs serially without it
    if _capability().startswith("AVX"):
        flags += ["-mavx2", "-mfma"]
    if _capability().startswith("AVX512"):
        flags += ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mprefer-vector-width=512"]
    return flags


def _build_directory() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions"
    )
    tag = f"torch{torch.__version__}_py{sys.version_info.major}{sys.version_info.minor}_{_capability()}"
    return Path(root) / f"{_NAME}_{tag.replace('+', '_').lower()}_{_source_digest()}"


def _source_digest() -> str:
    """A short hash of the sources and of where they lie.

    A changed kernel builds into a new folder, next to the old one. So does
    another copy of the package (a second checkout, a virtual environment):
    the build records its source paths, so two copies sharing one folder would
    rebuild it in turn, each time the other one had run.
    """
    digest = hashlib.sha256(str(_CSRC.resolve()).encode())
    for source in sorted(_CSRC.iterdir()):
        if source.suffix in (".cpp", ".h"):
            digest.update(source.read_bytes())
    return digest.hexdigest()[:10]


def load():
    """The built extension module, or ``None`` when it is turned off or cannot be built."""
    if os.environ.get("AAH_RING_KERNEL", "1") == "0":
        return None
    if not _state:
        try:
            _state["module"] = _load_or_build(_build_directory())
        except _Unavailable as exc:  # no compiler or ninja, a failed build
            _state["error"] = str(exc)
        except Exception as exc:  # a read-only home, say: keep the PyTorch path
            _state["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if "error" in _state:  # once per process: decoding stays exact, only slower
            warnings.warn(
                f"aah: the compiled decode step is not used, so decoding takes the slower masked route "
                f"({_state['error']}); set AAH_RING_KERNEL=0 to turn it off without this warning",
                RuntimeWarning, stacklevel=2,
            )
    return _state.get("module")


def _load_or_build(folder: Path):
    """The module built in ``folder``; built there first when that folder holds no build yet."""
    module = _finished(folder)
    if module is not None:
        return module
    environment = _toolchain()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder):
        module = _finished(folder)  # built by the process this one waited for
        if module is not None:
            return module
        _remove_leftovers(folder)
        with _environment(environment):
            return _build(folder)


def _finished(folder: Path):
    """The module of the build in ``folder``, ``None`` when there is none; raises for a failed one."""
    if (folder / _FAILED).exists():
        if os.environ.get(_RETRY, "0") != "1":
            raise _failure(folder)
        return None
    libraries = sorted(folder.glob(f"{_NAME}*{_LIBRARY_SUFFIX}"))
    if not libraries:
        return None
    spec = importlib.util.spec_from_file_location(libraries[0].stem, libraries[0])
    try:
        module = importlib.util.module_from_spec(spec)  # opens the library
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise _Unavailable(f"{libraries[0]} does not load ({exc}); delete {folder} to build again") from None
    return module


def _failure(folder: Path) -> _BuildFailed:
    """Why the build in ``folder`` failed: its first error line and where its whole output is."""
    try:
        first = (folder / _FAILED).read_text().strip()
    except OSError:  # removed meanwhile by a build retried
        first = "unknown error"
    return _BuildFailed(
        f"the build failed ({first}); the whole compiler output is in {folder / _LOG}; "
        f"set {_RETRY}=1 or delete {folder} to build again"
    )


def _scripts_directory() -> str | None:
    """Where this Python's installed commands are (the ``ninja`` pip package puts its own there)."""
    return sysconfig.get_path("scripts")


def _toolchain() -> dict[str, str]:
    """The environment changes the build needs; raises :class:`_Unavailable` without a compiler or ninja.

    ``torch.utils.cpp_extension`` compiles with ``$CXX``, else ``c++``, and runs
    ``ninja`` from the ``PATH``: where only ``g++`` exists it is named in
    ``CXX``, and the ninja of this Python's environment (not activated) is put
    on the ``PATH``.
    """
    changes = {}
    named = os.environ.get("CXX", "").strip()
    if named:
        if shutil.which(shlex.split(named)[0]) is None:
            raise _Unavailable(f"no C++ compiler: CXX={named} is not found")
    elif shutil.which("c++") is None:
        if shutil.which("g++") is None:
            raise _Unavailable("no C++ compiler (neither c++ nor g++ is on the PATH, and CXX is not set)")
        changes["CXX"] = "g++"
    if shutil.which("ninja") is None:
        scripts = _scripts_directory()
        if not scripts or shutil.which("ninja", path=scripts) is None:
            raise _Unavailable("no ninja, which builds the extension (pip install ninja)")
        changes["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    return changes


@contextlib.contextmanager
def _environment(changes: dict[str, str]):
    """``os.environ`` with ``changes`` for the duration (what the build's subprocesses see)."""
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _build_lock(folder: Path):
    """One build of ``folder`` at a time: a lock on the file ``<folder>.lock``.

    The operating system drops the lock when its process ends, however it ends,
    so a killed build never leaves a lock for others to wait on. The file holds
    the builder's process id, which a waiting process names.
    """
    if fcntl is None:  # pragma: no cover
        yield
        return
    path = folder.with_name(folder.name + ".lock")
    handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(handle, 32, 0).decode(errors="replace").strip() or "?"
            print(f"aah: waiting for process {holder}, which builds the compiled decode step (lock: {path})",
                  file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        os.ftruncate(handle, 0)
        os.pwrite(handle, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(handle)  # releases the lock


def _remove_leftovers(folder: Path) -> None:
    """Under the build lock: private folders of builds killed midway, and ``folder`` unless it holds a build.

    ``folder`` without a library is a failed build being retried, or one that an
    older version of this module was killed in the middle of.
    """
    if fcntl is not None:  # no other build runs now
        for leftover in folder.parent.glob(f".{folder.name}.*{_SCRATCH}"):
            shutil.rmtree(leftover, ignore_errors=True)
    if folder.exists():
        shutil.rmtree(folder)


def _build(folder: Path):
    """Build in a private folder beside ``folder`` and rename it to ``folder``, failed or not."""
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=_SCRATCH, dir=folder.parent))
    scratch.chmod(0o755)  # as a folder made the usual way: others may load the build
    print("aah: building the compiled decode step (once per machine and torch "
          f"version, about a minute) in {folder}", file=sys.stderr, flush=True)
    try:
        module = _compile(scratch)
    except Exception as exc:  # remembered: later processes do not try again
        output = f"{type(exc).__name__}: {exc}\n"
        (scratch / _LOG).write_text(output)
        (scratch / _FAILED).write_text(_first_error(output) + "\n")
        _move(scratch, folder)
        raise _failure(folder) from None
    _move(scratch, folder)
    if getattr(module, "__file__", None):
        module.__file__ = str(folder / Path(module.__file__).name)
    return module


def _compile(build: Path):
    """Build the extension in ``build`` with ``torch.utils.cpp_extension`` and import it."""
    from torch.utils.cpp_extension import load as load_extension

    return load_extension(
        name=_NAME, sources=[str(_CSRC / _MAIN_SOURCE)], build_directory=str(build),
        extra_cflags=_flags(), extra_ldflags=["-fopenmp"], verbose=False,
    )


def _first_error(output: str) -> str:
    """The first line of a build's output that reports an error (else its first line), shortened."""
    lines = output.splitlines() or [""]
    found = next((line for line in lines if re.search(r"\berror\b:", line, re.IGNORECASE)), lines[0])
    return found.strip()[:200]


def _move(scratch: Path, folder: Path) -> None:
    """Rename ``scratch`` to ``folder``, at once: others see a whole build or none."""
    try:
        os.rename(scratch, folder)
    except OSError:  # pragma: no cover - another process finished first (no lock between them)
        shutil.rmtree(scratch, ignore_errors=True)


def unavailable_reason() -> str | None:
    """Why :func:`load` gives ``None`` (``None`` when the compiled step is in use)."""
    if os.environ.get("AAH_RING_KERNEL", "1") == "0":
        return "turned off by AAH_RING_KERNEL=0"
    load()
    return _state.get("error")  # type: ignore[return-value]


def decode_step_label(device: torch.device | str) -> str:
    """Which decode step a cache on ``device`` runs: ``compiled`` or ``pytorch (why)``, for reports."""
    reason = unavailable_reason() if torch.device(device).type == "cpu" else "not on CPU"
    return "compiled" if reason is None else f"pytorch ({reason})"
