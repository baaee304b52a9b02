"""Helpers shared by the run-configuration tests: the config families and error checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from aah import regimes
from aah.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FAMILIES = ("cpu", "paper")
REGIME_FILES = [
    pytest.param(family, name, id=f"{family}/{name}") for family in FAMILIES for name in regimes.names()
]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def raises_naming(*parts: str):
    """``pytest.raises(ConfigError)`` whose message must contain every one of ``parts``."""

    class _Check:
        def __enter__(self):
            self._ctx = pytest.raises(ConfigError)
            self.info = self._ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self._ctx.__exit__(*exc)
            message = str(self.info.value)
            for part in parts:
                assert part in message, f"{part!r} not in {message!r}"
            return suppressed

    return _Check()
