"""One description per option, under its field: FuserConfig's docstring and docs/options.md are generated from those
descriptions, and fail here when an option has none or the committed reference is stale."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

import fuser
from fuser.config import _pattern_options, field_descriptions, options_reference

OPTIONS_MD = pathlib.Path(__file__).resolve().parent.parent / "docs" / "options.md"

OPTION_CLASSES = [fuser.FuserConfig, *_pattern_options().values()]


@pytest.mark.parametrize("cls", OPTION_CLASSES, ids=lambda cls: cls.__name__)
def test_every_option_is_described_under_its_field(cls):
    described = field_descriptions(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not described.get(f.name)]
    assert not missing, (
        f"{cls.__name__} fields without a description: {missing}. Write a docstring right under each field "
        '(`name: bool = False` then `"""What it switches, and why."""`), then run python scripts/options_doc.py'
    )


def test_docs_options_md_is_generated_from_the_fields():
    assert OPTIONS_MD.read_text(encoding="utf-8") == options_reference(markdown=True), (
        "docs/options.md is out of date: run python scripts/options_doc.py"
    )


def test_fuser_config_docstring_lists_every_description():
    doc = " ".join(fuser.FuserConfig.__doc__.split())
    for cls in OPTION_CLASSES:
        for name, text in field_descriptions(cls).items():
            assert text in doc, f"FuserConfig's docstring lacks {cls.__name__}.{name}'s description"
    assert fuser.FuserConfig().__doc__ == fuser.FuserConfig.__doc__
