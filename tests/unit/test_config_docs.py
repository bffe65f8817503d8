"""docs/configuration.md is the generator's output: every key of the config models, each with a
description, its default and what it allows, read from the models' JSON schema."""

from __future__ import annotations

import pathlib
import re
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from jobs.train import JOB_DEFAULTS
from raytrec.config import TrainConfig
from raytrec.config.base import ConfigModel, Lax, PositiveInt, Seq
from raytrec.config.file_docs import config_keys, reference_markdown

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([^`]+)` \| ([^|]*) \| ([^|]*) \| ([^|]*) \| (.*) \|$")


def documented_rows() -> dict[str, tuple[str, str, str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is documented twice"
            rows[m.group(1)] = tuple(g.strip() for g in m.groups()[1:])  # type: ignore[assignment]
    return rows


def models_in(hint: Any) -> list[type[BaseModel]]:
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return [hint]
    return [m for arg in typing.get_args(hint) for m in models_in(arg)]


def class_fields(cls: type[BaseModel], prefix: str = "") -> dict[str, tuple[type, str]]:
    """Every settable key, walked straight from the models' fields (independent of the
    generator): ``key -> (owning class, field name)``. A section that is always there is not a
    key; a list of sections or an optional section is a key and a section."""
    keys: dict[str, tuple[type, str]] = {}
    for name, field in cls.model_fields.items():
        inner = models_in(field.annotation)
        if field.annotation not in inner:
            keys[prefix + name] = (cls, name)
        for child in inner:
            many = typing.get_origin(field.annotation) is tuple
            keys.update(class_fields(child, f"{prefix}{name}{'[]' if many else ''}."))
    return keys


def test_the_reference_is_the_generators_output() -> None:
    assert DOC.read_text() == reference_markdown(job_defaults=JOB_DEFAULTS), (
        "docs/configuration.md is out of date: python -m jobs.config_reference > "
        "docs/configuration.md"
    )


def test_every_key_is_documented_with_a_description() -> None:
    rows = documented_rows()
    fields = class_fields(TrainConfig)
    assert set(rows) == set(fields)
    assert {"scaling.gang_size", "model.tables", "model.tables[].num_embeddings"} <= set(rows)
    assert {"testing.faults", "testing.faults[].kind", "testing.stragglers.rate"} <= set(rows)
    assert not {k for k in rows if k.startswith(("faults", "stragglers"))}
    empty = [key for key, (_, _, _, doc) in rows.items() if not doc]
    assert empty == []
    # Every field of every config class has its own description, sections included.
    for cls in {c for c, _ in fields.values()} | {TrainConfig}:
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"


def test_documented_defaults_and_allowed_values_match_the_classes() -> None:
    rows = documented_rows()
    checked = 0
    for key, (cls, name) in class_fields(TrainConfig).items():
        _, default, allowed, _ = rows[key]
        field = cls.model_fields[name]  # type: ignore[attr-defined]
        if field.is_required():
            assert default == "required", key
        elif not (default.endswith("entries`") or field.default_factory):
            value = field.default
            value = value.value if hasattr(value, "value") else value
            value = list(value) if isinstance(value, tuple) else value
            assert yaml.safe_load(default.strip("`")) == value, key
            checked += 1
        hint = field.annotation
        literals = [a for a in [hint, *typing.get_args(hint)] if typing.get_origin(a) is Literal]
        if literals and typing.get_origin(hint) not in (dict, tuple):
            listed = [yaml.safe_load(a.strip(" `")) for a in allowed.split(",")]
            assert [v for v in listed if v is not None] == list(typing.get_args(literals[0]))
    assert checked >= 60


class Documented(ConfigModel):
    """A config class with one field of each kind the reference shows."""

    count: PositiveInt = 1
    """A positive count."""
    mode: Literal["a", "b"] | None = None
    """A choice."""
    sizes: Seq[PositiveInt] = (1, 2)
    """A list."""
    flag: Lax[bool] = True
    """A switch."""


def test_a_fields_row_shows_its_type_default_allowed_values_and_description() -> None:
    keys = {k.key: k for k in config_keys(Documented)}
    assert [(k.type, k.default, k.allowed, k.doc) for k in keys.values()] == [
        ("int", "1", "> 0", "A positive count."),
        ("string or null", "null", "`a`, `b`, `null`", "A choice."),
        ("list of int", "[1, 2]", "each > 0", "A list."),
        ("bool", "true", "`true`, `false`", "A switch."),
    ]
    text = reference_markdown(Documented)
    assert "| `count` | int | `1` | > 0 | A positive count. |" in text
    assert "## Top level: Documented\n\nA config class with one field of each kind" in text
