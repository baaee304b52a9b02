"""Building and loading the compiled decode step (aah.decode.extension.load) like a well-kept package.

The real kernel takes about a minute to compile, so these tests build tiny
stand-ins in its place (``_CSRC`` points at a folder of their own): a module
of a few lines, and a file that does not compile. Each test has its own
``$TORCH_EXTENSIONS_DIR`` and its own copy of the module's cache of the result.
Where a later load could hang, it runs in a subprocess with a time limit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path

import pytest

from aah.decode import extension

pytestmark = pytest.mark.skipif(extension.fcntl is None, reason="the build lock needs fcntl (POSIX)")

# A Python module of a few lines under the extension's name (which torch passes as TORCH_EXTENSION_NAME).
TINY = """\
#include <Python.h>
#define AAH_JOIN(a, b) a##b
#define AAH_INIT(name) AAH_JOIN(PyInit_, name)
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, nullptr};
PyMODINIT_FUNC AAH_INIT(TORCH_EXTENSION_NAME)(void) {
    PyObject *module = PyModule_Create(&tiny);
    if (module) PyModule_AddIntConstant(module, "answer", 42);
    return module;
}
"""
BROKEN = "int first() { return undeclared_alpha; }\nint second() { return undeclared_omega; }\n"

# Run in a subprocess: load the stand-in of argv[1]; with argv[2], first signal that file and
# stall, then build: with argv[3] ``hang`` until killed, with half a build and torch's own lock
# in the private folder; else until the file argv[3] appears.
LOADER = textwrap.dedent("""\
    import json, sys, time
    from pathlib import Path
    from aah.decode import extension

    extension._CSRC = Path(sys.argv[1])
    compile_for_real, calls = extension._compile, []

    def stalling(build):
        calls.append(str(build))
        if sys.argv[3] == "hang":
            (build / "lock").touch()  # what torch's own lock leaves when its build is killed
            (build / "decode_step.o").write_bytes(b"half an object")
        Path(sys.argv[2]).touch()
        for _ in range(1200):  # two minutes at most
            if sys.argv[3] != "hang" and Path(sys.argv[3]).exists():
                break
            time.sleep(0.1)
        return compile_for_real(build)

    def counting(build):
        calls.append(str(build))
        return compile_for_real(build)

    extension._compile = stalling if len(sys.argv) > 2 else counting
    module = extension.load()
    print(json.dumps({"answer": getattr(module, "answer", None), "reason": extension.unavailable_reason(),
                      "builds": len(calls)}))
""")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """``aah.decode.extension`` with an empty extensions folder and nothing loaded yet in this process."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("AAH_RING_KERNEL", "1")
    monkeypatch.delenv("AAH_RING_KERNEL_RETRY", raising=False)
    monkeypatch.setattr(extension, "_state", {})
    return extension


def _sources(tmp_path: Path, name: str, text: str, monkeypatch=None) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "decode_step.cpp").write_text(text)
    if monkeypatch is not None:
        monkeypatch.setattr(extension, "_CSRC", folder)
    return folder


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    return _sources(tmp_path, "tiny", TINY, monkeypatch)


@pytest.fixture
def broken(tmp_path, monkeypatch):
    return _sources(tmp_path, "broken", BROKEN, monkeypatch)


def _leftovers(folder: Path) -> list[Path]:
    """Private build folders of ``folder`` still lying beside it."""
    return sorted(folder.parent.glob(f".{folder.name}.*"))


def _library(folder: Path) -> list[Path]:
    return sorted(folder.glob("aah_ring_decode*.so"))


def _must_not_build(monkeypatch) -> list[Path]:
    """Replace the compile step by one that records that it was asked for; returns the record."""
    calls: list[Path] = []
    monkeypatch.setattr(extension, "_compile", lambda build: calls.append(build) or types.ModuleType("stub"))
    return calls


def _load_in_subprocess(*args: str, timeout: float = 120) -> dict:
    script = Path(os.environ["TORCH_EXTENSIONS_DIR"]).parent / "loader.py"
    script.write_text(LOADER)
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"stderr": done.stderr}


