"""The configuration reference (``docs/configuration.md``), generated from the models' JSON schema.

Every key under :class:`~raytrec.config.TrainConfig`, read from ``model_json_schema()``: its
type, default, allowed values and description (the docstring under the field). A section is a
nested config class, introduced by its class docstring. ``tests/unit/test_config_docs.py`` fails
when the committed reference differs from :func:`reference_markdown`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel

from raytrec.config import TrainConfig
from raytrec.config.base import join_key, yaml_flow

__all__ = ["REFERENCE_COMMAND", "KeyDoc", "config_keys", "reference_markdown"]

Schema = dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyDoc:
    """One settable key of the config tree, as the reference lists it."""

    key: str  # e.g. "scaling.gang_size", "model.tables[].name"
    type: str
    default: str  # as written in YAML; "required" when there is none
    allowed: str  # the values or bounds a value must keep to; "" for any of its type
    doc: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class SectionDoc:
    path: str  # "" for the top level, "model.tables[]" for the items of a list
    title: str  # the config class's name
    doc: str
    keys: tuple[KeyDoc, ...]


class _Walker:
    def __init__(self, schema: Schema) -> None:
        self.defs: dict[str, Schema] = schema.get("$defs", {})

    def resolve(self, s: Schema) -> Schema:
        """``s`` with its ``$ref`` filled in; the field's own keys (description, default) win."""
        if "$ref" not in s:
            return s
        target = self.resolve(self.defs[s["$ref"].rsplit("/", 1)[-1]])
        return {**target, **{k: v for k, v in s.items() if k != "$ref"}}

    def members(self, s: Schema) -> list[Schema]:
        """A union's members other than null, resolved; ``[s]`` for anything else."""
        options = s.get("anyOf", [s])
        return [self.resolve(m) for m in options if m.get("type") != "null"]

    def section(self, s: Schema) -> Schema | None:
        """The config class a field holds (alone, optional, or as list items), if any."""
        for member in s.get("anyOf", [s]):
            member = member.get("items", member) if member.get("type") == "array" else member
            if "$ref" in member:
                target = self.resolve({"$ref": member["$ref"]})
                if "properties" in target:
                    return target
        return None

    def type_text(self, s: Schema) -> str:
        s = self.resolve(s)
        if "anyOf" in s:
            return " or ".join(dict.fromkeys(self.type_text(m) for m in s["anyOf"]))
        if "enum" in s:
            return " or ".join(dict.fromkeys(_yaml_type(v) for v in s["enum"]))
        if s.get("type") == "array":
            if "prefixItems" in s:
                return "[" + ", ".join(self.type_text(i) for i in s["prefixItems"]) + "]"
            return f"list of {self.type_text(s.get('items', {}))}"
        if "properties" in s:
            return "mapping"
        if s.get("type") == "object":
            values = s.get("additionalProperties")
            return f"mapping of string to {self.type_text(values)}" if values else "mapping"
        names = {"integer": "int", "number": "float", "boolean": "bool", "string": "string"}
        kind = str(s.get("type", "any"))
        return names.get(kind, kind)

    def allowed(self, s: Schema) -> str:
        """The values or bounds a value keeps to, as the reference shows them; "" for any."""
        s = self.resolve(s)
        if "anyOf" in s:
            members = self.members(s)
            parts = [self.allowed(m) for m in members]
            if all("enum" in m or m.get("type") == "boolean" for m in members):
                parts.append("`null`")  # a closed set of values: null is one of them
            return ", ".join(p for p in parts if p)
        if "enum" in s:
            return ", ".join(f"`{yaml_flow(v)}`" for v in s["enum"])
        if "const" in s:  # a literal of one value
            return f"`{yaml_flow(s['const'])}`"
        if s.get("type") == "boolean":
            return "`true`, `false`"
        if "prefixItems" in s:
            return "[" + ", ".join(self.allowed(i) or "any" for i in s["prefixItems"]) + "]"
        words = {"exclusiveMinimum": ">", "minimum": ">=", "exclusiveMaximum": "<", "maximum": "<="}
        bounds = [f"{word} {s[key]}" for key, word in words.items() if key in s]
        if s.get("minLength") or s.get("minItems") == 1:
            bounds.append("non-empty")
        elif s.get("minItems"):
            bounds.append(f"at least {s['minItems']} entries")
        inner = s.get("items") or s.get("additionalProperties")
        if isinstance(inner, dict) and "properties" not in self.resolve(inner):
            each = self.allowed(inner)
            if each:
                bounds.append(f"each {each}")
        return ", ".join(bounds)


