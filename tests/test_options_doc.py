"""One description per option, under its field: FuserConfig's docstring and docs/options.md are generated from those
descriptions, and fail here when an option has none or the committed reference is stale."""

from __future__ import annotations

import pathlib

import pytest

import fuser
from fuser.config import ExperimentalConfig, options_reference
from fuser.engine.protocol import registered_options
from fuser.options_reference import class_description, field_descriptions, public_fields

OPTIONS_MD = pathlib.Path(__file__).resolve().parent.parent / "docs" / "options.md"

PATTERN_OPTIONS = [*registered_options().values(), *registered_options(experimental=True).values()]
OPTION_CLASSES = [fuser.FuserConfig, ExperimentalConfig, *PATTERN_OPTIONS]


@pytest.mark.parametrize("cls", OPTION_CLASSES, ids=lambda cls: cls.__name__)
def test_every_option_is_described_under_its_field(cls):
    described = field_descriptions(cls)
    missing = [f.name for f in public_fields(cls) if not described.get(f.name)]
    assert not missing, (
        f"{cls.__name__} fields without a description: {missing}. Write a docstring right under each field "
        '(`name: bool = False` then `"""What it switches, and why."""`), then run python scripts/options_doc.py'
    )


@pytest.mark.parametrize("cls", PATTERN_OPTIONS, ids=lambda cls: cls.__name__)
def test_every_patterns_options_say_what_they_are_for(cls):
    assert class_description(cls), f"{cls.__name__} has no docstring: say what its options are for together"


def test_docs_options_md_is_generated_from_the_fields():
    assert OPTIONS_MD.read_text(encoding="utf-8") == options_reference(markdown=True), (
        "docs/options.md is out of date: run python scripts/options_doc.py"
    )


def test_fuser_config_docstring_lists_every_description():
    doc = " ".join(fuser.FuserConfig.__doc__.split())
    for cls in OPTION_CLASSES:
        for name, text in field_descriptions(cls).items():
            assert text in doc, f"FuserConfig's docstring lacks {cls.__name__}.{name}'s description"
    for cls in PATTERN_OPTIONS:
        assert class_description(cls) in doc, f"FuserConfig's docstring lacks {cls.__name__}'s description"
    assert fuser.FuserConfig().__doc__ == fuser.FuserConfig.__doc__


def test_the_experimental_switches_are_listed_apart_after_the_others():
    """The user's switches come first; those kept to compare implementations follow under a heading that says so."""
    text = OPTIONS_MD.read_text(encoding="utf-8")
    heading = "\n## Experimental: switches kept to compare implementations, which may change or go away"
    assert text.count(heading) == 1
    users, experimental = text.split(heading)
    assert "| [`patterns`]" in users and "| [`gated_mlp.recompute_for_down_weight`]" in users
    assert "experimental." not in users.split("\n## patterns")[0]  # the first table has none of them
    for name in ExperimentalConfig.option_names():
        assert f"| [`experimental.{name}`]" in experimental
