"""The activations of the fused gated op (``act(gate) · up``) and of the fused bias activation: one record each.

A record (:class:`Activation`) is all fuser knows of an activation: its name (the ``activation: str`` argument of
``fuser::gated_activation`` and ``fuser::bias_activation``), its formula in words, the value and derivative as
plain torch (the reference path and the tests' oracle) and as a Triton function (the kernels' path), and, where a
gated MLP writes it, the tree that matches ``act(gate)`` in a model's graph and the gated pattern (its
``.counts`` key) that fuses it. Everything else is derived from :data:`TABLE`: the kernel code of each name (its
index), the kernels' dispatch (:func:`_activation_and_grad`), the check of the ``activation`` argument, the gated
patterns and their variants (:mod:`fuser.patterns.gated_mlp`), and the activations each down projection's
refinement takes (:mod:`fuser.refinements.gated_down_projection`).

The formulas, in fp32 (fp64 for fp64 inputs) whatever the input dtype, each record's :attr:`Activation.formula`:

{formulas}

Both paths compute these formulas as written: the Triton functions in fp32, the references in the compute dtype
of their input. Each Triton function returns ``(act(g), act'(g))``; a kernel that uses one of the two has the other
dropped by the compiler.
"""

from __future__ import annotations

import linecache
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fuser.engine.match import OneOf, Op, S, scalar_hint
from fuser.engine.protocol import Decline, NotApplicable
from fuser.kernels._triton import HAS_TRITON, tl, triton

# the constants of the formulas
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # k
_GELU_TANH_C = 0.044715  # c
_SQRT_HALF = math.sqrt(0.5)  # 1/√2
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)  # φ(0)
_QUICK_GELU_ALPHA = 1.702  # QuickGELU's scale of the sigmoid's argument

# A Triton formula is a ``@triton.jit`` function at module level whose global name is its own ``__name__``:
# Inductor, launching a kernel of an inlined op (``FuserConfig.inline_ops``), rebuilds the kernel's source from
# the functions its code names, by those names. Without Triton the functions are plain, never called.
_jit = triton.jit if HAS_TRITON else (lambda fn: fn)

if HAS_TRITON:
    # jit'ed code reads only tl.constexpr globals
    _SQRT_2_OVER_PI_TL = tl.constexpr(_SQRT_2_OVER_PI)
    _GELU_TANH_C_TL = tl.constexpr(_GELU_TANH_C)
    _SQRT_HALF_TL = tl.constexpr(_SQRT_HALF)
    _INV_SQRT_2PI_TL = tl.constexpr(_INV_SQRT_2PI)
    _QUICK_GELU_ALPHA_TL = tl.constexpr(_QUICK_GELU_ALPHA)


@_jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@dataclass(frozen=True)
class Activation:
    """One activation: what the kernels, the reference and the gated patterns know of it."""

    name: str
    """The ops' ``activation`` argument; the kernels' code for it is its index in :data:`TABLE`."""
    formula: str
    """act and act' in words (the module docstring lists them)."""
    reference: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    """``g -> (act(g), act'(g))`` in plain torch, in g's dtype (the reference path, the tests' oracle)."""
    triton: Any
    """``g -> (act(g), act'(g))``: a ``@triton.jit`` function of fp32 ``g`` (see ``_jit`` above)."""
    gate: Callable[[Any], Any] | None = None
    """The matcher tree of ``act(g)`` as models write it, from the tree of ``g``; None: no gated pattern fuses it."""
    pattern: str | None = None
    """The gated pattern (its ``.counts`` key) whose variants match :attr:`gate`."""
    check: Callable[[dict[str, Any]], None] | None = None
    """Raises ``Decline`` for a match of :attr:`gate` this activation is not, from the match's bindings."""


# ---------------------------------------------------------------------------------------------------------
# The formulas: value and derivative, plain torch and Triton
# ---------------------------------------------------------------------------------------------------------


def _silu_reference(g):
    s = torch.sigmoid(g)
    return g * s, s * (1.0 + g * (1.0 - s))


@_jit
def _silu_triton(g):
    s = _sigmoid(g)
    return g * s, s * (1.0 + g * (1.0 - s))


def _gelu_tanh_reference(g):
    s = torch.sigmoid(2.0 * _SQRT_2_OVER_PI * (g + _GELU_TANH_C * g * g * g))
    dz = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * g * g)
    return g * s, s * (1.0 + 2.0 * g * (1.0 - s) * dz)


@_jit
def _gelu_tanh_triton(g):
    # via 1 + tanh(z) = 2σ(2z): the interpreter has no libdevice.tanh
    s = _sigmoid(2.0 * _SQRT_2_OVER_PI_TL * (g + _GELU_TANH_C_TL * g * g * g))
    act = g * s
    dact = s * (1.0 + 2.0 * g * (1.0 - s) * (_SQRT_2_OVER_PI_TL * (1.0 + 3.0 * _GELU_TANH_C_TL * g * g)))
    return act, dact


