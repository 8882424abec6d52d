"""Typed option dataclasses: each field checked against its annotation when built, and built from a dict.

A pattern with knobs declares them as a frozen dataclass whose fields are ``bool``, ``int``, ``float``, ``str`` or a
``Literal`` of the allowed strings, each with a default, and names it as its ``Pattern.options`` (or
``Pattern.experimental_options``): :func:`check_options_class` vets the class when the pattern is registered, and
:class:`fuser.FuserConfig` then holds one instance per registered class (a :class:`SectionedOptions`), built by
:func:`build` from the nested dict that ``torch.compile(..., options={...})`` passes. Nothing here knows any
pattern: the annotation is the specification, and the error says what to write instead.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

T = TypeVar("T")

# the names a pattern's options may not go by: FuserConfig's own attributes (its fields and methods) and the
# experimental namespace's, filled in by fuser.config once those classes exist
RESERVED_NAMES: set[str] = set()

_PLAIN = {int: "an int", float: "a number", str: "a string"}


def _example(path: str, value: Any) -> str:
    """``options={"a": {"b": value}}`` for the dotted ``path`` "a.b": what a user writes to set it."""
    text = repr(value)
    for name in reversed(path.split(".")):
        text = f"{{{name!r}: {text}}}"
    return f"options={text}"


def check_fields(options: Any, path: str) -> None:
    """Raise for the first field of the dataclass instance ``options`` whose value its annotation does not allow:
    ``TypeError`` for a ``bool`` that is not ``True``/``False`` or a value of the wrong type, ``ValueError`` for a
    ``Literal`` outside its values. ``path`` is where the options sit in ``FuserConfig`` (``"gated_mlp"``), for the
    message."""
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
        elif hint in _PLAIN:
            # a bool is an int to Python, and an int is a fine float; neither is a string
            fits = isinstance(value, hint) and not isinstance(value, bool)
            if hint is float:
                fits = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not fits:
                raise TypeError(f"fuser: {where} must be {_PLAIN[hint]}, got {value!r}")
        else:
            raise TypeError(
                f"fuser: option {where} has an annotation ({hint}) that fuser.options cannot check; use bool, int, "
                "float, str or a Literal of strings"
            )


def check_options_class(cls: Any, name: str) -> None:
    """Raise unless ``cls`` can be a pattern's options under ``name``: a frozen dataclass (so a config holding it is
    hashable, as the backend's cache and Inductor's need) whose fields all have defaults of a kind
    :func:`check_fields` checks, under a name that is an identifier and not one of FuserConfig's own."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise TypeError(f"fuser: {name}'s options must be a @dataclass(frozen=True) class, got {cls!r}")
    if not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"fuser: options go by a Python identifier not starting with '_', got {name!r}")
    if name in RESERVED_NAMES:
        raise ValueError(
            f"fuser: {name!r} is a FuserConfig attribute, so a pattern's options cannot go by it; set "
            "Pattern.options_name to another name"
        )
    try:
        defaults = cls()
    except TypeError as e:
        raise TypeError(f"fuser: every field of {cls.__name__} ({name}'s options) needs a default: {e}") from None
    check_fields(defaults, name)


def reserve_names(names: set[str], taken: dict[str, type]) -> None:
    """Add ``names`` to :data:`RESERVED_NAMES`; raise if one of the options already registered (``taken``, by name)
    goes by one of them."""
    clash = sorted(set(taken) & names)
    if clash:
        raise ValueError(f"fuser: patterns' options go by FuserConfig attribute names {clash}; rename them")
    RESERVED_NAMES.update(names)


