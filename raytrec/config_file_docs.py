"""The configuration reference (``docs/configuration.md``), generated from the config classes.

Every key under :class:`~raytrec.config.TrainConfig`, found by walking the dataclasses as
:mod:`raytrec.config_file` does, with its type, default, allowed values and description. A
field's description is written next to it in the config class: ``metadata={"doc": ...}``, a
trailing ``#`` comment, ``#:`` comment lines above it, or a docstring line (or bullet) that
starts with the field's name in double backquotes and a colon. ``tests/test_config_docs.py``
fails when the committed reference differs from :func:`reference_markdown`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Iterator
from typing import Any, get_type_hints

from raytrec.config import TrainConfig
from raytrec.config_file import (
    allowed_values,
    describe,
    init_fields,
    is_config_class,
    join_key,
    sequence_item,
    strip_optional,
    yaml_text,
)

__all__ = ["REFERENCE_COMMAND", "KeyDoc", "config_keys", "reference_markdown"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyDoc:
    """One settable key of the config tree, as the reference lists it."""

    key: str  # e.g. "scaling.gang_size", "model.tables[].name"
    section: str  # the config class's path: "" for the top level, "model.tables[]"
    type: str
    default: str  # as written in YAML; "required" when there is none
    allowed: tuple[str, ...]  # as written in YAML; empty for open types (int, string, ...)
    doc: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class SectionDoc:
    path: str
    cls: type
    keys: tuple[KeyDoc, ...]


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's documentation: ``metadata["doc"]``, its ``#`` comments, or its docstring entry.

    Written next to the field as a trailing comment or as ``#:`` lines above it; docstring
    lines (or bullets) that start with a field's name in double backquotes and a colon are
    read too.
    """
    docs: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in (inspect.getdoc(cls) or "").splitlines():
        m = re.match(r"^(?:[-*]\s+)?``(\w+)``\s*:\s*(.*)$", line.strip())
        if m:
            current = docs.setdefault(m.group(1), [])
            current.append(m.group(2))
        elif current is not None and line.strip() and not line.lstrip().startswith(("- ", "* ")):
            current.append(line.strip())
        else:
            current = None
    found = {name: " ".join(" ".join(words).split()) for name, words in docs.items()}
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        source = ""
    comments: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string
    except (tokenize.TokenError, SyntaxError):
        pass
    lines = source.splitlines()
    tree = ast.parse(source) if source else None
    body = tree.body[0].body if tree and isinstance(tree.body[0], ast.ClassDef) else []
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        target = node.target.id
        end = node.end_lineno or node.lineno
        trailing = [
            comments[n].lstrip("#").strip()
            for n in range(node.lineno, end + 1)
            if n in comments and not lines[n - 1].lstrip().startswith("#")
        ]
        above: list[str] = []
        n = node.lineno - 1
        while n in comments and lines[n - 1].lstrip().startswith("#:"):
            above.insert(0, comments[n][2:].strip())
            n -= 1
        text = " ".join(above + trailing)
        if text:
            found[target] = text
    for name, f in init_fields(cls).items():
        if "doc" in f.metadata:
            found[name] = str(f.metadata["doc"])
    return found


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return yaml_text(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if isinstance(value, tuple | list) and value and is_config_class(type(value[0])):
            return f"{len(value)} entries from {getattr(f.default_factory, '__name__', '')}()"
        return yaml_text(value)
    return "required"


def _sections(cls: type, path: str = "") -> Iterator[SectionDoc]:
    hints = get_type_hints(cls)
    comments = _field_comments(cls)
    keys: list[KeyDoc] = []
    nested: list[tuple[str, type]] = []
    for name, f in init_fields(cls).items():
        hint = hints[name]
        inner = strip_optional(hint)
        if is_config_class(inner):
            nested.append((join_key(path, name), inner))
            continue
        item = sequence_item(inner)
        if item is not None and is_config_class(item):
            nested.append((join_key(path, name) + "[]", item))
        choices = allowed_values(hint)
        keys.append(
            KeyDoc(
                key=join_key(path, name),
                section=path,
                type=describe(hint),
                default=_default_text(f),
                allowed=tuple(yaml_text(c) for c in choices) if choices is not None else (),
                doc=comments.get(name, ""),
            )
        )
    yield SectionDoc(path=path, cls=cls, keys=tuple(keys))
    for child_path, child in nested:
        yield from _sections(child, child_path)


def config_keys(cls: type = TrainConfig) -> list[KeyDoc]:
    """Every settable key under ``cls``, section by section."""
    return [k for s in _sections(cls) for k in s.keys]


def _markdown_text(text: str) -> str:
    """Sphinx roles and double backquotes in docstrings, as Markdown."""
    text = re.sub(r":\w+:`~?(?:[\w.]*\.)?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return _markdown_text(text).replace("|", "\\|")


REFERENCE_COMMAND = "python -m jobs.config_reference > docs/configuration.md"


def reference_markdown(cls: type = TrainConfig) -> str:
    """``docs/configuration.md``: every key with its type, default, allowed values and doc."""
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
        "`--set 'model.tables[*].num_embeddings=5000'`). An unknown key or a value of the "
        "wrong type fails before anything starts, naming the key, the value and what is "
        "allowed. `python -m jobs.train --print-config` prints the resolved configuration.",
        "",
    ]
    for section in _sections(cls):
        title = f"`{section.path}`" if section.path else "Top level"
        out += [f"## {title}: {section.cls.__name__}", ""]
        doc = inspect.getdoc(section.cls)
        if doc:
            out += [_markdown_text(doc), ""]
        if not section.keys:
            continue
        out += [
            "| key | type | default | allowed | description |",
            "| --- | --- | --- | --- | --- |",
        ]
        for k in section.keys:
            default = f"`{k.default}`" if k.default != "required" else "required"
            allowed = ", ".join(f"`{a}`" for a in k.allowed)
            out.append(
                f"| `{k.key}` | {_cell(k.type)} | {_cell(default)} | {_cell(allowed)} | "
                f"{_cell(k.doc)} |"
            )
        out.append("")
    return "\n".join(out)
