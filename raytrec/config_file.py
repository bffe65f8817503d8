"""One YAML file per job, mapped onto the tree of frozen config dataclasses under TrainConfig.

Nothing here names a config class: loading, ``--set`` overrides and dumping (and the reference
in ``docs/configuration.md``, :mod:`raytrec.config_file_docs`) walk ``dataclasses.fields`` and
the type hints, so a config class hung under :class:`~raytrec.config.TrainConfig` later is
covered without touching this module. This
module checks key names and value types, and an error names the key path (``scaling.gang_size``),
the value and what is allowed; rules about values stay in the classes' own ``__post_init__``.

Precedence, lowest first: the classes' defaults, the job's defaults, the file, overrides.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from raytrec.config import ConfigError, TrainConfig

__all__ = [
    "Override",
    "allowed_values",
    "apply_override",
    "describe",
    "dump",
    "from_dict",
    "init_fields",
    "is_config_class",
    "join_key",
    "load_config",
    "parse_override",
    "read_yaml",
    "sequence_item",
    "strip_optional",
    "to_dict",
    "yaml_text",
]

T = typing.TypeVar("T")


# --- YAML -----------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats and duplicate keys refused.

    YAML 1.1 reads ``1e-8`` as a string; a config file means a number there. A key written
    twice would otherwise keep the last value silently.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"key {key!r} appears twice in one mapping ({key_node.start_mark})"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(text: str, *, source: str = "<string>") -> Any:
    """Parses YAML text; a syntax error becomes a :class:`ConfigError` naming ``source``."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {e}") from None


# --- types ----------------------------------------------------------------------------------


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


def _non_null(hint: Any) -> list[Any]:
    """A union's members other than None. ``SomeStrEnum | str`` (a field that also takes the
    enum's value as a plain string) counts as the enum alone."""
    members = [a for a in get_args(hint) if a is not type(None)]
    if str in members and any(_is_str_enum(a) for a in members):
        members.remove(str)
    return members


def _is_str_enum(hint: Any) -> bool:
    return (
        isinstance(hint, type)
        and issubclass(hint, enum.Enum)
        and all(isinstance(m.value, str) for m in hint)
    )


def strip_optional(hint: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    if _is_union(hint):
        members = _non_null(hint)
        if len(members) == 1:
            return members[0]
    return hint


def is_config_class(hint: Any) -> bool:
    """A config section: a dataclass type."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def sequence_item(hint: Any) -> Any | None:
    """The item type of ``tuple[X, ...]`` or ``list[X]``; None for other types."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is list and len(args) == 1:
        return args[0]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def init_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The fields a config file can set: those the constructor takes."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def join_key(path: str, key: str) -> str:
    """``join_key("scaling", "gang_size")`` is ``"scaling.gang_size"``; the top level is ``""``."""
    return f"{path}.{key}" if path else key


def describe(hint: Any) -> str:
    """The type as a config file writer sees it: ``int``, ``list of int``, ``string or null``."""
    if hint is Any:
        return "any"
    if _is_union(hint):
        names = [describe(a) for a in _non_null(hint)]
        if type(None) in get_args(hint):
            names.append("null")
        return " or ".join(dict.fromkeys(names))
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return " or ".join(dict.fromkeys(_yaml_type_name(type(a)) for a in args))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " or ".join(dict.fromkeys(_yaml_type_name(type(m.value)) for m in hint))
    if is_config_class(hint):
        return "mapping"
    item = sequence_item(hint)
    if item is not None:
        return f"list of {describe(item)}"
    if origin is tuple:
        return "[" + ", ".join(describe(a) for a in args) + "]"
    if origin is dict:
        return f"mapping of string to {describe(args[1])}" if len(args) == 2 else "mapping"
    return _yaml_type_name(hint)


def _yaml_type_name(t: Any) -> str:
    names = {bool: "bool", int: "int", float: "float", str: "string", type(None): "null"}
    return names.get(t, getattr(t, "__name__", str(t)))


def allowed_values(hint: Any) -> list[Any] | None:
    """The finite set of values a key takes (Literal, enum, bool, plus null), else None."""
    values: list[Any] = []
    for member in _non_null(hint) if _is_union(hint) else [hint]:
        if get_origin(member) is Literal:
            values += list(get_args(member))
        elif isinstance(member, type) and issubclass(member, enum.Enum):
            values += [m.value for m in member]
        elif member is bool:
            values += [True, False]
        else:
            return None  # an open type (int, str, ...) among the members
    if _is_union(hint) and type(None) in get_args(hint):
        values.append(None)
    return values


def yaml_text(value: Any) -> str:
    """A value as YAML flow text: ``true``, ``null``, ``[64, 16]``, ``table_wise``."""
    text = yaml.dump(_plain(value), Dumper=yaml.SafeDumper, default_flow_style=True)
    return text.removesuffix("\n...\n").strip()


def _show(value: Any) -> str:
    """A value in an error message: strings quoted, everything else as YAML."""
    return repr(value) if isinstance(value, str) else yaml_text(value)


def _literal_match(value: Any, choice: Any) -> bool:
    # True == 1 in Python; a config value must match the choice's type too.
    return type(value) is type(choice) and value == choice


def _convert(hint: Any, value: Any, path: str) -> Any:
    """``value`` (parsed YAML) as the Python value ``hint`` describes, or a ConfigError."""
    if hint is Any:
        return value
    if _is_union(hint):
        if value is None and type(None) in get_args(hint):
            return None
        members = _non_null(hint)
        if len(members) == 1:
            return _convert(members[0], value, path)
        for member in members:
            try:
                return _convert(member, value, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}={_show(value)} is not a {describe(hint)}")
    origin, args = get_origin(hint), get_args(hint)
    choices = allowed_values(hint)
    if origin is Literal or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        assert choices is not None
        for choice in choices:
            if _literal_match(value, choice):
                return hint(choice) if isinstance(hint, type) else choice
        raise ConfigError(
            f"{path}={_show(value)} is not one of {', '.join(_show(c) for c in choices)}"
        )
    if is_config_class(hint):
        return from_dict(hint, value, path=path)
    item = sequence_item(hint)
    if item is not None or origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path} must be a {describe(hint)}, got {_show(value)}")
        if item is None and len(value) != len(args):
            raise ConfigError(
                f"{path}={_show(value)} must have {len(args)} entries: {describe(hint)}"
            )
        hints = [item] * len(value) if item is not None else list(args)
        out = [
            _convert(h, v, f"{path}[{i}]")
            for i, (h, v) in enumerate(zip(hints, value, strict=False))
        ]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path} must be a {describe(hint)}, got {_show(value)}")
        key_hint, value_hint = args if len(args) == 2 else (Any, Any)
        return {
            _convert(key_hint, k, path): _convert(value_hint, v, join_key(path, str(k)))
            for k, v in value.items()
        }
    return _convert_scalar(hint, value, path)


