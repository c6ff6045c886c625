"""Dataclasses <-> TOML: typed loading, dotted overrides (`--set optim.lr=3e-4`), a TOML writer.

A config is a tree of dataclasses. Loading checks every key against the dataclass fields and
every value against the field's type annotation, so a typo or a wrong type fails with the dotted
key and the expected type; a float field must be finite (TOML's inf and nan are refused). A field annotated `dict[str, Any]` may carry a schema in its metadata
(`field(metadata={"schema": SomeDataclass})`): its keys are then the schema's field names, typed
the same way (this is how a `[model]` table holds any ModelConfig field without repeating them).

TOML has no null: fields whose value is None are omitted when writing, so an Optional field
must default to None for a written config to read back the same.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from kiln.errors import KilnError

T = TypeVar("T")

_NONE_WORDS = ("none", "null")


class ConfigError(KilnError, ValueError):
    """A config key or value that is not allowed; the message names the dotted key."""


class _NotFinite(ConfigError):
    """A float field given inf or nan (reported as such, not as a type mismatch)."""


def require(ok: bool, message: str, error: type[ConfigError] = ConfigError) -> None:
    """Raise `error(message)` unless ok: the one check config dataclasses validate with."""
    if not ok:
        raise error(message)


# ---- types ------------------------------------------------------------------------------------


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type annotations of a dataclass's fields (string annotations evaluated)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _schema_types(cls: type, name: str) -> dict[str, Any] | None:
    """Key types of dict field `name` when it declares a schema (its fields plus any extras)."""
    for f in dataclasses.fields(cls):
        if f.name == name and "schema" in f.metadata:
            return {**field_types(f.metadata["schema"]), **f.metadata.get("extra", {})}
    return None


def type_name(tp: Any) -> str:
    """A short human name for a type annotation (`float`, `int or None`, `'adamw' or 'muon'`)."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {type_name(args[0])}"
        return f"a list of {len(args)} ({', '.join(type_name(a) for a in args)})"
    if origin in (list, dict):
        return "a list" if origin is list else "a table"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` (plain TOML data) checked against and converted to annotation `tp`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if isinstance(value, Mapping) and len(arms) == 1 and dataclasses.is_dataclass(arms[0]):
            return coerce(value, arms[0], key)  # the table's own error names the inner key
        for arm in arms:
            try:
                return coerce(value, arm, key)
            except _NotFinite:
                raise
            except ConfigError:
                continue
        raise _bad(key, value, tp)
    if origin is typing.Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise _bad(key, value, tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _bad(key, value, tp)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _bad(key, value, tp)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):  # TOML reads inf and nan; no setting means either
                raise _NotFinite(f"{key} = {value!r}: expected a finite number")
            return float(value)
        raise _bad(key, value, tp)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _bad(key, value, tp)
    if origin is tuple:
        return _coerce_tuple(value, tp, key)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise _bad(key, value, tp)
        (arg,) = typing.get_args(tp) or (Any,)
        return [coerce(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _bad(key, value, tp)
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise _bad(key, value, tp)
        return from_dict(tp, value, key)
    raise ConfigError(f"{key}: unsupported field type {tp!r}")  # a bug in the dataclass


def _coerce_tuple(value: Any, tp: Any, key: str) -> tuple[Any, ...]:
    """A TOML array as a tuple of the annotated element types."""
    if not isinstance(value, list | tuple):
        raise _bad(key, value, tp)
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        args = (args[0],) * len(value)
    if len(args) != len(value):
        raise _bad(key, value, tp)
    return tuple(
        coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))
    )


def _bad(key: str, value: Any, tp: Any) -> ConfigError:
    """The error for a value of the wrong type or outside the allowed set."""
    return ConfigError(f"{key} = {value!r}: expected {type_name(tp)}")


def _plain_type(tp: Any) -> Any:
    """The annotation with dataclasses replaced by tables, for values kept as plain data."""
    if dataclasses.is_dataclass(tp):
        return dict[str, Any]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(lambda a, b: a | b, [_plain_type(a) for a in typing.get_args(tp)])
    return tp


# ---- dataclass <-> dict -----------------------------------------------------------------------


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """An instance of dataclass `cls` from plain data; unknown keys and bad values name the key."""
    types_ = field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; "
            f"{where or 'the top level'} takes {', '.join(types_)}"
        )
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"missing required config key(s) {', '.join(prefix + m for m in missing)}"
        )
    values = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        schema = _schema_types(cls, name)
        values[name] = (
            _schema_table(schema, value, key) if schema else coerce(value, types_[name], key)
        )
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, KilnError):
            raise
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def _schema_table(types_: dict[str, Any], value: Any, key: str) -> dict[str, Any]:
    """A table whose keys are a schema's fields, kept as plain data (checked, not constructed)."""
    if not isinstance(value, Mapping):
        raise _bad(key, value, dict)
    out = {}
    for name, item in value.items():
        if name not in types_:
            raise ConfigError(f"unknown config key {key}.{name}; {key} takes {', '.join(types_)}")
        out[name] = coerce(item, _plain_type(types_[name]), f"{key}.{name}")
    return out


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain data of a dataclass instance (tuples become lists, as TOML arrays)."""
    return _plain(dataclasses.asdict(obj))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# ---- dotted overrides -------------------------------------------------------------------------


def apply_override(data: dict[str, Any], cls: type, assignment: str) -> None:
    """Apply one `a.b.c=value` to plain config data in place, typed by `cls`'s annotations.

    The value is read as a TOML value (`3e-4`, `true`, `[0.9, 0.95]`, `"text"`); for a string
    field any text is taken literally, and `none`/`null` sets an Optional field to None.
    """
    if "=" not in assignment:
        raise ConfigError("expected KEY=VALUE, e.g. optim.lr=3e-4")
    key, text = (s.strip() for s in assignment.split("=", 1))
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"malformed key {key!r}")
    node: dict[str, Any] = data
    owner: type | None = cls  # the dataclass whose fields name the keys at this depth
    types_: dict[str, Any] | None = field_types(cls)
    for depth, part in enumerate(parts):
        where = ".".join(parts[: depth + 1])
        if types_ is None:
            raise ConfigError(f"unknown config key {key}: {'.'.join(parts[:depth])} is a value")
        if part not in types_:
            parent = ".".join(parts[:depth]) or "the top level"
            raise ConfigError(f"unknown config key {where}; {parent} takes {', '.join(types_)}")
        tp = types_[part]
        if depth == len(parts) - 1:
            node[part] = coerce(parse_value(text, tp, where), _plain_type(tp), where)
            return
        schema = _schema_types(owner, part) if owner is not None else None
        owner = _dataclass_arm(tp)
        types_ = schema or (field_types(owner) if owner is not None else None)
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"unknown config key {key}: {where} is a value")
        node = child


def _dataclass_arm(tp: Any) -> type | None:
    """The dataclass in annotation `tp` (itself, or an arm of `X | None`), if any."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arm in typing.get_args(tp):
        if dataclasses.is_dataclass(arm):
            return arm
    return None


def parse_value(text: str, tp: Any, key: str) -> Any:
    """The TOML value written as `text`, or the text itself for string fields."""
    optional = type(None) in typing.get_args(tp)
    if optional and text.lower() in _NONE_WORDS:
        return None
    if _accepts_str(tp) and not (text.startswith('"') or text.startswith("'")):
        if _non_str_arms(tp):  # e.g. int | Literal["auto"]: "8" is the number
            try:
                value = tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                return text
            if isinstance(value, _non_str_arms(tp)) and not isinstance(value, bool):
                return value
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(f"{key} = {text!r}: expected {type_name(tp)}") from None


def _non_str_arms(tp: Any) -> tuple[type, ...]:
    """The plain non-string types among a union's arms (int, float), if any."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return ()
    return tuple(a for a in typing.get_args(tp) if a in (int, float))


def _accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return any(_accepts_str(a) for a in typing.get_args(tp))
    return False


def load(
    cls: type[T],
    path: str | Path | None,
    overrides: Iterable[str] = (),
    base: Mapping | None = None,
) -> T:
    """Read a TOML file (or start from `base`), apply `--set` overrides, build the dataclass."""
    data: dict[str, Any] = json.loads(json.dumps(base)) if base else {}  # a deep copy
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (invalid byte at {exc.start})") from None
    for assignment in overrides:
        try:
            apply_override(data, cls, assignment)
        except ConfigError as exc:
            raise ConfigError(f"--set {assignment}: {exc}") from None
    try:
        return from_dict(cls, data)
    except KilnError as exc:  # a config's own checks (__post_init__) may raise a plain KilnError
        raise ConfigError(f"{path}: {exc}" if path else str(exc)) from None


# ---- TOML writer ------------------------------------------------------------------------------


def to_toml(data: Mapping[str, Any], header: str = "") -> str:
    """TOML text for plain data: scalars and arrays first, then one [table] per nested mapping."""
    lines = [f"# {line}" for line in header.splitlines()]
    _write_table(data, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _is_table_array(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(v, Mapping) for v in value)
    )


def _write_table(
    data: Mapping[str, Any], path: list[str], lines: list[str], array_item: bool = False
) -> None:
    scalars = {
        k: v
        for k, v in data.items()
        if not isinstance(v, Mapping) and v is not None and not _is_table_array(v)
    }
    tables = {k: v for k, v in data.items() if isinstance(v, Mapping)}
    arrays = {k: v for k, v in data.items() if _is_table_array(v)}
    name = ".".join(_key(p) for p in path)
    if array_item:
        lines.append(f"\n[[{name}]]")
    elif path and (scalars or not (tables or arrays)):
        lines.append(f"\n[{name}]")
    lines.extend(f"{_key(k)} = {toml_value(v)}" for k, v in scalars.items())
    for key, table in tables.items():
        _write_table(table, [*path, key], lines)
    for key, items in arrays.items():
        for item in items:  # an array of tables: one [[key]] header per element
            _write_table(item, [*path, key], lines, array_item=True)


def _key(name: str) -> str:
    bare = name and all(c.isalnum() or c in "-_" for c in name)
    return name if bare else json.dumps(name)


def toml_value(value: Any) -> str:
    """One value as TOML: bool, int, float (inf/nan too), string, or an array of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest text that reads back to the same float
    if isinstance(value, int | str):
        return json.dumps(value)  # JSON's string escapes are valid TOML basic strings
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) as TOML")