def _yaml_type(value: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "string"}.get(type(value), "null")


def _default_text(s: Schema) -> str:
    if "default" not in s:
        return "required"
    value = s["default"]
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return f"{len(value)} entries"
    return yaml_flow(value)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _sections(w: _Walker, s: Schema, path: str, title: str) -> Iterator[SectionDoc]:
    keys: list[KeyDoc] = []
    nested: list[tuple[str, Schema]] = []
    for name, prop in s.get("properties", {}).items():
        key = join_key(path, name)
        inner = w.section(prop)
        resolved = w.resolve(prop)
        if inner is not None:
            many = any(m.get("type") == "array" for m in w.members(resolved))
            nested.append((key + ("[]" if many else ""), inner))
            if "properties" in resolved:  # always present: a section, not a key
                continue
        keys.append(
            KeyDoc(
                key=key,
                type=w.type_text(resolved),
                default=_default_text(resolved),
                allowed=w.allowed(resolved),
                doc=_one_line(resolved.get("description", "")),
            )
        )
    yield SectionDoc(path=path, title=title, doc=s.get("description", ""), keys=tuple(keys))
    for child_path, child in nested:
        yield from _sections(w, child, child_path, child.get("title", ""))


def _all_sections(cls: type[BaseModel]) -> list[SectionDoc]:
    schema = cls.model_json_schema()
    return list(_sections(_Walker(schema), schema, "", schema.get("title", cls.__name__)))


def config_keys(cls: type[BaseModel] = TrainConfig) -> list[KeyDoc]:
    """Every settable key under ``cls``, section by section."""
    return [k for s in _all_sections(cls) for k in s.keys]


def _markdown_text(text: str) -> str:
    """Sphinx roles and double backquotes in docstrings, as Markdown."""
    text = re.sub(r":\w+:`~?(?:[\w.]*\.)?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return _markdown_text(text).replace("|", "\\|")


REFERENCE_COMMAND = "python -m jobs.config_reference > docs/configuration.md"


def reference_markdown(
    cls: type[BaseModel] = TrainConfig, job_defaults: Sequence[tuple[str, Any]] = ()
) -> str:
    """``docs/configuration.md``: every key with its type, default, allowed values and doc, and
    the ``job_defaults`` with which ``python -m jobs.train`` departs from the defaults."""
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the config classes by `{REFERENCE_COMMAND}`; "
        "edit the classes, not this file. -->",
        "",
        "A job's configuration is one YAML file whose keys mirror the config classes below "
        "(`python -m jobs.train --config FILE`). Keys left out take the defaults listed here; "
        "`--set KEY=VALUE` (repeatable) overrides one key after the file, the value read as "
        "YAML (`--set scaling.num_workers=8`, `--set model.dense_arch_layers=[64,16]`, "
        "`--set 'model.tables[*].num_embeddings=5000'`). An unknown key or a wrong value "
        "fails before anything starts, naming the key, the value and what is allowed. "
        "`python -m jobs.train --print-config` prints the resolved configuration. The "
        "`testing` section is for tests and benchmarks only.",
        "",
    ]
    if job_defaults:
        out += [
            "## The job's own defaults",
            "",
            "`python -m jobs.train` starts from these values where they differ from the "
            "classes' defaults (a 1000-step job on generated data with a held-out split); the "
            "config file, the shortcut flags and `--set` override them.",
            "",
            "| key | value |",
            "| --- | --- |",
            *(f"| `{key}` | `{_cell(yaml_flow(value))}` |" for key, value in job_defaults),
            "",
        ]
    for section in _all_sections(cls):
        title = f"`{section.path}`" if section.path else "Top level"
        out += [f"## {title}: {section.title}", ""]
        if section.doc:
            out += [_markdown_text(section.doc), ""]
        if not section.keys:
            continue
        out += [
            "| key | type | default | allowed | description |",
            "| --- | --- | --- | --- | --- |",
        ]
        for k in section.keys:
            default = f"`{k.default}`" if k.default != "required" else "required"
            out.append(
                f"| `{k.key}` | {_cell(k.type)} | {_cell(default)} | {_cell(k.allowed)} | "
                f"{_cell(k.doc)} |"
            )
        out.append("")
    return "\n".join(out)
