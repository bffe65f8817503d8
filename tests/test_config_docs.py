"""docs/configuration.md lists exactly the config classes' keys, and is the generator's output."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import typing
from typing import Any, Literal

import yaml

from raytrec.config import ConfigError, TrainConfig
from raytrec.config_file_docs import config_keys, reference_markdown

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([^`]+)` \| ([^|]*) \| ([^|]*) \| ([^|]*) \|")


def documented_rows() -> dict[str, tuple[str, str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is documented twice"
            rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip(), m.group(4).strip())
    return rows


def unwrap_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if type(None) in typing.get_args(hint) and len(args) == 1 else hint


def class_keys(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every settable key, walked straight from the dataclasses (independent of the generator):
    nested config classes are sections, tuples of config classes are lists of mappings."""
    keys: dict[str, dataclasses.Field] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(hint):
            keys.update(class_keys(hint, f"{prefix}{f.name}."))
            continue
        keys[prefix + f.name] = f
        args = typing.get_args(hint)
        if typing.get_origin(hint) is tuple and args and dataclasses.is_dataclass(args[0]):
            keys.update(class_keys(args[0], f"{prefix}{f.name}[]."))
    return keys


def test_the_reference_is_the_generators_output() -> None:
    assert DOC.read_text() == reference_markdown(), (
        "docs/configuration.md is out of date: python -m jobs.config_reference > "
        "docs/configuration.md"
    )


def test_every_documented_key_exists_and_every_key_is_documented() -> None:
    documented = set(documented_rows())
    actual = set(class_keys(TrainConfig))
    assert documented - actual == set(), "documented keys that no config class has"
    assert actual - documented == set(), "config keys missing from docs/configuration.md"
    # A few keys named in the issue, to make sure the walk itself reaches them.
    assert {"scaling.gang_size", "model.tables", "model.tables[].num_embeddings"} <= actual


def test_documented_defaults_and_allowed_values_match_the_classes() -> None:
    rows = documented_rows()
    fields = class_keys(TrainConfig)
    checked = 0
    for key, f in fields.items():
        _, default, allowed = rows[key]
        if f.default is not dataclasses.MISSING:
            value = f.default.value if hasattr(f.default, "value") else f.default
            value = list(value) if isinstance(value, tuple) else value
            assert yaml.safe_load(default.strip("`")) == value, key
            checked += 1
        hint = unwrap_optional(typing.get_type_hints(_owner(key))[f.name])
        if typing.get_origin(hint) is Literal:
            listed = [yaml.safe_load(a.strip(" `")) for a in allowed.split(",")]
            assert listed == list(typing.get_args(hint)), key
    assert checked >= 30


def _owner(key: str) -> type:
    cls: Any = TrainConfig
    for part in key.split(".")[:-1]:
        hint = unwrap_optional(typing.get_type_hints(cls)[part.removesuffix("[]")])
        cls = typing.get_args(hint)[0] if part.endswith("[]") else hint
    return cls


# --- where field descriptions come from ---------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Documented:
    """A config class documented in each supported way.

    ``from_docstring``: written in the class docstring,
    over two lines.

    - ``from_bullet``: a bullet in the docstring.
    """

    trailing: int = 1  # a trailing comment
    #: a comment line above the field
    above: str = "x"
    from_docstring: bool = True
    from_bullet: float = 0.5
    from_metadata: int = dataclasses.field(default=2, metadata={"doc": "field metadata"})
    undocumented: int | None = None

    def __post_init__(self) -> None:
        if self.trailing < 0:
            raise ConfigError("trailing must be >= 0")


def test_field_descriptions_come_from_comments_docstrings_and_metadata() -> None:
    docs = {k.key: k.doc for k in config_keys(Documented)}
    assert docs == {
        "trailing": "a trailing comment",
        "above": "a comment line above the field",
        "from_docstring": "written in the class docstring, over two lines.",
        "from_bullet": "a bullet in the docstring.",
        "from_metadata": "field metadata",
        "undocumented": "",
    }
    text = reference_markdown(Documented)
    assert "| `undocumented` | int or null | `null` | `null` |" not in text  # open type: no list
    assert "| `undocumented` | int or null | `null` |  |" in text
    assert "| `from_docstring` | bool | `true` | `true`, `false` |" in text
