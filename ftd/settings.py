"""One validated settings object per daemon, read from a file, the environment and flags.

A daemon declares a frozen dataclass whose fields are made with :func:`setting` (help text, unit,
default). :func:`load` builds the command line from it, reads ``--config FILE`` (TOML or YAML), the
environment (``<PREFIX><FIELD_NAME>``, derived mechanically from the field name) and the flags, and
constructs the dataclass, whose ``__post_init__`` validates. Precedence: default < file < env/flag.
An environment variable and a flag that both set a field to *different* values are an error rather
than a silent override: an operator who sets both almost certainly expects one of them to win.

Every problem is a :class:`SettingsError` naming the field; :func:`load_or_exit` turns it into exit
code 2 with a one-line message, the convention of argparse and of most Unix daemons.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A setting is missing, malformed or out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def setting(default: Any, help: str, unit: str = "") -> Any:
    """A dataclass field carrying its documentation (``unit`` is e.g. "s", "bytes", "Hz")."""
    meta = {"help": help, "unit": unit}
    if isinstance(default, dict):
        frozen = dict(default)
        return dataclasses.field(default_factory=lambda: dict(frozen), metadata=meta)
    if isinstance(default, (list, set)):
        raise TypeError("use a tuple for a sequence setting")
    return dataclasses.field(default=default, metadata=meta)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def env_name(prefix: str, field_name: str) -> str:
    return f"{prefix}{field_name.upper()}"


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def parse_value(field: str, tp: Any, raw: Any) -> Any:
    """Converts a raw value (a string from env/flags, or a parsed file value) to the field's type."""
    tp, optional = _strip_optional(tp)
    if raw is None or (optional and isinstance(raw, str) and raw.strip().lower() in ("", "none", "null")):
        if optional:
            return None
        raise SettingsError(field, "a value is required")
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(f"expected true or false, got {raw!r}")
        if tp is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(f"expected an integer, got {raw!r}")
            return int(raw)
        if tp is float:
            if isinstance(raw, bool):
                raise ValueError(f"expected a number, got {raw!r}")
            return float(raw)
        if tp is str:
            if not isinstance(raw, (str, int, float)):
                raise ValueError(f"expected a string, got {raw!r}")
            return str(raw)
        if tp is Path:
            return Path(str(raw)).expanduser()
        if origin is tuple:
            items = [s.strip() for s in raw.split(",") if s.strip()] if isinstance(raw, str) else list(raw)
            return tuple(str(i) for i in items)
        if origin is dict:
            return _parse_mapping(raw)
    except SettingsError:
        raise
    except (TypeError, ValueError) as exc:
        raise SettingsError(field, str(exc)) from exc
    raise SettingsError(field, f"unsupported setting type {tp!r}")


def _parse_mapping(raw: Any) -> dict[str, str]:
    if isinstance(raw, Mapping):
        return {str(k): str(v) for k, v in raw.items()}
    out: dict[str, str] = {}
    for chunk in str(raw).split(","):
        part = chunk.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE[,KEY=VALUE...], got {part!r}")
        out[key.strip()] = value.strip()
    return out


def read_file(path: Path) -> dict[str, Any]:
    """Reads a TOML or YAML settings file into a flat mapping; the file must be a table of fields."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError("config", f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise SettingsError("config", f"{path}: unknown format (use .toml, .yaml or .yml)")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise SettingsError("config", f"{path} does not parse: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError("config", f"{path}: expected a table of settings, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build_parser(cls: type, prog: str, env_prefix: str, description: str = "") -> argparse.ArgumentParser:
    """The daemon's command line: ``--config`` plus one flag per field, every default suppressed so
    that only flags actually given show up in the namespace."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, argument_default=argparse.SUPPRESS
    )
    parser.add_argument(
        "--config", type=Path, help=f"TOML or YAML settings file (env {env_name(env_prefix, 'config')})"
    )
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        unit = f.metadata.get("unit", "")
        shown = _shown(_default(f)) or '""'
        help_text = (
            f"{f.metadata.get('help', '')} [{unit or '-'}]"
            f" (default: {shown}; env {env_name(env_prefix, f.name)})"
        ).replace("%", "%%")
        base, _ = _strip_optional(hints[f.name])
        if base is bool:
            parser.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                help=help_text)
        else:
            parser.add_argument(flag_name(f.name), dest=f.name, metavar=f.name.upper(), help=help_text)
    return parser


def load(
    cls: type[T],
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    prog: str,
    env_prefix: str,
    description: str = "",
) -> T:
    """Builds ``cls`` from file + environment + flags; raises :class:`SettingsError` naming the field."""
    parser = build_parser(cls, prog, env_prefix, description)
    try:
        ns = vars(parser.parse_args(list(argv)))
    except SystemExit as exc:  # argparse already printed usage; keep its exit code (2)
        raise SettingsError("argv", "invalid command line") from exc
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cast(Any, cls))}
    values: dict[str, Any] = {}

    config_path = ns.pop("config", None) or env.get(env_name(env_prefix, "config"))
    if config_path:
        for key, raw in read_file(Path(config_path)).items():
            if key not in names:
                raise SettingsError(key, f"unknown setting in {config_path}")
            values[key] = parse_value(key, hints[key], raw)

    for name in sorted(names):
        env_key = env_name(env_prefix, name)
        from_env = parse_value(name, hints[name], env[env_key]) if env_key in env else None
        if name in ns:
            from_flag = parse_value(name, hints[name], ns[name])
            if env_key in env and from_env != from_flag:
                raise SettingsError(
                    name,
                    f"set to {env[env_key]!r} by {env_key} and to {ns[name]!r} by {flag_name(name)};"
                    " remove one of them",
                )
            values[name] = from_flag
        elif env_key in env:
            values[name] = from_env
    try:
        return cls(**values)
    except SettingsError:
        raise
    except (TypeError, ValueError) as exc:
        raise SettingsError("settings", str(exc)) from exc


def load_or_exit(
    cls: type[T],
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    prog: str,
    env_prefix: str,
    description: str = "",
) -> T:
    """:func:`load`, but a bad setting prints ``PROG: bad setting FIELD: why`` and exits with code 2."""
    try:
        return load(cls, argv, env, prog=prog, env_prefix=env_prefix, description=description)
    except SettingsError as exc:
        if exc.field != "argv":
            print(f"{prog}: bad setting {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def require(condition: bool, field: str, message: str) -> None:
    """Validation helper for ``__post_init__``: raises :class:`SettingsError` naming ``field``."""
    if not condition:
        raise SettingsError(field, message)


def describe(cls: type, env_prefix: str) -> list[dict[str, str]]:
    """One row per field (name, flag, env, type, unit, default, help): the source of the docs table."""
    hints = _field_types(cls)
    rows = []
    for f in dataclasses.fields(cls):
        rows.append({
            "name": f.name,
            "flag": flag_name(f.name),
            "env": env_name(env_prefix, f.name),
            "type": getattr(hints[f.name], "__name__", str(hints[f.name])),
            "unit": f.metadata.get("unit", ""),
            "default": _shown(_default(f)),
            "help": f.metadata.get("help", ""),
        })
    return rows
