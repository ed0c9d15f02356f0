"""The ``--config`` file: upstream's flat YAML mapping (internal/driverconfig), its keys those of
the settings table.

An optional ``apiVersion: v1alpha1``; unknown keys, keys spelled with another case, duplicate
keys and the keys upstream refuses in the file (``schemaExcludedFields``) are errors, every bad
key of a file named in the one error line.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import yaml

from dracpu.config.settings import SETTINGS
from dracpu.config.values import show, yaml_type
from dracpu.errors import ConfigError

__all__ = ["CONFIG_API_VERSION", "read_config_file", "read_yaml_mapping"]

# The only config-file apiVersion upstream accepts (internal/driverconfig/config.go).
CONFIG_API_VERSION = "v1alpha1"

_FILE_KEYS: frozenset[str] = frozenset(
    {"apiVersion"} | {s.key for s in SETTINGS if s.key is not None}
)
_NOT_IN_FILE: Mapping[str, str] = MappingProxyType(
    {s.key: s.not_in_file for s in SETTINGS if s.key is not None and s.not_in_file}
)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses a mapping key given twice (upstream: yaml.UnmarshalStrict)."""


def _construct_unique_mapping(
    loader: yaml.SafeLoader, node: yaml.MappingNode
) -> dict[object, object]:
    loader.flatten_mapping(node)
    seen: set[object] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            continue  # construct_mapping below reports the unhashable key
        if key in seen:
            mark = key_node.start_mark
            raise yaml.MarkedYAMLError(problem=f"duplicate key {show(key)}", problem_mark=mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def read_yaml_mapping(path: str, where: str) -> dict[object, object]:
    """The YAML mapping in ``path`` (duplicate keys refused, ``{}`` for an empty file);
    :class:`ConfigError` starting with ``where`` otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{where}: cannot read: {reason}") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds no objects
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {_yaml_problem(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping of keys to values, not {yaml_type(data)}")
    return data


def read_config_file(path: str) -> dict[str, object]:
    """The settings' keys and raw values of the config file ``path`` (``apiVersion`` checked
    and left out); :class:`ConfigError` naming the file and every bad key."""
    where = f"config file {path}"
    data = read_yaml_mapping(path, where)
    version = data.get("apiVersion", CONFIG_API_VERSION)
    if version != CONFIG_API_VERSION:
        raise ConfigError(
            f"{where}: apiVersion: invalid value {show(version)}: "
            f"must be {show(CONFIG_API_VERSION)}"
        )
    problems = [
        problem
        for key in sorted((str(k) for k in data), key=str)
        if (problem := _key_problem(key)) is not None
    ]
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    return {str(k): v for k, v in data.items() if k != "apiVersion"}


def _key_problem(key: str) -> str | None:
    """Why ``key`` may not be in a config file (upstream's ``rejectNonCanonicalKeys``,
    ``rejectExcludedFields`` and unknown fields), or ``None``."""
    folded = next((k for k in sorted(_FILE_KEYS) if k.lower() == key.lower()), None)
    if folded is not None and folded in _NOT_IN_FILE:
        return f"key {show(key)} is not settable in the config file; {_NOT_IN_FILE[folded]}"
    if key in _FILE_KEYS:
        return None
    if folded is not None:
        return f"key {show(key)} is spelled differently from the schema; use {show(folded)}"
    close = difflib.get_close_matches(key, sorted(_FILE_KEYS), n=1)
    hint = f" (did you mean {show(close[0])}?)" if close else ""
    return f"unknown key {show(key)}{hint}"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        return f"{exc.problem}{where}"
    return " ".join(str(exc).split())
