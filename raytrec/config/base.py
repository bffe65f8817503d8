"""The base of every config class: a frozen pydantic model whose errors are :class:`ConfigError`.

A config class is a :class:`ConfigModel`: typed, frozen, ``extra="forbid"``, and strict about
scalars (``True`` is not an integer, ``"3"`` is not a number), while lists (YAML's sequences)
become tuples and an enum takes its value as a string. Each field's description is the
docstring written under it; ``docs/configuration.md`` is generated from the models' JSON schema
(:mod:`raytrec.config.file_docs`). The constrained types below are the one place where "a
positive integer" and the like are defined. Rules that span fields are ``model_validator``
methods that raise :class:`ConfigError` naming the keys.

Whether built in Python or read from YAML, a bad value fails with one :class:`ConfigError` that
names the key path (``scaling.gang_size``), the value and what is allowed.
"""

from __future__ import annotations

import difflib
import functools
import re
import typing
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, Any, Self, TypeVar

import yaml
from annotated_types import Ge, Gt, Interval
from pydantic import BaseModel, ConfigDict, Strict, StringConstraints, ValidationError
from pydantic_core import ErrorDetails

from raytrec.errors import ConfigError

__all__ = [
    "ConfigError",
    "ConfigModel",
    "Lax",
    "Name",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PositiveFloat",
    "PositiveInt",
    "Probability",
    "Seq",
    "config_error",
    "join_key",
    "root",
    "validate",
    "yaml_flow",
]

T = TypeVar("T")

PositiveInt = Annotated[int, Gt(0)]
NonNegativeInt = Annotated[int, Ge(0)]
PositiveFloat = Annotated[float, Gt(0)]
NonNegativeFloat = Annotated[float, Ge(0)]
Probability = Annotated[float, Interval(ge=0, le=1)]
#: A non-empty string (a name, a path, a column).
Name = Annotated[str, StringConstraints(min_length=1)]
#: An immutable sequence, given as a list (YAML) or a tuple; its items stay strict.
Seq = Annotated[tuple[T, ...], Strict(False)]
#: A value converted from its plain form (an enum from its string).
Lax = Annotated[T, Strict(False)]

if TYPE_CHECKING:
    from pydantic._internal._model_construction import ModelMetaclass as _Meta
else:

    class _Meta(type(BaseModel)):
        # Direct construction (``ScalingConfig(gang_size=3)``) raises ConfigError. Nested
        # models are built by pydantic without this call, so one error names the whole path.
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().__call__(*args, **kwargs)
            except ValidationError as e:
                raise config_error(e, cls) from None


#: Keys that moved, by their old path: an old config file is told where each went.
MOVED_KEYS = {"faults": "testing.faults", "stragglers": "testing.stragglers"}
#: Keys that were removed, by their path: an old config file is told why.
REMOVED_KEYS = {
    "sync.merge": (
        "sync.merge was removed: its only other value, touched_mean, lowered the AUC in every "
        "measurement (docs/benchmarks.md, docs/movielens.md); every sync is the plain mean, "
        "so delete the key"
    ),
}


class ConfigModel(BaseModel, metaclass=_Meta):
    """A frozen, validated config section; see the module doc."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
    )

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes``, validated again (as ``dataclasses.replace``)."""
        return type(self)(**{**dict(self), **changes})


M = TypeVar("M", bound=BaseModel)


def validate(cls: type[M], data: Any) -> M:
    """``cls`` from plain data (parsed YAML or JSON); a bad key or value is a ConfigError."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise config_error(e, cls) from None


# --- error messages -------------------------------------------------------------------------


def join_key(path: str, key: str | int) -> str:
    """``scaling`` + ``gang_size`` is ``scaling.gang_size``; ``model.tables`` + 0 is
    ``model.tables[0]``; the top level is ``""``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _models_in(hint: Any) -> Iterable[type[BaseModel]]:
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        yield hint
    for arg in typing.get_args(hint):
        yield from _models_in(arg)


