"""The command line's options and files: JSON configs and options merged into an `EngineConfig`, validated into
one-line errors; output files checked before the work that writes them."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from engramkv import ConfigError, InputError


def config_file(path: str, base: Any = None) -> Any:
    """`base` (default: a default `EngineConfig`) with the fields a JSON file names changed, at any depth."""
    from pydantic import ValidationError

    from engramkv import EngineConfig

    def merged(into: dict[str, Any], changes: Any) -> dict[str, Any]:
        if not isinstance(changes, dict):
            raise ConfigError(f"--config {path}: expected a JSON object of config fields, got {changes!r}")
        for key, value in changes.items():
            both_sections = isinstance(value, dict) and isinstance(into.get(key), dict)
            into[key] = merged(into[key], value) if both_sections else value
        return into

    try:
        changes = json.loads(Path(path).read_text(encoding="utf-8"))
        return EngineConfig.model_validate(merged((base or EngineConfig()).model_dump(), changes))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"--config {path}: cannot read a JSON config ({err})") from err
    except ValidationError as err:
        raise ConfigError(f"--config {path}: {invalid(err)}") from err


def invalid(err: Any, options: dict[str, str] | None = None) -> str:
    """A pydantic `ValidationError` on one line: each wrong field, by its dotted path or its command-line option,
    and what it must be."""
    options = options or {}
    parts = []
    for problem in err.errors():
        loc = [str(part) for part in problem["loc"]]
        named = [options[part] for part in loc if part in options]  # a list option's error ends in an index
        parts.append(f"{named[-1] if named else '.'.join(loc)}: {problem['msg']}")
    return "; ".join(parts)


def with_options(base: Any, section: tuple[str, ...], args: argparse.Namespace, names: tuple[str, ...],
                  options: dict[str, str] | None = None) -> Any:
    """`base` with the options in `names` that were given on the command line set in its `section`, validated;
    `options`: the command-line spelling of a field, where it is not `--field-name`."""
    from pydantic import ValidationError

    from engramkv import EngineConfig

    data = base.model_dump()
    target = data
    for key in section:
        target = target[key]
    target.update({name: getattr(args, name) for name in names if getattr(args, name) is not None})
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as err:
        spelled = {name: "--" + name.replace("_", "-") for name in names}
        raise ConfigError(invalid(err, {**spelled, **(options or {})})) from err


def output_file(path: str) -> Path:
    """`path` as a file the command can write once its work is done, checked first (nothing is made yet)."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise InputError(f"{out} is a directory; name the file to write")
    folder = out.parent
    while not folder.exists() and folder != folder.parent:  # the folders still to make go under this one
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"cannot create {out.parent} for {out}: {folder} is not a directory")
    if not os.access(folder, os.W_OK):
        raise InputError(f"cannot write in {folder}")
    return out


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read it as UTF-8 text ({err})") from err
