"""The README's examples run as written, and every relative link of the README and docs/ resolves.

Each ```python block of README.md is executed in a fresh namespace, in an empty temporary
working directory, so the README cannot drift from the code it shows. The link check reads
``[text](target)`` in README.md and docs/**/*.md, leaves web addresses and in-page anchors
alone, and asserts that each other target exists relative to the page that names it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def readme_blocks() -> list[str]:
    return PYTHON_BLOCK.findall(README.read_text(encoding="utf-8"))


def markdown_pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_has_three_examples():
    assert len(readme_blocks()) == 3


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    source = readme_blocks()[index]
    if "transformers" in source:
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    code = compile(source, f"README.md example {index + 1}", "exec")
    exec(code, {"__name__": f"readme_example_{index + 1}"})


def relative_links(page: Path) -> list[str]:
    text = CODE.sub("", page.read_text(encoding="utf-8"))  # links inside code are not links
    targets = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"