def _gelu_reference(g):
    cdf = 0.5 * (1.0 + torch.erf(g * _SQRT_HALF))
    return g * cdf, cdf + g * (torch.exp(-0.5 * g * g) * _INV_SQRT_2PI)


@_jit
def _gelu_triton(g):
    cdf = 0.5 * (1.0 + tl.erf(g * _SQRT_HALF_TL))
    return g * cdf, cdf + g * (tl.exp(-0.5 * g * g) * _INV_SQRT_2PI_TL)


def _relu_reference(g):
    return torch.relu(g), (g > 0).to(g.dtype)


@_jit
def _relu_triton(g):
    # a NaN stays NaN, as torch.relu keeps it
    return tl.where(g < 0.0, 0.0, g), tl.where(g > 0.0, 1.0, 0.0)


def _relu2_reference(g):
    r = torch.relu(g)
    return r * r, 2.0 * r


@_jit
def _relu2_triton(g):
    r = tl.where(g < 0.0, 0.0, g)
    return r * r, 2.0 * r


def _gelu_quick_reference(g):
    s = torch.sigmoid(_QUICK_GELU_ALPHA * g)
    return g * s, s * (1.0 + _QUICK_GELU_ALPHA * g * (1.0 - s))


@_jit
def _gelu_quick_triton(g):
    s = _sigmoid(_QUICK_GELU_ALPHA_TL * g)
    return g * s, s * (1.0 + _QUICK_GELU_ALPHA_TL * g * (1.0 - s))


def _sigmoid_reference(g):
    s = torch.sigmoid(g)
    return s, s * (1.0 - s)


@_jit
def _sigmoid_triton(g):
    s = _sigmoid(g)
    return s, s * (1.0 - s)


# ---------------------------------------------------------------------------------------------------------
# How gated MLPs write them (matcher trees over the tree of g; see fuser.engine.match)
# ---------------------------------------------------------------------------------------------------------


def _silu_tree(g):  # F.silu, or written out: g * sigmoid(g)
    return OneOf(Op("silu", g), Op("mul", g, Op("sigmoid", g)))


def _relu2_tree(g):  # BitNet's squared ReLU, as torch.square or pow
    return Op("pow", Op("relu", g), S("power"))


def _relu2_check(b: dict[str, Any]) -> None:
    if scalar_hint(b["power"]) != 2:
        raise Decline(f"the gate's activation is relu(gate) to the power {b['power']}: {ONLY}")


def _computed_from(value: Any, source: Any, depth: int = 4) -> bool:
    """Whether graph value ``value`` is ``source`` or computed from it in at most ``depth`` ops."""
    frontier = [value]
    for _ in range(depth + 1):
        if any(n is source for n in frontier):
            return True
        frontier = [i for n in frontier if isinstance(n, torch.fx.Node) for i in n.all_input_nodes]
    return False


def _glu_check(b: dict[str, Any]) -> None:
    # σ(g)·g is silu, σ(1.702h)·h QuickGELU, GPT-OSS's gate·σ(α·gate) and a softcapped gate's factor a scaled
    # sigmoid: an activation of one value, which swiglu, mlp_activation or a declined form takes, not a GLU of two
    gate, up = b.get("gate"), b.get("up")  # the packed form's halves are never computed from each other
    if gate is not None and up is not None and (_computed_from(gate, up) or _computed_from(up, gate)):
        raise NotApplicable("sigmoid(gate) · up with one computed from the other is an activation of one value")


# ---------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------