def nest_dotted(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with each dotted name written as nested dicts, merged with those given nested, at any depth:
    ``{"gated_mlp.x": v, "gated_mlp": {"y": w}}`` is ``{"gated_mlp": {"x": v, "y": w}}``. A name given twice is an
    error. The dicts in ``options`` are copied, never changed."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, dict):
            value = nest_dotted(value)
        if isinstance(key, str) and "." in key:
            for part in reversed(key.split(".")[1:]):
                value = {part: value}
            key = key.split(".")[0]
        _merge(out, key, value, str(key))
    return out


def _merge(into: dict[str, Any], key: Any, value: Any, where: str) -> None:
    if key not in into:
        into[key] = {k: v for k, v in value.items()} if isinstance(value, dict) else value
        return
    if not (isinstance(into[key], dict) and isinstance(value, dict)):
        raise ValueError(
            f"fuser: option {where} is given twice (by a dotted name and nested, or as options and as a field of "
            "them); give it once"
        )
    for k, v in value.items():
        _merge(into[key], k, v, f"{where}.{k}")


def build(cls: type[T], value: T | dict[str, Any] | None, path: str, hint: Callable[[str], str] | None = None) -> T:
    """``value`` as an instance of the options class ``cls``: an instance as it is, ``None`` the defaults, a dict of
    its options (the others keep their defaults); an unknown key or another type is an error that names the valid
    ones. ``hint(name)``, if given, adds where an unknown name lives instead (an option moved to ``experimental``)."""
    if isinstance(value, cls):
        return value
    names = cls.option_names() if issubclass(cls, SectionedOptions) else sorted(f.name for f in dataclasses.fields(cls))
    if value is None:
        return cls()
    if not isinstance(value, dict):
        raise TypeError(
            f"fuser: {path} takes a dict of its options ({', '.join(names)}) or {cls.__name__}(...), got "
            f"{type(value).__name__} {value!r}"
        )
    value = nest_dotted(value)  # FuserConfig(experimental={"gated_mlp.backward_in_place": False})
    unknown = sorted(set(value) - set(names), key=str)
    if unknown:
        more = "".join(hint(str(name)) for name in unknown) if hint else ""
        raise ValueError(f"fuser: unknown option(s) {unknown} in {path}; its options are {names}{more}")
    built = cls(**value)
    if not issubclass(cls, SectionedOptions):
        check_fields(built, path)  # a class registered from outside need not check itself in __post_init__
    return built


class _KeywordSignature:
    """``inspect.signature`` of a :class:`SectionedOptions` class: its fields and its sections registered now, as
    keywords (its ``__init__`` takes ``**options``, which tells a reader and an editor nothing)."""

    def __get__(self, instance: object, owner: type[SectionedOptions]) -> inspect.Signature:
        keyword = inspect.Parameter.KEYWORD_ONLY
        params = []
        for f in dataclasses.fields(owner):
            if not f.name.startswith("_"):
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                params.append(inspect.Parameter(f.name, keyword, default=default, annotation=f.type))
        params += [inspect.Parameter(name, keyword, default=None, annotation=kind.__name__)
                   for name, kind in owner.sections().items()]  # fmt: skip
        return inspect.Signature(params)


@dataclass(frozen=True, init=False, repr=False)
class SectionedOptions:
    """A frozen dataclass of options whose keywords are its own fields and the option classes registered for it
    now (:meth:`sections`, name → class): ``FuserConfig(gated_mlp={...})`` builds the ``gated_mlp`` section, read
    back as ``config.gated_mlp``. The built sections are the field ``_sections``, so equality, hashing and the repr
    (Inductor's cache key) cover them; a section registered after an instance was built reads as its defaults there.
    A subclass is a ``@dataclass(frozen=True, init=False, repr=False)`` whose fields all have defaults.
    """

    _sections: tuple[tuple[str, Any], ...] = ()

    # where these options sit in FuserConfig, for messages: "" at the top, "experimental" inside it
    _PATH: ClassVar[str] = ""

    __signature__ = _KeywordSignature()

    @classmethod
    def sections(cls) -> dict[str, type]:
        """The option classes registered for this class now, by the name each goes by."""
        return {}

    @classmethod
    def _misplaced(cls, path: str) -> str:
        """What to write instead where ``path`` (``"gated_mlp.x"``, under this class) names nothing here; ``""``
        when nothing else is known of it."""
        return ""

    @classmethod
    def option_names(cls) -> list[str]:
        """Every keyword this class takes: its fields and its registered sections."""
        return sorted([f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")] + list(cls.sections()))

    def __init__(self, **options: Any) -> None:
        cls = type(self)
        sections = cls.sections()
        built_before = dict(options.pop("_sections", ()))  # dataclasses.replace passes the built sections back
        fields = [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]
        unknown = sorted(set(options) - {f.name for f in fields} - set(sections), key=str)
        if unknown:
            more = "".join(cls._misplaced(str(name)) for name in unknown)
            raise TypeError(
                f"fuser: {cls.__name__} got unknown option(s) {unknown}; it takes {cls.option_names()}{more}"
            )
        for f in fields:
            if f.name in options:
                value = options[f.name]
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                value = f.default_factory()
            object.__setattr__(self, f.name, value)
        prefix = f"{cls._PATH}." if cls._PATH else ""
        built = []
        for name, kind in sections.items():
            value = options[name] if name in options else built_before.get(name)
            hint = lambda field, section=name: cls._misplaced(f"{section}.{field}")  # noqa: E731
            built.append((name, build(kind, value, prefix + name, hint)))
        object.__setattr__(self, "_sections", tuple(built))
        self.__post_init__()

    def __post_init__(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        # only reached for names that are no field or method: the sections
        if name.startswith("_"):
            raise AttributeError(name)
        for key, value in self.__dict__.get("_sections", ()):
            if key == name:
                return value
        kind = type(self).sections().get(name)
        if kind is not None:  # registered after this instance was built
            return kind()
        raise AttributeError(
            f"fuser: {type(self).__name__} has no option {name!r}; it has {type(self).option_names()}"
            + type(self)._misplaced(name)
        )

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if not f.name.startswith("_")]
        shown += [f"{name}={value!r}" for name, value in self._sections]
        return f"{type(self).__name__}({', '.join(shown)})"