def _model_at(cls: type[BaseModel], loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The config class found at ``loc`` under ``cls`` (list indexes skipped)."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(part)
        found = next(iter(_models_in(field.annotation)), None) if field else None
        if found is None:
            return None
        cls = found
    return cls


_ROOTS: list[type[BaseModel]] = []
R = TypeVar("R", bound=type[BaseModel])


def root(cls: R) -> R:
    """Marks ``cls`` as a whole job's config: a class under it, built alone, names its errors'
    keys from there (``ScalingConfig(gang_size=0)``: ``scaling.gang_size``)."""
    _ROOTS.append(cls)
    return cls


@functools.cache
def _section(cls: type[BaseModel]) -> str:
    """Where ``cls`` sits in a job's config (``scaling``, ``model.tables[]``); "" if nowhere."""
    todo: list[tuple[type[BaseModel], str]] = [(r, "") for r in _ROOTS]
    while todo:
        node, path = todo.pop()
        if node is cls:
            return path
        for name, field in node.model_fields.items():
            many = typing.get_origin(field.annotation) in (tuple, list)
            for child in _models_in(field.annotation):
                todo.append((child, join_key(path, name) + ("[]" if many else "")))
    return ""


def yaml_flow(value: Any) -> str:
    """A plain value as one line of YAML: ``20``, ``[64, 16]``, ``null``."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1000)
    return text.removesuffix("\n...\n").strip()


def _show(value: Any) -> str:
    """A value in an error message: strings quoted, everything else as YAML flow text."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    try:
        return yaml_flow(value)
    except yaml.YAMLError:
        return repr(value)


def _issue(err: ErrorDetails, cls: type[BaseModel], prefix: str) -> str:
    loc = tuple(err["loc"])
    path = prefix
    for part in loc:
        path = join_key(path, part)
    kind = err["type"]
    if kind == "value_error":
        # A rule across fields names its keys from the top, but an item of a list cannot know
        # its index: its errors say where they are.
        message = str(err.get("ctx", {}).get("error", err["msg"]))
        return f"{path}: {message}" if "[" in path else message
    if kind == "missing":
        return f"{path} is required"
    if kind == "extra_forbidden" and path in REMOVED_KEYS:
        return REMOVED_KEYS[path]
    if kind == "extra_forbidden":
        owner = _model_at(cls, loc[:-1])
        valid = list(owner.model_fields) if owner else []
        parent = path.rpartition(".")[0] if isinstance(loc[-1], str) else path
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f" (did you mean {join_key(parent, close[0])!r}?)" if close else ""
        if path in MOVED_KEYS:
            hint = f" (it moved to {MOVED_KEYS[path]!r})"
        where = f"under {parent!r}" if parent else "at the top level"
        return f"unknown key {path!r}{hint}; allowed keys {where}: {', '.join(valid)}"
    return f"{path}={_show(err['input'])}: {_in_yaml_words(err['msg'])}"


# pydantic's words for what it wanted, in a config file's words.
_WORDS = (
    (r"^\w+ should ", "must "),  # "Input should be 'a' or 'b'", "Tuple should have ..."
    (r"a valid dictionary or instance of \w+|a valid dictionary", "a mapping"),
    (r"\b[Tt]uple\b", "list"),
    (r" after validation", ""),
)


def _in_yaml_words(message: str) -> str:
    for pattern, words in _WORDS:
        message = re.sub(pattern, words, message)
    return message


def config_error(e: ValidationError, cls: type[BaseModel]) -> ConfigError:
    """One :class:`ConfigError` for every problem pydantic found, each naming its key."""
    prefix = _section(cls)
    errors = e.errors()
    # A list whose item failed also reports itself too short: the item's error is the cause.
    locs = [tuple(err["loc"]) for err in errors]
    causes = [
        err for err in errors if not any(o[: len(err["loc"])] == err["loc"] != o for o in locs)
    ]
    issues = dict.fromkeys(_issue(err, cls, prefix) for err in causes)
    return ConfigError("; ".join(issues))