def _convert_scalar(hint: Any, value: Any, path: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={_show(value)} is not a bool; allowed: true, false")
    if hint is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={_show(value)} is not an integer")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}={_show(value)} is not a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}={_show(value)} is not a string (quote it in YAML)")
    if hint is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}={_show(value)} must be null")
    return value  # a type this module does not know: the class validates it


# --- mapping <-> dataclasses ----------------------------------------------------------------


def _unknown_key(cls: type, path: str, key: Any) -> ConfigError:
    valid = list(init_fields(cls))
    full = join_key(path, str(key))
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f" (did you mean {join_key(path, close[0])!r}?)" if close else ""
    where = f"under {path!r}" if path else "at the top level"
    return ConfigError(f"unknown key {full!r}{hint}; allowed keys {where}: {', '.join(valid)}")


def from_dict(cls: type[T], data: Any, *, path: str = "") -> T:
    """Builds ``cls`` from a mapping (parsed YAML), checking keys and value types.

    Keys left out take the class's defaults. The class validates the values it gets in its own
    ``__post_init__`` (a :class:`ConfigError` naming the field).
    """
    if not isinstance(data, Mapping):
        where = path or "the configuration"
        raise ConfigError(
            f"{where} must be a mapping with keys {', '.join(init_fields(cls))}; got {_show(data)}"
        )
    fields = init_fields(cls)
    for key in data:
        if key not in fields:
            raise _unknown_key(cls, path, key)
    hints = get_type_hints(cls)
    missing = [
        name
        for name, f in fields.items()
        if name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = path or "the configuration"
        raise ConfigError(f"{where} is missing the required keys {', '.join(missing)}")
    kwargs = {key: _convert(hints[key], value, join_key(path, key)) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from None


def _plain(value: Any) -> Any:
    """A config value as plain YAML data: mappings, lists, str, int, float, bool, None."""
    if is_config_class(type(value)):
        return to_dict(value)
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


def to_dict(config: Any) -> dict[str, Any]:
    """A config dataclass as a plain mapping, in field order (the inverse of :func:`from_dict`)."""
    return {name: _plain(getattr(config, name)) for name in init_fields(type(config))}


class _Dumper(yaml.SafeDumper):
    """Mappings as blocks, lists of scalars inline (``[64, 16]``), lists of mappings as blocks."""

    def represent_list(self, data: list[Any]) -> yaml.SequenceNode:
        flow = all(not isinstance(v, dict | list) for v in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _Dumper.represent_list)


def dump(config: Any) -> str:
    """The config as YAML that :func:`load_config` reads back to an equal config."""
    return yaml.dump(to_dict(config), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


# --- overrides ------------------------------------------------------------------------------

_SEGMENT = re.compile(r"^([A-Za-z_]\w*)((?:\[(?:-?\d+|\*)\])*)$")
Part = str | int  # a mapping key, a list index (negative: from the end), or "[*]" (every entry)
EVERY = "[*]"


def _parse_key(key: str) -> list[Part]:
    parts: list[Part] = []
    for segment in key.split("."):
        m = _SEGMENT.match(segment)
        if not m:
            raise ConfigError(
                f"bad key {key!r}: expected dotted names with optional list indexes, "
                "e.g. scaling.num_workers, model.tables[0].num_embeddings, model.tables[*].name"
            )
        parts.append(m.group(1))
        for index in re.findall(r"\[(-?\d+|\*)\]", m.group(2)):
            parts.append(EVERY if index == "*" else int(index))
    return parts


def parse_override(text: str) -> tuple[str, Any]:
    """``"scaling.num_workers=8"`` -> ``("scaling.num_workers", 8)``; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like KEY=VALUE, e.g. sync.sync_every=2")
    return key.strip(), read_yaml(raw, source=f"the value of override {key.strip()!r}")


def apply_override(tree: dict[str, Any], cls: type, key: str, value: Any) -> None:
    """Sets ``key`` (a dotted path, ``[i]`` / ``[*]`` into lists) in a mapping tree for ``cls``.

    Key names are checked against the classes as the path is walked, so a typo is reported
    with the valid keys even where the tree holds no entry yet.
    """
    _assign(tree, cls, _parse_key(key), value, "")


def _assign(node: Any, hint: Any, parts: list[Part], value: Any, path: str) -> None:
    hint = strip_optional(hint)
    part, rest = parts[0], parts[1:]
    if is_config_class(hint):
        if isinstance(part, int) or part == EVERY:
            raise ConfigError(f"{path} is a mapping, not a list: use {path}.<key>")
        if part not in init_fields(hint):
            raise _unknown_key(hint, path, part)
        if not isinstance(node, dict):
            raise ConfigError(f"{path} must be a mapping, got {_show(node)}")
        child_path = join_key(path, part)
        if not rest:
            node[part] = value
            return
        child_hint = get_type_hints(hint)[part]
        if node.get(part) is None and is_config_class(strip_optional(child_hint)):
            node[part] = {}
        if node.get(part) is None:
            raise ConfigError(f"{child_path} is not set; set it whole first: {child_path}=...")
        _assign(node[part], child_hint, rest, value, child_path)
        return
    item = sequence_item(hint)
    if item is not None or get_origin(hint) is tuple:
        if part != EVERY and not isinstance(part, int):
            raise ConfigError(f"{path} is a list: use {path}[i] or {path}[*], not .{part}")
        if not isinstance(node, list):
            raise ConfigError(f"{path} must be a list, got {_show(node)}")
        if part == EVERY:
            indexes = list(range(len(node)))
        elif -len(node) <= int(part) < len(node):
            indexes = [int(part) % len(node)]
        else:
            raise ConfigError(f"{path}[{part}] is out of range: {path} has {len(node)} entries")
        for i in indexes:
            if rest:
                item_hint = item if item is not None else get_args(hint)[i]
                _assign(node[i], item_hint, rest, value, f"{path}[{i}]")
            else:
                node[i] = value
        return
    raise ConfigError(
        f"{path} is not a mapping (its type: {describe(hint)}); it has no key {part!r}"
    )


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` laid over ``base``: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


Override = str | tuple[str, Any]  # "KEY=VALUE" (the value read as YAML) or (key, value)


def _override(item: Override) -> tuple[str, Any]:
    return parse_override(item) if isinstance(item, str) else item


def load_config(
    path: str | None = None,
    overrides: Sequence[Override] = (),
    *,
    defaults: Sequence[Override] = (),
    cls: type[T] = TrainConfig,  # type: ignore[assignment]
) -> T:
    """Reads a job's config: class defaults, then ``defaults``, the file, then ``overrides``.

    ``defaults`` and ``overrides`` hold ``"KEY=VALUE"`` strings (see :func:`parse_override`)
    or ``(key, value)`` pairs, applied in order.
    """
    tree = to_dict(cls())
    for item in defaults:
        apply_override(tree, cls, *_override(item))
    if path is not None:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        data = read_yaml(text, source=path)
        if data is not None:
            if not isinstance(data, Mapping):
                raise ConfigError(f"{path} must hold a mapping of keys, got {_show(data)}")
            tree = _merge(tree, data)
    for item in overrides:
        apply_override(tree, cls, *_override(item))
    return from_dict(cls, tree)
