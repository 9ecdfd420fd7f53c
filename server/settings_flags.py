"""A command-line flag for every setting, so `python -m server --help` lists them all:
`--KEY` (`--port`, `--max-batch-size`, `--temperature`) for the server, models, defaults and
engine sections, `--cache-KEY` and `--distributed-KEY` for those sections' (their keys alone
would be vague). `mlx_lm.server`'s `--temp` and `--chat-template-args` are aliases, so its
command lines work here. A value is read as YAML (numbers, `true`/`false`, lists, JSON objects)
unless the setting is text; a boolean flag alone means true.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

import yaml
from pydantic.fields import FieldInfo

from server.config import Settings

PREFIXED = ("cache", "distributed")
ALIASES = {("defaults", "temperature"): "--temp",
           ("models", "chat_template_kwargs"): "--chat-template-args"}


def settings() -> Iterator[tuple[str, str, FieldInfo]]:
    """(section, key, field) of every setting, in the configuration's order."""
    for section, field in Settings.model_fields.items():
        for key, info in field.annotation.model_fields.items():
            yield section, key, info


def flag(section: str, key: str) -> str:
    name = f"{section}_{key}" if section in PREFIXED else key
    return "--" + name.replace("_", "-")


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "settings", "Each sets the configuration key in brackets, over the config file and the"
        " MLX_SPEC_* variables.")
    for section, key, info in settings():
        names = [flag(section, key)] + ([ALIASES[section, key]] if (section, key) in ALIASES
                                        else [])
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if _is_bool(info) else {}
        described = (info.description or "").replace("%", "%%")
        group.add_argument(*names, dest=f"{section}.{key}", default=None, metavar=_metavar(info),
                           help=f"{described} [{section}.{key}]", **extra)


def setting_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The settings the flags set, by section, as `Settings.load` takes them."""
    overrides: dict[str, dict[str, Any]] = {}
    for section, key, info in settings():
        raw = getattr(args, f"{section}.{key}", None)
        if raw is not None:
            overrides.setdefault(section, {})[key] = raw if _is_text(info) else _yaml(raw)
    return overrides


def _yaml(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw  # the settings' validation says what is wrong with it


def _kinds(info: FieldInfo) -> set:
    """The annotation's types, None left out (`str | None` -> {str})."""
    annotation = info.annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return {a for a in typing.get_args(annotation) if a is not type(None)}
    return {annotation}


def _is_text(info: FieldInfo) -> bool:
    return all(kind is str or typing.get_origin(kind) is Literal for kind in _kinds(info))


def _is_bool(info: FieldInfo) -> bool:
    return _kinds(info) == {bool}


def _metavar(info: FieldInfo) -> str:
    kinds = _kinds(info)
    if len(kinds) == 1 and typing.get_origin(next(iter(kinds))) is Literal:
        return "{" + ",".join(map(str, typing.get_args(next(iter(kinds))))) + "}"
    names = {str: "TEXT", int: "N", float: "X", bool: "true|false"}
    return next((names[k] for k in kinds if k in names), "YAML")
