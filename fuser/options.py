"""Typed option dataclasses: each field checked against its annotation when built, and built from a dict.

A pattern with knobs declares them as a frozen dataclass (``fuser.patterns.linear_cross_entropy
.LinearCrossEntropyConfig``) whose fields are ``bool`` or a ``Literal`` of the allowed strings, and calls
:func:`check_fields` from its ``__post_init__``; :class:`fuser.FuserConfig` holds one of each, and
:func:`build` turns the nested dict that ``torch.compile(..., options={...})`` passes into it. Nothing here knows
any pattern: the annotation is the specification, and the error says what to write instead.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, TypeVar

T = TypeVar("T")


def _example(path: str, value: Any) -> str:
    """``options={"a": {"b": value}}`` for the dotted ``path`` "a.b": what a user writes to set it."""
    text = repr(value)
    for name in reversed(path.split(".")):
        text = f"{{{name!r}: {text}}}"
    return f"options={text}"


def check_fields(options: Any, path: str) -> None:
    """Raise for the first field of the dataclass instance ``options`` whose value its annotation does not allow:
    ``TypeError`` for a ``bool`` that is not ``True``/``False``, ``ValueError`` for a ``Literal`` outside its
    values. ``path`` is where the options sit in ``FuserConfig`` (``"linear_cross_entropy"``), for the message."""
    hints = typing.get_type_hints(type(options))
    for f in dataclasses.fields(options):
        value, hint, where = getattr(options, f.name), hints[f.name], f"{path}.{f.name}"
        if hint is bool:
            if not isinstance(value, bool):
                raise TypeError(
                    f"fuser: {where} must be True or False, got {value!r}; e.g. {_example(where, not f.default)}"
                )
        elif typing.get_origin(hint) is Literal:
            allowed = typing.get_args(hint)
            if not isinstance(value, str) or value not in allowed:
                raise ValueError(
                    f"fuser: {where} must be one of {', '.join(map(repr, allowed))}, got {value!r}; "
                    f"e.g. {_example(where, allowed[-1] if allowed[0] == f.default else allowed[0])}"
                )
        else:  # pragma: no cover - a new kind of field needs its check written here
            raise TypeError(f"fuser: option {where} has an annotation ({hint}) that fuser.options cannot check")


def build(cls: type[T], value: T | dict[str, Any] | None, path: str) -> T:
    """``value`` as an instance of the options dataclass ``cls``: an instance as it is, ``None`` the defaults, a
    dict of its fields (the others keep their defaults); an unknown key or another type is an error that names
    the fields."""
    if isinstance(value, cls):
        return value
    names = sorted(f.name for f in dataclasses.fields(cls))
    if value is None:
        return cls()
    if not isinstance(value, dict):
        raise TypeError(
            f"fuser: {path} takes a dict of its options ({', '.join(names)}) or {cls.__name__}(...), got "
            f"{type(value).__name__} {value!r}"
        )
    unknown = sorted(set(value) - set(names), key=str)
    if unknown:
        raise ValueError(f"fuser: unknown option(s) {unknown} in {path}; its options are {names}")
    return cls(**value)