TABLE: tuple[Activation, ...] = (
    Activation(
        "silu",
        "silu(g) = g·σ(g);  silu'(g) = s(1 + g(1 − s)), s = σ(g)   (SwiGLU: Llama, Mistral, Qwen)",
        _silu_reference,
        _silu_triton,
        gate=_silu_tree,
        pattern="swiglu",
    ),
    Activation(
        "gelu_tanh",
        "gelu_tanh(g) = g·σ(2k(g + c·g³)) = ½g(1 + tanh(k(g + c·g³))), k = √(2/π), c = 0.044715;  "
        "gelu_tanh'(g) = s(1 + 2g(1 − s)·k(1 + 3c·g²)), s = σ(2k(g + c·g³))   "
        '(``F.gelu(approximate="tanh")``, GeGLU: Gemma)',
        _gelu_tanh_reference,
        _gelu_tanh_triton,
        gate=lambda g: Op("gelu", g, "tanh"),
        pattern="geglu",
    ),
    Activation(
        "gelu",
        "gelu(g) = g·Φ(g) = ½g(1 + erf(g/√2));  gelu'(g) = Φ(g) + g·φ(g), φ(g) = exp(−g²/2)/√(2π)   "
        '(``F.gelu(approximate="none")``)',
        _gelu_reference,
        _gelu_triton,
        gate=lambda g: Op("gelu", g, "none"),
        pattern="geglu",
    ),
    Activation(
        "relu",
        "relu(g) = max(g, 0);  relu'(g) = 1 where g > 0, else 0   (ReGLU)",
        _relu_reference,
        _relu_triton,
        gate=lambda g: Op("relu", g),
        pattern="reglu",
    ),
    Activation(
        "relu2",
        "relu2(g) = max(g, 0)²;  relu2'(g) = 2·max(g, 0)   (squared ReLU: Primer, BitNet, Arcee)",
        _relu2_reference,
        _relu2_triton,
        gate=_relu2_tree,
        pattern="reglu",
        check=_relu2_check,
    ),
    Activation(
        "gelu_quick",
        "gelu_quick(g) = g·σ(1.702g);  gelu_quick'(g) = s(1 + 1.702·g(1 − s)), s = σ(1.702g)   "
        "(QuickGELU: CLIP, some GPT-2 variants; un-gated MLPs only)",
        _gelu_quick_reference,
        _gelu_quick_triton,
    ),
    Activation(
        "sigmoid",
        "sigmoid(g) = σ(g);  sigmoid'(g) = s(1 − s), s = σ(g)   (GLU: Qwen3-Next's and Qwen3.5's gated attention, "
        "``o_proj(attn_output * torch.sigmoid(gate))``)",
        _sigmoid_reference,
        _sigmoid_triton,
        gate=lambda g: Op("sigmoid", g),
        pattern="glu",
        check=_glu_check,
    ),
)

ACTIVATIONS: tuple[str, ...] = tuple(a.name for a in TABLE)
ACTIVATION_CODE: dict[str, int] = {name: code for code, name in enumerate(ACTIVATIONS)}
BY_NAME: dict[str, Activation] = {a.name: a for a in TABLE}
# the gated patterns, in the order of their first activation in the table (the order they are registered in)
GATED_PATTERNS: tuple[str, ...] = tuple(dict.fromkeys(a.pattern for a in TABLE if a.pattern is not None))
# what a gated pattern's decline says the fused op computes
_GATED = ", ".join(a.name for a in TABLE if a.pattern is not None)
ONLY = f"the fused op computes {_GATED} of the gate times up, of the projections as they are"

__doc__ = __doc__.format(formulas="\n".join(f"    {a.formula}" for a in TABLE))


def check_activation(op: str, activation: str) -> None:
    """Raise ``ValueError`` unless ``activation`` names a record of :data:`TABLE`."""
    if activation not in ACTIVATION_CODE:
        raise ValueError(f"fuser: {op} expects an activation of {ACTIVATIONS}, got {activation!r}")


def reference_activation_and_grad(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(g), act'(g)) by the record's plain-torch formula, in g's (compute) dtype."""
    check_activation("gated_activation", activation)
    return BY_NAME[activation].reference(g)


# ---------------------------------------------------------------------------------------------------------
# The kernels' dispatch, generated from the table
# ---------------------------------------------------------------------------------------------------------


def _dispatch_source() -> str:
    """The source of ``_activation_and_grad(g, ACTIVATION)``: a constexpr if-chain over the kernel codes, each
    branch calling its record's Triton function by name. Written out as source, not passed to the kernels as a
    constexpr function: Inductor rebuilds an inlined kernel's source from the names its functions call, and
    writes its constexpr arguments into that source as Python literals, which a function is not."""
    lines = [
        "def _activation_and_grad(g, ACTIVATION: tl.constexpr):",
        "    # (act(g), act'(g)) in fp32 for the activation of code ACTIVATION; generated from TABLE",
    ]
    for code, activation in enumerate(TABLE):
        keyword = "if" if code == 0 else "else" if code == len(TABLE) - 1 else "elif"
        condition = "" if keyword == "else" else f" ACTIVATION == {code}"
        lines += [
            f"    {keyword}{condition}:  # {activation.name}",
            f"        act, dact = {activation.triton.__name__}(g)",
        ]
    lines.append("    return act, dact")
    return "\n".join(lines) + "\n"


def _define(source: str, name: str) -> Any:
    """``name`` defined by ``source`` in this module, jit'ed. The source is registered with ``linecache`` under
    a file name of its own, where Triton (and ``inspect``) read a function's source."""
    filename = f"<fuser.kernels.activations: generated {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), globals())  # noqa: S102 - the source is built above from the table
    return _jit(globals()[name])


if HAS_TRITON:
    _activation_and_grad = _define(_dispatch_source(), "_activation_and_grad")
