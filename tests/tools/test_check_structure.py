"""tools/check_structure.py: it finds import circles (module-level or hidden inside functions)
and imports of another file's private names, and it finds none in src/aah."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_structure", REPO / "tools" / "check_structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "src" / "aah" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "src"


def test_a_circle_hidden_inside_a_function_is_found(tmp_path):
    src = _tree(tmp_path, {
        "__init__.py": "",
        "pkg/__init__.py": "",
        "pkg/a.py": "from .b import g\n\ndef f():\n    return g()\n",
        "pkg/b.py": "def g():\n    from .a import f\n    return f\n",
        "pkg/c.py": "from . import a\n",
    })
    problems = _checker().check(src)
    assert problems == ["import circle: aah.pkg.a <-> aah.pkg.b"]


def test_a_private_name_from_another_file_is_found_and_one_from_itself_is_not(tmp_path):
    src = _tree(tmp_path, {
        "__init__.py": "",
        "x.py": "def _helper():\n    return 1\n",
        "y.py": "from .x import _helper\nfrom ._files import path_of\n",
        "_files.py": "def path_of():\n    return 2\n",
        "z.py": "from aah.x import __doc__\n",
    })
    assert _checker().check(src) == ["aah.y:1: imports private name _helper from aah.x"]


def test_three_module_circle_through_absolute_imports(tmp_path):
    src = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "import aah.b\n",
        "b.py": "from aah import c\n",
        "c.py": "from aah.a import thing\n",
    })
    assert _checker().check(src) == ["import circle: aah.a <-> aah.b <-> aah.c"]


def test_the_package_has_no_circle_and_no_private_import():
    assert _checker().check(REPO / "src") == []
