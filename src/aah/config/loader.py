"""Reading and writing run configurations: YAML files with ``base:`` inheritance, ``section.key=value``
overrides, and the nested plain values a :class:`RunConfig` is built from and written as."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .schemas import SECTION_TYPES, SECTIONS, RunConfig
from .values import ConfigError, check_type, fail, field_hints

#: Top-level key of a config file naming the file(s) it inherits from.
BASE_KEY = "base"

# PyYAML's YAML 1.1 resolver reads ``1e-3`` as a string; accept it as a float.
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    # sections are written in block style, lists of numbers inline: `windows: [128, 256]`
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


_Dumper.add_representer(list, _represent_list)


def _where(source: str | None) -> str:
    return f" in {source}" if source else ""


def _unknown_key_message(section: str, key: Any, source: str | None) -> str:
    cls = SECTION_TYPES[section]
    hint = f" ({cls.not_settable[key]})" if key in cls.not_settable else ""
    return f"unknown key{_where(source)}{hint}; allowed keys in {section}: {', '.join(cls.field_names())}"


def _section_values(name: str, values: Any, source: str | None) -> dict[str, Any]:
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        fail(name, f"expected a mapping of keys{_where(source)}, got {values!r}")
    allowed = SECTION_TYPES[name].field_names()
    for key in values:
        if key not in allowed:
            fail(f"{name}.{key}", _unknown_key_message(name, key, source))
    return dict(values)


def config_from_dict(data: Mapping[str, Any] | None, source: str | None = None) -> RunConfig:
    """Build and validate a :class:`RunConfig` from nested plain values (a parsed YAML file).

    Missing sections and keys take their defaults; ``source`` names the origin in errors.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config{_where(source)}: expected a mapping of sections, got {data!r}")
    for name in data:
        if name not in SECTION_TYPES:
            raise ConfigError(f"{name}: unknown section{_where(source)}; allowed sections: {', '.join(SECTIONS)}")
    values = {name: _section_values(name, data.get(name), source) for name in SECTION_TYPES}
    try:
        return RunConfig(**{name: cls(**values[name]) for name, cls in SECTION_TYPES.items()})
    except ConfigError as exc:
        if source is None:
            raise
        raise ConfigError(f"{exc} (in {source})") from None


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else in ``top`` replaces ``base``."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        elif value is None and isinstance(out.get(key), Mapping) and key in SECTION_TYPES:
            continue  # an empty section header does not erase the inherited section
        else:
            out[key] = value
    return out


def _read_file(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Parse ``path`` and the files it inherits from (``base:``), merged base first."""
    shown = str(path)
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise ConfigError(f"config file {shown}: base cycle: {cycle}")
    included = f" (base of {chain[-1]})" if chain else ""
    try:
        text = resolved.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {shown}{included}: not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"config file {shown}{included}: cannot be read ({reason})") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {shown}{included}: invalid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        top = type(data).__name__
        raise ConfigError(f"config file {shown}{included}: expected a mapping of sections at the top level, got {top}")
    bases = data.pop(BASE_KEY, None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(
            f"config file {shown}: {BASE_KEY}: expected a file name or a list of file names "
            f"(relative to this file), got {bases!r}"
        )
    merged: dict[str, Any] = {}
    for base in bases:
        merged = _merge(merged, _read_file(resolved.parent / base, (*chain, resolved)))
    return _merge(merged, data)


def _apply_override(data: dict[str, Any], item: str) -> None:
    target, equals, text = item.partition("=") if isinstance(item, str) else ("", "", "")
    target = target.strip()
    section, dot, key = target.partition(".")
    if not (equals and dot and section and key):
        raise ConfigError(f"override {item!r}: expected section.key=value (e.g. train.max_steps=50)")
    if section not in SECTION_TYPES:
        raise ConfigError(f"override {item!r}: unknown section {section!r}; allowed sections: {', '.join(SECTIONS)}")
    cls = SECTION_TYPES[section]
    if key not in cls.field_names():
        raise ConfigError(f"override {item!r}: {target}: {_unknown_key_message(section, key, None)}")
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from None
    try:
        check_type(target, value, field_hints(cls)[key])
    except ConfigError as exc:
        raise ConfigError(f"{exc} (override {item!r})") from None
    current = data.get(section)
    data[section] = {**(current if isinstance(current, Mapping) else {}), key: value}


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read, override and validate a run configuration.

    ``path`` None = all defaults. A file may name the file(s) it inherits from
    with a top-level ``base:`` key (paths relative to it; deep-merged, the
    including file wins; cycles are refused). ``overrides`` are
    ``section.key=value`` strings whose values are parsed as YAML, applied in
    order after the file. Raises :class:`ConfigError` on any problem.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    data = {} if path is None else _read_file(Path(path))
    for item in overrides:
        _apply_override(data, item)
    return config_from_dict(data, None if path is None else str(path))


def config_to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Nested plain values (lists, not tuples) that :func:`config_from_dict` turns back into ``cfg``.

    Unset ``aah`` overrides are left out; every other key is written.
    """
    out: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
        if name == "aah":
            values = {"regime": section.regime, **section.overrides()}
        out[name] = {key: list(v) if isinstance(v, tuple) else v for key, v in values.items()}
    return out


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write ``cfg`` as YAML to ``path`` (parent folders are created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    path.write_text("# aah run configuration\n" + text, encoding="utf-8")
    return path
