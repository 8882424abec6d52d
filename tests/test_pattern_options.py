"""A pattern declares its own options class (``Pattern.options``): once registered, ``FuserConfig`` holds it, the
forms ``options=`` takes set it, the pattern's check reads it as the built-in patterns read theirs, unknown names say
what the valid ones are, and the options reference documents it from the docstrings under its fields."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Literal

import pytest
import torch

import fuser
from fuser.config import options_reference
from fuser.engine.match import Op, V
from fuser.engine.protocol import PATTERNS, Pattern, Replacement, Variant, register_pattern, registered_options


@dataclass(frozen=True)
class ScaledNegOptions:
    """What the toy double negation becomes."""

    factor: float = 1.0
    """The double negation becomes ``x * factor``: a value the check can only have read from the config."""

    spelling: Literal["mul", "clone"] = "mul"
    """How the replacement is written when ``factor`` is 1: ``"clone"`` copies ``x``, ``"mul"`` multiplies it."""


@dataclass(frozen=True)
class ScaledNegExperiment:
    """A toy switch in the experimental namespace."""

    trace: bool = False
    """Count each check in ``SEEN`` twice."""


SEEN: list[ScaledNegOptions] = []


def check_scaled_neg(found, variant, config):
    options = config.scaled_neg  # as the built-in patterns read theirs: config.<options name>.<field>
    SEEN.append(options)
    x = found.bindings["x"]
    if options.factor == 1.0 and options.spelling == "clone":
        return Replacement(torch.ops.aten.clone.default, (x,))
    return Replacement(torch.ops.aten.mul.Tensor, (x, options.factor))


SCALED_NEG = Pattern(
    "scaled_neg",
    [Variant("neg of neg", Op("neg", Op("neg", V("x"))))],
    check_scaled_neg,
    default=False,
    options=ScaledNegOptions,
)


class DoubleNegation(torch.nn.Module):
    def forward(self, x):
        return torch.neg(-x) + 1


@pytest.fixture
def registered():
    register_pattern(SCALED_NEG)
    SEEN.clear()
    yield SCALED_NEG
    del PATTERNS[SCALED_NEG.name]


def run(config, x):
    """The module compiled through ``fuser.optimize`` with ``config``, called on ``x``."""
    torch._dynamo.reset()
    return fuser.optimize(DoubleNegation(), config)(x)


def test_the_pattern_sees_its_options_given_to_optimize(registered):
    x = torch.arange(4.0)
    base = {"patterns": ("scaled_neg",), "strict": True, "inner_compiler": "aot_eager"}
    assert torch.equal(run({**base, "scaled_neg": {"factor": 3.0}}, x), 3 * x + 1)
    assert SEEN[-1] == ScaledNegOptions(factor=3.0)
    assert torch.equal(run({**base, "scaled_neg.factor": 5.0}, x), 5 * x + 1)  # a dotted name
    assert SEEN[-1] == ScaledNegOptions(factor=5.0)
    config = fuser.FuserConfig(**base, scaled_neg=ScaledNegOptions(factor=2.0))  # the class itself
    assert torch.equal(run(config, x), 2 * x + 1) and SEEN[-1].factor == 2.0
    # by name, as a trainer configures it
    torch._dynamo.reset()
    out = torch.compile(DoubleNegation(), backend="fuser", options={**base, "scaled_neg": {"factor": 7.0}})(x)
    assert torch.equal(out, 7 * x + 1) and SEEN[-1].factor == 7.0


def test_its_options_are_a_field_like_the_built_in_ones(registered):
    config = fuser.FuserConfig(scaled_neg={"spelling": "clone"})
    assert config.scaled_neg == ScaledNegOptions(spelling="clone") and config.scaled_neg.factor == 1.0
    assert fuser.FuserConfig().scaled_neg == ScaledNegOptions()
    assert config.causal_attention.block_sparse_masks is True  # the built-in ones, as before
    assert config != fuser.FuserConfig() and hash(config) == hash(fuser.FuserConfig(scaled_neg={"spelling": "clone"}))
    assert "scaled_neg=ScaledNegOptions(factor=1.0, spelling='clone')" in repr(config)  # Inductor's cache key
    assert fuser.backend(config) is fuser.backend({"scaled_neg.spelling": "clone"})
    again = dataclasses.replace(config, strict=True)
    assert again.strict and again.scaled_neg == config.scaled_neg
    assert "scaled_neg" in inspect.signature(fuser.FuserConfig).parameters  # help() and editors show it


@pytest.mark.parametrize(
    "options, error, text",
    [
        ({"scaled_neg": {"factr": 2.0}}, ValueError,
         r"unknown option\(s\) \['factr'\] in scaled_neg; its options are \['factor', 'spelling'\]"),
        ({"scaled_neg.factr": 2.0}, ValueError, r"unknown option\(s\) \['factr'\] in scaled_neg"),
        ({"scaled_neg": {"factor": "big"}}, TypeError, "scaled_neg.factor must be a number, got 'big'"),
        ({"scaled_neg": {"spelling": "add"}}, ValueError,
         r"scaled_neg.spelling must be one of 'mul', 'clone', got 'add'"),
        ({"scaled_negation": {"factor": 2.0}}, ValueError,
         r"unknown option\(s\) \['scaled_negation'\]; FuserConfig fields are \[.*'strict'.*\], and the patterns' "
         r"options \[.*'scaled_neg'.*\]"),
        ({"scaled_neg": {"factor": 2.0}, "scaled_neg.factor": 3.0}, ValueError, "scaled_neg.factor is given twice"),
    ],
)  # fmt: skip
def test_a_wrong_name_or_value_says_what_is_valid(registered, options, error, text):
    with pytest.raises(error, match=text):
        fuser.FuserConfig.from_options(options)
    with pytest.raises(error, match=text):
        fuser.optimize(DoubleNegation(), options)


def test_without_the_pattern_its_options_are_unknown():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['scaled_neg'\]"):
        fuser.FuserConfig.from_options({"scaled_neg": {"factor": 2.0}})
    with pytest.raises(TypeError, match=r"FuserConfig got unknown option\(s\) \['scaled_neg'\]"):
        fuser.FuserConfig(scaled_neg={"factor": 2.0})
    with pytest.raises(AttributeError, match="FuserConfig has no option 'scaled_neg'"):
        _ = fuser.FuserConfig().scaled_neg


def test_the_options_reference_documents_them_from_their_docstrings(registered):
    text = options_reference(markdown=True)
    assert "| [`scaled_neg.factor`](#scaled_negfactor) | `float` | `1.0` |" in text
    assert "## scaled_neg\n\nWhat the toy double negation becomes." in text
    assert "`x * factor`: a value the check can only have read from the config." in text
    assert '`"mul" | "clone"`, default `"mul"`.' in text
    assert "What the toy double negation becomes." in " ".join(fuser.FuserConfig.__doc__.split())


def test_experimental_options_are_declared_the_same_way():
    experimental = dataclasses.replace(SCALED_NEG, name="scaled_neg_x", options_name="scaled_neg_x",
                                       options=None, experimental_options=ScaledNegExperiment)  # fmt: skip
    register_pattern(experimental)
    try:
        assert registered_options(experimental=True)["scaled_neg_x"] is ScaledNegExperiment
        assert "scaled_neg_x" not in registered_options()
    finally:
        del PATTERNS["scaled_neg_x"]


@dataclass
class NotFrozen:
    flag: bool = False


@dataclass(frozen=True)
class NoDefault:
    flag: bool


@dataclass(frozen=True)
class Unchecked:
    sizes: list = dataclasses.field(default_factory=list)


@pytest.mark.parametrize(
    "changes, error, text",
    [
        ({"options": NotFrozen}, TypeError, r"scaled_neg's options must be a @dataclass\(frozen=True\) class"),
        ({"options": NoDefault}, TypeError, "every field of NoDefault .* needs a default"),
        ({"options": Unchecked}, TypeError, "option scaled_neg.sizes has an annotation .* cannot check"),
        ({"options_name": "strict"}, ValueError, "'strict' is a FuserConfig attribute"),
        ({"options_name": "experimental"}, ValueError, "'experimental' is a FuserConfig attribute"),
        ({"options_name": "gated_mlp"}, ValueError,
         "pattern 'swiglu' has options GatedMLPConfig under 'gated_mlp'; give pattern 'scaled_neg' another "
         "options_name for its ScaledNegOptions"),
    ],
)  # fmt: skip
def test_register_pattern_refuses_options_it_cannot_hold(changes, error, text):
    with pytest.raises(error, match=text):
        register_pattern(dataclasses.replace(SCALED_NEG, **changes))
    assert "scaled_neg" not in PATTERNS