def _wait_for(path: Path, process: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_build_is_renamed_into_place_and_later_loaded_without_building(fresh, tiny, tmp_path, monkeypatch):
    module = fresh.load()
    assert module is not None and module.answer == 42
    assert fresh.unavailable_reason() is None and fresh.decode_step_label("cpu") == "compiled"
    folder = fresh._build_directory()
    assert _library(folder) and not (folder / "FAILED").exists()
    assert _leftovers(folder) == []  # the private folder became the build folder

    # A later process loads the library as it is: no build, not even a compiler needed.
    monkeypatch.setattr(fresh, "_state", {})
    calls = _must_not_build(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    again = fresh.load()
    assert again is not None and again.answer == 42 and calls == []


def test_a_failed_build_is_remembered_with_the_whole_compiler_output(fresh, broken, monkeypatch):
    with pytest.warns(RuntimeWarning) as warned:
        assert fresh.load() is None
        fresh.unavailable_reason()  # asks again: no second warning
    folder = fresh._build_directory()
    log = folder / "build.log"
    reason = fresh.unavailable_reason()
    assert "build failed" in reason and "undeclared_alpha" in reason and str(log) in reason
    assert "AAH_RING_KERNEL_RETRY=1" in reason
    assert [str(w.message) for w in warned] == [
        f"aah: the compiled decode step is not used, so decoding takes the slower masked route ({reason}); "
        "set AAH_RING_KERNEL=0 to turn it off without this warning"
    ]
    assert fresh.decode_step_label("cpu") == f"pytorch ({reason})"
    output = log.read_text()
    assert "undeclared_alpha" in output and "undeclared_omega" in output  # every error, not the first line
    assert (folder / "FAILED").exists() and _leftovers(folder) == [] and not _library(folder)

    # Later processes do not try again; each says why, once.
    monkeypatch.setattr(fresh, "_state", {})
    calls = _must_not_build(monkeypatch)
    with pytest.warns(RuntimeWarning, match="build.log"):
        assert fresh.load() is None
    assert calls == [] and fresh.unavailable_reason() == reason

    # Unless asked to.
    monkeypatch.setenv("AAH_RING_KERNEL_RETRY", "1")
    monkeypatch.setattr(fresh, "_state", {})
    assert fresh.load() is not None and len(calls) == 1  # the stub "built" a module this time
    assert not (folder / "FAILED").exists() and not log.exists()


@pytest.mark.slow
def test_a_build_killed_midway_does_not_hold_up_the_next(fresh, tiny, tmp_path):
    started = tmp_path / "started"
    script = Path(os.environ["TORCH_EXTENSIONS_DIR"]).parent / "loader.py"
    script.write_text(LOADER)
    killed = subprocess.Popen([sys.executable, str(script), str(tiny), str(started), "hang"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(started, killed)
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.communicate()
    folder = fresh._build_directory()
    assert not folder.exists() and len(_leftovers(folder)) == 1  # its half build, with torch's lock in it

    after = _load_in_subprocess(str(tiny))
    assert after["answer"] == 42 and after["reason"] is None and after["builds"] == 1
    assert "waiting" not in after["stderr"]
    assert _library(folder) and _leftovers(folder) == []  # the half build was cleared away


@pytest.mark.slow
def test_stale_locks_left_by_hand_do_not_hold_up_a_load(fresh, tiny):
    folder = fresh._build_directory()
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # an interrupted build of torch's own making, in the build folder itself
    (folder / "decode_step.o").write_bytes(b"half an object")
    folder.with_name(folder.name + ".lock").write_text("999999")  # the lock file of a process long gone
    after = _load_in_subprocess(str(tiny))
    assert after["answer"] == 42 and after["builds"] == 1 and "waiting" not in after["stderr"]
    assert _library(folder) and not (folder / "lock").exists()


@pytest.mark.slow
def test_a_second_process_waits_for_the_build_and_loads_it(fresh, tiny, tmp_path):
    started, go = tmp_path / "started", tmp_path / "go"
    script = Path(os.environ["TORCH_EXTENSIONS_DIR"]).parent / "loader.py"
    script.write_text(LOADER)
    first = subprocess.Popen([sys.executable, str(script), str(tiny), str(started), str(go)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = None
    try:
        _wait_for(started, first)  # the first one holds the lock, and builds when told to
        second = subprocess.Popen([sys.executable, str(script), str(tiny)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        waiting = ""
        while "waiting" not in waiting and second.poll() is None:
            waiting += second.stderr.readline()
        go.touch()
        out, _ = first.communicate(timeout=120)
        out_second, _ = second.communicate(timeout=120)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.communicate()
    assert f"waiting for process {first.pid}" in waiting
    assert str(fresh._build_directory()) + ".lock" in waiting  # it names the lock it waits on
    assert json.loads(out.splitlines()[-1]) == {"answer": 42, "reason": None, "builds": 1}
    assert json.loads(out_second.splitlines()[-1]) == {"answer": 42, "reason": None, "builds": 0}


@pytest.mark.parametrize("cxx", [None, "no-such-compiler-anywhere"])
def test_without_a_compiler_the_reason_says_so(fresh, tiny, tmp_path, monkeypatch, cxx):
    calls = _must_not_build(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    if cxx is None:
        monkeypatch.delenv("CXX", raising=False)
    else:
        monkeypatch.setenv("CXX", cxx)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler.*AAH_RING_KERNEL=0"):
        assert fresh.load() is None and calls == []
    reason = fresh.unavailable_reason()
    assert reason.startswith("no C++ compiler")
    assert (f"CXX={cxx}" in reason) if cxx else ("c++" in reason and "g++" in reason)
    assert not Path(os.environ["TORCH_EXTENSIONS_DIR"]).exists()  # nothing was started


def _bin(tmp_path: Path, name: str, *tools: str) -> Path:
    """A folder holding links to the named tools of this machine."""
    folder = tmp_path / name
    folder.mkdir()
    for tool in tools:
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"no {tool} here")
        (folder / tool).symlink_to(found)
    return folder


def test_g_plus_plus_alone_and_the_ninja_beside_python_are_used(fresh, tiny, tmp_path, monkeypatch):
    path = _bin(tmp_path, "bin", "g++")
    scripts = _bin(tmp_path, "scripts", "ninja")  # where the ninja pip package installs its command
    monkeypatch.setenv("PATH", str(path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(fresh, "_scripts_directory", lambda: str(scripts))
    seen = {}

    def compile_here(build):
        seen.update(cxx=os.environ.get("CXX"), ninja=shutil.which("ninja"))
        return types.ModuleType("stub")

    monkeypatch.setattr(fresh, "_compile", compile_here)
    assert fresh.load() is not None
    assert seen == {"cxx": "g++", "ninja": str(scripts / "ninja")}
    assert "CXX" not in os.environ and os.environ["PATH"] == str(path)  # put back after the build


def test_without_ninja_the_reason_says_so(fresh, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(_bin(tmp_path, "bin", "c++")))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(fresh, "_scripts_directory", lambda: str(tmp_path / "bin"))
    calls = _must_not_build(monkeypatch)
    with pytest.warns(RuntimeWarning, match="no ninja"):
        assert fresh.load() is None and calls == []
    assert fresh.unavailable_reason() == "no ninja, which builds the extension (pip install ninja)"


def test_a_library_that_does_not_load_says_which_and_what_to_do(fresh, tiny, monkeypatch):
    folder = fresh._build_directory()
    folder.mkdir(parents=True)
    (folder / "aah_ring_decode.so").write_bytes(b"not a shared library")
    calls = _must_not_build(monkeypatch)
    with pytest.warns(RuntimeWarning, match="does not load"):
        assert fresh.load() is None and calls == []
    reason = fresh.unavailable_reason()
    assert reason.startswith(f"{folder / 'aah_ring_decode.so'} does not load") and f"delete {folder}" in reason


def test_a_build_folder_that_cannot_be_written_warns_once_and_names_the_switch(fresh, tiny, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(blocker / "extensions"))
    with pytest.warns(RuntimeWarning) as warned:
        assert fresh.load() is None
        assert fresh.load() is None  # asked again: no second warning
    assert len(warned) == 1 and "AAH_RING_KERNEL=0" in str(warned[0].message)
    assert fresh.unavailable_reason() in str(warned[0].message)
    monkeypatch.setenv("AAH_RING_KERNEL", "0")
    monkeypatch.setattr(fresh, "_state", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # turned off on purpose: silent
        assert fresh.load() is None
