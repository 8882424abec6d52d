"""Direct calls: the compiled graphs call fuser's ops without the custom-op wrapper around them.

A ``torch.library.custom_op`` is called through two Python layers before its function runs: the autograd kernel
(which, with grad mode off, re-dispatches below autograd) and the backend wrapper (output-alias checks, a
``torch._dynamo.disable`` frame). Inductor's compiled forward and backward call every fused op that way, with grad
mode off, after AOT autograd has already taken the ops' autograd formulas apart; the layers then cost host time
and do nothing: an empty custom op costs several times the host time of the same function registered as a plain
dispatcher kernel, most for ops with several results (measurements: ``docs/notes/host-overhead.md``). A LoRA
training step calls fused ops hundreds of times, and where its kernels are short the GPU waits on that host time.

So every functional ``fuser::<op>`` gets a second overload, ``fuser::<op>.direct``: the same schema and tags, the
same function registered as its kernel for every device, the same fake; no autograd formula (it is only ever
called with grad mode off, from graphs past AOT autograd). The backend's post-grad pass retargets the calls of
each compiled graph to it (:func:`retarget`), after the blocks' own post-grad passes, which look for the default
overloads. ``options={"experimental.direct_calls": False}`` keeps the default overloads. Ops that mutate an input
(the gated backward written in place, the dx accumulation: a call or two per layer, which the blocks' post-grad
passes insert) keep their default overloads: retargeted, a checkpointed LoRA step computed the same bit for bit on
CPU, but that has not run on a GPU yet.
"""

from __future__ import annotations

import torch
import torch.fx

from fuser import _compat

OVERLOAD = "direct"
NAMESPACE = "fuser"

_library: torch.library.Library | None = None
# default overload -> its direct overload; filled by register()
_DIRECT: dict[_compat.OpOverload, _compat.OpOverload] = {}


def register() -> dict[_compat.OpOverload, _compat.OpOverload]:
    """Define the ``direct`` overload of every functional ``fuser::`` custom op that has none yet; returns the
    map from each default overload to its direct one. Called before Inductor compiles (so the new overloads get
    their fallback lowering with the others), and again whenever a new op was registered since."""
    global _library
    prefix = f"{NAMESPACE}::"
    for qualified in _compat.registered_op_names():
        if not qualified.startswith(prefix) or "." in qualified[len(prefix) :]:
            continue  # overloads other than the default (our direct ones among them)
        name = qualified[len(prefix) :]
        packet = getattr(getattr(torch.ops, NAMESPACE), name)
        op = packet.default
        if op in _DIRECT or op._schema.is_mutable or OVERLOAD in packet.overloads():
            continue
        functions = _compat.custom_op_functions(op)
        if functions is None:
            continue
        function, fake = functions
        schema = str(op._schema)
        if not schema.startswith(qualified + "("):
            continue
        if _library is None:
            _library = torch.library.Library(NAMESPACE, "FRAGMENT")
        _library.define(f"{name}.{OVERLOAD}{schema[len(qualified) :]}", tags=tuple(op.tags))
        _library.impl(f"{name}.{OVERLOAD}", function, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{qualified}.{OVERLOAD}", fake, lib=_library)
        _DIRECT[op] = getattr(packet, OVERLOAD)
    return _DIRECT


def retarget(graph: torch.fx.Graph) -> int:
    """Point every call of a fused op in ``graph`` (a post-grad graph: grad mode is off when it runs) at the op's
    direct overload; returns how many calls were retargeted."""
    if not _DIRECT:
        register()
    count = 0
    for node in graph.nodes:
        if node.op == "call_function" and (direct := _DIRECT.get(node.target)) is not None:
            node.target = direct
            count += 1
    return count
