"""The options reference, generated from the one description each option has: the docstring written under its field
(an attribute docstring, as Sphinx reads them), and for a pattern's options together, their class docstring.

:func:`render` walks a :class:`fuser.options.SectionedOptions` class (``FuserConfig``): its fields, the options of
the patterns registered now, and a field that is itself such a class (``experimental``) as a part of its own,
after the rest. It gives FuserConfig's docstring and ``docs/options.md`` (``python scripts/options_doc.py`` writes
it, ``tests/test_options_doc.py`` fails when it is out of date).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import typing
from typing import Any, Literal, NamedTuple

from fuser.options import SectionedOptions


@functools.cache
def _class_bodies(path: str) -> dict[str, list[ast.stmt]]:
    """The top-level classes of the module at ``path``, by name, parsed once."""
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read(), path)
    return {node.name: node.body for node in tree.body if isinstance(node, ast.ClassDef)}


@functools.cache
def field_descriptions(cls: type) -> dict[str, str]:
    """Each field of the dataclass ``cls`` that has a description: the string literal written right under the field
    in the class body, by field name. Empty where the source cannot be read (an install without ``.py`` files, a
    class defined inside a function): the descriptions are documentation, nothing depends on them."""
    try:
        body = _class_bodies(inspect.getfile(cls))[cls.__name__]
    except (OSError, TypeError, KeyError, SyntaxError):
        return {}
    found = {}
    for stmt, after in zip(body, body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[stmt.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return found


def class_description(cls: type) -> str:
    """The docstring of a pattern's options class, on one line: what its options are for together. Empty where the
    class has none (a dataclass without one gets its signature as ``__doc__``)."""
    doc = cls.__doc__ or ""
    if doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(inspect.cleandoc(doc).split())


def public_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of the options class ``cls`` a user sets (a :class:`SectionedOptions`'s built sections are not)."""
    return [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_text(cls: type, f: dataclasses.Field) -> str:
    """The field's type as a reader writes its values: ``bool``, ``"cublas" | "triton"``, or the annotation."""
    hint = _type_hints(cls).get(f.name)
    if typing.get_origin(hint) is Literal:
        return " | ".join(f'"{value}"' for value in typing.get_args(hint))
    return hint.__name__ if isinstance(hint, type) else str(f.type)


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default).replace("'", '"')
    return f"{f.default_factory.__name__}()"


def _markdown(text: str) -> str:
    """A docstring's reST markup as Markdown: ````x```` → ```x```, ``:class:`X``` → ```X```."""
    return re.sub(r":(?:class|func|mod|meth):`([^`]+)`", r"`\1`", text).replace("``", "`")


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation other than ``-`` and ``_`` dropped."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


class Row(NamedTuple):
    name: str  # dotted from FuserConfig: "strict", "gated_mlp", "gated_mlp.backward_in_place"
    kind: str  # its type as written, or an options class's name
    default: str  # "" for a pattern's options (their fields have the defaults)
    description: str


def _nested(cls: type) -> dict[str, type[SectionedOptions]]:
    """The fields of ``cls`` that hold options of their own kind (``experimental``), by name."""
    return {
        f.name: f.default_factory
        for f in public_fields(cls)
        if isinstance(f.default_factory, type) and issubclass(f.default_factory, SectionedOptions)
    }


def rows(cls: type[SectionedOptions], prefix: str = "") -> list[Row]:
    """The options of ``cls`` but its nested parts: each field, then each registered pattern's options (a row for
    them together, then one per field)."""
    described = field_descriptions(cls)
    out = []
    for f in public_fields(cls):
        if f.name not in _nested(cls):
            out.append(Row(prefix + f.name, _type_text(cls, f), _default_text(f), described.get(f.name, "")))
    for name, section in cls.sections().items():
        out.append(Row(prefix + name, section.__name__, "", class_description(section)))
        for g in public_fields(section):
            sub = field_descriptions(section).get(g.name, "")
            out.append(Row(f"{prefix}{name}.{g.name}", _type_text(section, g), _default_text(g), sub))
    return out


def parts(cls: type[SectionedOptions]) -> list[tuple[str, str, list[Row]]]:
    """``cls``'s options in parts: (name, description, rows): its own first (no name), then each nested part."""
    out = [("", "", rows(cls))]
    for name, nested in _nested(cls).items():
        out.append((name, field_descriptions(cls).get(name, ""), rows(nested, f"{name}.")))
    return out


def plain_text(cls: type[SectionedOptions]) -> str:
    """Every option of ``cls``, one indented entry each, for its docstring."""
    lines = []

    def entry(name: str, kind: str, default: str, described: str, depth: int) -> None:
        indent = "    " * depth
        lines.append(f"{indent}{name.rsplit('.', 1)[-1]}: {kind}" + (f" = {default}" if default else ""))
        pad = indent + "    "
        lines.append(textwrap.fill(described, 112, initial_indent=pad, subsequent_indent=pad, break_on_hyphens=False))

    for part, described, part_rows in parts(cls):
        if part:
            entry(part, _nested(cls)[part].__name__, "", described, 0)
        for row in part_rows:
            entry(row.name, row.kind, row.default, row.description, row.name.count("."))
    return "\n".join(lines)


def markdown(cls: type[SectionedOptions], intro: list[str]) -> str:
    """Every option of ``cls`` as a Markdown page: ``intro``'s lines, a table and a section per option, and each
    nested part under a heading of its own whose text is the first sentence of that field's description."""
    out = list(intro)
    for part, described, part_rows in parts(cls):
        if part:
            first, _, rest = described.partition(". ")
            sentence = _markdown(first).rstrip(".")
            out += ["", f"## {part.capitalize()}: {sentence[:1].lower()}{sentence[1:]}", ""]
            if rest:
                out += [textwrap.fill(_markdown(rest), 120, break_on_hyphens=False), ""]
        else:
            out.append("")
        out += ["| option | type | default |", "|---|---|---|"]
        for row in part_rows:
            shown = f"`{row.default}`" if row.default else "(its options below)"
            kind = row.kind.replace("|", "\\|")  # a bar inside a table cell, even in code, ends the cell
            out.append(f"| [`{row.name}`](#{_anchor(row.name)}) | `{kind}` | {shown} |")
        for row in part_rows:
            out += ["", f"{'#' * (2 + row.name.count('.'))} {row.name}", ""]
            if row.default:
                out += [f"`{row.kind}`, default `{row.default}`.", ""]
            out.append(textwrap.fill(_markdown(row.description) or "(no description yet)", 120, break_on_hyphens=False))
    return "\n".join(out) + "\n"
