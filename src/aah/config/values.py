"""The configuration error, and the conversion of a value read from YAML to its field's annotated
type (``int`` to ``float``, a list to a tuple) or a :class:`ConfigError` naming key and type."""

from __future__ import annotations

import functools
import numbers
import types
import typing
from collections.abc import Sequence
from typing import Any, Union


class ConfigError(ValueError):
    """An invalid run configuration; the message names the offending key or file."""


class _Mismatch(Exception):
    pass


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(hint)
        name = " or ".join(_type_name(a) for a in args if a is not type(None))
        return f"{name} or null" if type(None) in args else name
    if origin in (tuple, list):
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    return getattr(hint, "__name__", str(hint))


def _convert(value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        item = typing.get_args(hint)[0]
        return tuple(_convert(v, item) for v in value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if isinstance(value, bool):
        raise _Mismatch  # bool is not a number here
    if hint is int and isinstance(value, numbers.Integral):
        return int(value)
    if hint is float and isinstance(value, numbers.Real):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    raise _Mismatch


def check_type(key: str, value: Any, hint: Any) -> Any:
    """``value`` converted to the type ``hint``; a :class:`ConfigError` naming ``key`` if it is not one."""
    try:
        return _convert(value, hint)
    except _Mismatch:
        raise ConfigError(f"{key}: expected {_type_name(hint)}, got {value!r}") from None


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of the dataclass ``cls``."""
    return typing.get_type_hints(cls)


def fail(key: str, message: str) -> typing.NoReturn:
    """Raise a :class:`ConfigError` ``"<key>: <message>"``."""
    raise ConfigError(f"{key}: {message}")


def one_of(key: str, value: str, allowed: Sequence[str]) -> None:
    """Fail unless ``value`` is one of ``allowed``, listing them."""
    if value not in allowed:
        fail(key, f"must be one of {', '.join(allowed)}; got {value!r}")
