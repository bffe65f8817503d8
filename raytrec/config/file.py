"""One YAML file per job, read into the config models under :class:`~raytrec.config.TrainConfig`.

Loading lays the file and the ``--set`` overrides over the plain data of the defaults and
validates the result once: pydantic checks key names and values, and an error names the key
path (``scaling.gang_size``), the value and what is allowed (:mod:`raytrec.config.base`).
Nothing here names a config class, so a section added later is covered as it is.

Precedence, lowest first: the classes' defaults, the job's defaults, the file, overrides.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

from raytrec.config import TrainConfig
from raytrec.config.base import ConfigError, join_key, validate, yaml_flow

__all__ = [
    "Override",
    "apply_override",
    "dump",
    "load_config",
    "parse_override",
    "read_yaml",
    "to_dict",
]

M = TypeVar("M", bound=BaseModel)


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


def to_dict(config: BaseModel) -> dict[str, Any]:
    """A config as plain data (lists, strings, numbers), in field order; :func:`load_config`
    and :func:`~raytrec.config.base.validate` read it back to an equal config."""
    return config.model_dump(mode="json")


class _Dumper(yaml.SafeDumper):
    """Mappings as blocks, lists of scalars inline (``[64, 16]``), lists of mappings as blocks."""

    def represent_list(self, data: list[Any]) -> yaml.SequenceNode:
        flow = all(not isinstance(v, dict | list) for v in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _Dumper.represent_list)


def dump(config: BaseModel) -> str:
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


def apply_override(tree: dict[str, Any], key: str, value: Any) -> None:
    """Sets ``key`` (a dotted path, ``[i]`` / ``[*]`` into lists) in a config's plain data.

    A section that is null gets a mapping; a key no config class has is left for validation,
    which names it with the keys allowed there.
    """
    _assign(tree, _parse_key(key), value, "")


def _assign(node: Any, parts: list[Part], value: Any, path: str) -> None:
    part, rest = parts[0], parts[1:]
    if isinstance(node, list):
        if part != EVERY and not isinstance(part, int):
            raise ConfigError(f"{path} is a list: use {path}[i] or {path}[*], not .{part}")
        if part == EVERY:
            indexes = list(range(len(node)))
        elif -len(node) <= int(part) < len(node):
            indexes = [int(part) % len(node)]
        else:
            raise ConfigError(f"{path}[{part}] is out of range: {path} has {len(node)} entries")
        for i in indexes:
            if rest:
                _assign(node[i], rest, value, f"{path}[{i}]")
            else:
                node[i] = value
        return
    if not isinstance(node, dict):
        raise ConfigError(f"{path} is {yaml_flow(node)}, not a mapping: it has no key {part!r}")
    if isinstance(part, int) or part == EVERY:
        raise ConfigError(f"{path} is a mapping, not a list: use {path}.<key>")
    child = join_key(path, part)
    if not rest:
        node[part] = value
        return
    if node.get(part) is None:
        if not isinstance(rest[0], str):
            raise ConfigError(f"{child} is not set; set it whole first: {child}=[...]")
        node[part] = {}
    _assign(node[part], rest, value, child)


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
    cls: type[M] = TrainConfig,  # type: ignore[assignment]
) -> M:
    """Reads a job's config: class defaults, then ``defaults``, the file, then ``overrides``.

    ``defaults`` and ``overrides`` hold ``"KEY=VALUE"`` strings (see :func:`parse_override`)
    or ``(key, value)`` pairs, applied in order.
    """
    tree = to_dict(cls())
    for item in defaults:
        apply_override(tree, *_override(item))
    if path is not None:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        data = read_yaml(text, source=path)
        if data is not None:
            if not isinstance(data, Mapping):
                raise ConfigError(f"{path} must hold a mapping of keys, got {yaml_flow(data)}")
            tree = _merge(tree, data)
    for item in overrides:
        apply_override(tree, *_override(item))
    return validate(cls, tree)
