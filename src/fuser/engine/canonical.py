"""One spelling per computation, for matching only.

Dynamo graphs spell one computation many ways: ``x.pow(2)`` (call_method), ``torch.pow(x, 2)``, ``x ** 2``
(``operator.pow``); ``x.float()``, ``x.to(torch.float32)``, ``x.type_as(y)``; ``mean(x, -1, keepdim=True)`` or
``x.mean(dim=(-1,), keepdim=True)``. :func:`canonical` reads a node as ``Canon(op, args)`` with one op name and
positional, normalised arguments. It never changes the graph: code nothing matched keeps its exact ops.

Operand order of commutative ops and the skipping of no-op casts are handled by the matcher
(:mod:`fuser.engine.match`), which tries both orders and looks through casts to the dtype a value already has.
"""

from __future__ import annotations

import builtins
import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fuser._dtypes import FLOAT_DTYPES
from fuser.engine.function_linear import function_linear, linear_result

Node = torch.fx.Node

COMMUTATIVE = frozenset({"add", "mul"})


@dataclass(frozen=True)
class Canon:
    op: str
    args: tuple[Any, ...]


def _spellings(**names: tuple[Any, ...]) -> dict[Any, str]:
    """{function: canonical name} from each name's spellings (the callables a Dynamo graph may record for it)."""
    return {fn: name for name, fns in names.items() for fn in fns}


# torch functions whose own name is the canonical one, and only spelling
_TORCH_NAMED = ("rsqrt", "sqrt", "square", "mean", "sum", "chunk", "unbind", "stack", "flatten", "reshape")
_TORCH_NAMED += ("view_as_complex", "view_as_real")

_FUNCTIONS = {getattr(torch, name): name for name in _TORCH_NAMED} | _spellings(
    mul=(operator.mul, torch.mul, torch.multiply),
    add=(operator.add, torch.add),
    sub=(operator.sub, torch.sub),
    div=(operator.truediv, torch.div, torch.true_divide),
    neg=(operator.neg, torch.neg),
    pow=(operator.pow, torch.pow),
    # torch.rms_norm: what Dynamo records for F.rms_norm and nn.RMSNorm
    rms_norm=(torch.nn.functional.rms_norm, torch.rms_norm),
    # torch.nn.functional.layer_norm: what Dynamo records for F.layer_norm and nn.LayerNorm
    layer_norm=(torch.nn.functional.layer_norm, torch.layer_norm),
    var=(torch.var,),
    silu=(torch.nn.functional.silu,),
    relu=(torch.nn.functional.relu, torch.relu),
    sigmoid=(torch.sigmoid, torch.nn.functional.sigmoid),
    gelu=(torch.nn.functional.gelu,),
    getitem=(operator.getitem,),
    cat=(torch.cat, torch.concat),
    tanh=(torch.tanh, torch.nn.functional.tanh),
    linear=(torch.nn.functional.linear,),  # torch._C._nn.linear, what Dynamo records for nn.Linear
    cross_entropy=(torch.nn.functional.cross_entropy,),
    nll_loss=(torch.nn.functional.nll_loss,),
    log_softmax=(torch.nn.functional.log_softmax, torch.log_softmax),
    sdpa=(torch.nn.functional.scaled_dot_product_attention,),  # torch._C._nn.scaled_dot_product_attention
    # torch.bmm is torch.matmul of two 3-d tensors: one name, the rank is read from the operands' metadata
    matmul=(torch.matmul, operator.matmul, torch.bmm),
    baddbmm=(torch.baddbmm,),
    softmax=(torch.nn.functional.softmax, torch.softmax),  # nn.Softmax is F.softmax(x, dim, _stacklevel=5)
    transpose=(torch.transpose, torch.swapaxes, torch.swapdims),
    dropout=(torch.nn.functional.dropout, torch.dropout),  # nn.Dropout is F.dropout(x, p, training, inplace)
    # F.multi_head_attention_forward: Dynamo keeps nn.MultiheadAttention's functional body as one call
    multi_head_attention=(torch.nn.functional.multi_head_attention_forward,),
)


_METHODS = {
    "mul": "mul",
    "multiply": "mul",
    "add": "add",
    "sub": "sub",
    "div": "div",
    "true_divide": "div",
    "neg": "neg",
    "rsqrt": "rsqrt",
    "sqrt": "sqrt",
    "pow": "pow",
    "square": "square",
    "mean": "mean",
    "sum": "sum",
    "var": "var",
    "sigmoid": "sigmoid",
    "relu": "relu",
    "tanh": "tanh",
    "chunk": "chunk",
    "unbind": "unbind",
    "flatten": "flatten",
    "reshape": "reshape",
    "view": "reshape",
    "unsqueeze": "unsqueeze",
    "log_softmax": "log_softmax",
    "matmul": "matmul",
    "bmm": "matmul",
    "__matmul__": "matmul",
    "baddbmm": "baddbmm",
    "softmax": "softmax",
    "transpose": "transpose",
    "swapaxes": "transpose",
    "swapdims": "transpose",
}
_DTYPE_METHODS = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
}


def meta_value(value: Any) -> Any:
    """The example value Dynamo recorded for a node (a fake tensor, a SymInt, …), or the value itself."""
    if isinstance(value, Node):
        return value.meta.get("example_value", value.meta.get("val"))
    return value


def tensor_meta(value: Any) -> torch.Tensor | None:
    v = meta_value(value)
    return v if isinstance(v, torch.Tensor) else None


def dtype_of(value: Any) -> torch.dtype | None:
    t = tensor_meta(value)
    return t.dtype if t is not None else None


def _negative_dim(dim: int, ndim: int) -> int:
    """``dim`` of a rank-``ndim`` tensor as a negative index (the canonical form of every dim argument)."""
    return dim - ndim if dim >= 0 else dim


def _normalise_dims(dims: Any, ndim: int) -> tuple[int, ...] | None:
    if dims is None:
        return None
    if isinstance(dims, int):
        dims = (dims,)
    if not all(isinstance(d, int) for d in dims):
        return None
    return tuple(sorted(_negative_dim(d, ndim) for d in dims))


def _reduction(node: Node, op: str) -> Canon | None:
    args, kwargs = list(node.args), dict(node.kwargs)
    names = ["input", "dim", "keepdim"]
    bound = dict(zip(names, args, strict=False))
    if len(args) > 3 or set(kwargs) - {"dim", "keepdim", "dtype", "axis"}:
        return None
    bound.update({("dim" if k == "axis" else k): v for k, v in kwargs.items()})
    if bound.get("dtype") is not None:
        return None
    x = bound.get("input")
    t = tensor_meta(x)
    if t is None:
        return None
    dims = _normalise_dims(bound.get("dim"), t.dim())
    return Canon(op, (x, dims, bool(bound.get("keepdim", False))))


def _variance(node: Node) -> Canon | None:
    """``var(x, dims, correction, keepdim)``: ``x.var(-1, keepdim=True, unbiased=False)``, ``torch.var(x, dim=-1,
    correction=0, keepdim=True)`` and the other spellings, dims negative; ``unbiased`` read as its correction."""
    args, kwargs = list(node.args), dict(node.kwargs)
    x = args.pop(0) if args else kwargs.pop("input", None)
    t = tensor_meta(x)
    if t is None or set(kwargs) - {"dim", "unbiased", "correction", "keepdim"} or len(args) > 3:
        return None
    bound: dict[str, Any] = {"dim": None, "keepdim": False}
    if args and isinstance(args[0], bool):  # var(x, unbiased): over every dim
        bound["unbiased"] = args.pop(0)
    bound.update(zip(("dim", "unbiased", "keepdim"), args, strict=False))
    bound.update(kwargs)
    if "unbiased" in bound and "correction" in bound:
        return None
    correction = bound.get("correction", int(bound.get("unbiased", True)))
    dims = _normalise_dims(bound["dim"], t.dim())
    return Canon("var", (x, dims, correction, bool(bound["keepdim"])))


def _structural(node: Node, op: str) -> Canon | None:
    """Activations, ``chunk``, ``unbind`` and ``getitem``.

    ``silu(x)``; ``gelu(x, approximate)``; ``chunk(x, chunks, dim)`` and ``unbind(x, dim)`` with ``dim`` negative.
    ``getitem`` becomes ``getitem(t, i)`` when ``t`` returns a tuple (chunk, unbind or split), ``unsqueeze`` for an
    index that only adds one ``None`` axis (``f[:, :, None, :]``), ``slice_last`` for a last-dim slice,
    ``whole(t)`` for an index that selects all of ``t`` whatever its sizes (``h[:, -0:, :]``, transformers'
    ``logits_to_keep=0`` slice), and ``index_leading(t, index)`` for slices and ints that leave the last dim whole
    (``logits[:, -n:, :]``); other tensor indexing is nothing.
    """
    args, kwargs = list(node.args), dict(node.kwargs)
    if op == "silu":
        if kwargs.pop("inplace", False) or kwargs or len(args) != 1:
            return None
        return Canon("silu", (args[0],))
    if op == "gelu":
        approximate = kwargs.pop("approximate", args[1] if len(args) > 1 else "none")
        if kwargs or len(args) > 2:
            return None
        return Canon("gelu", (args[0], approximate))
    if op == "chunk":
        names = ["input", "chunks", "dim"]
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        t = tensor_meta(bound.get("input"))
        if t is None or set(bound) - set(names) or not isinstance(bound.get("chunks"), int):
            return None
        dims = _normalise_dims(bound.get("dim", 0), t.dim())
        return Canon("chunk", (bound["input"], bound["chunks"], dims[0] if dims else None))
    if op == "unbind":
        bound = {"dim": 0, **dict(zip(["input", "dim"], args, strict=False)), **kwargs}
        t = tensor_meta(bound.get("input"))
        if t is None or set(bound) - {"input", "dim"} or not isinstance(bound["dim"], int):
            return None
        return Canon("unbind", (bound["input"], _negative_dim(bound["dim"], t.dim())))
    # getitem
    if len(args) != 2 or kwargs or not isinstance(args[0], Node):
        return None
    if isinstance(meta_value(args[0]), (tuple, list)):
        return Canon("getitem", (args[0], args[1])) if isinstance(args[1], int) else None
    index = args[1]
    if isinstance(index, tuple) and index.count(None) == 1 and all(i == slice(None) for i in index if i is not None):
        out = tensor_meta(node)
        xt = tensor_meta(args[0])
        if out is not None and xt is not None and out.dim() == xt.dim() + 1 and len(index) == out.dim():
            return Canon("unsqueeze", (args[0], _negative_dim(index.index(None), out.dim())))
    last_dim_slice = _last_dim_slice(args[0], args[1])
    if last_dim_slice is None and _selects_everything(args[1], tensor_meta(args[0])):
        return Canon("whole", (args[0],))
    if last_dim_slice is None and (leading := _leading_index(args[1], tensor_meta(args[0]))) is not None:
        return Canon("index_leading", (args[0], leading))
    return last_dim_slice


def _selects_everything(index: Any, t: torch.Tensor | None) -> bool:
    """Whether ``t[index]`` is all of ``t`` for any sizes: only ``...`` and slices ``start in (None, 0)``,
    ``stop None``, ``step in (None, 1)``."""

    def whole(i: Any) -> bool:
        if i is Ellipsis:
            return True
        return (
            isinstance(i, slice)
            and (i.start is None or (type(i.start) is int and i.start == 0))
            and i.stop is None
            and (i.step is None or (type(i.step) is int and i.step == 1))
        )

    items = index if isinstance(index, tuple) else (index,)
    if t is None or items.count(Ellipsis) > 1 or len(items) - items.count(Ellipsis) > t.dim():
        return False
    return all(whole(i) for i in items)


def _leading_index(index: Any, t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """``index`` as a tuple of basic indices (slices and ints, no ``...``, no new axis, no tensor) that leaves the
    last dim whole: ``logits[:, -n:, :]``, ``logits[:, k:-1]``; None for any other index. Such a selection of rows
    commutes with a function of the last dim (a linear's rows are selected before or after it alike)."""
    items = index if isinstance(index, tuple) else (index,)
    if t is None or t.dim() == 0 or len(items) > t.dim():
        return None
    if not all(isinstance(i, slice) or type(i) is int for i in items):
        return None
    if len(items) == t.dim() and not (isinstance(items[-1], slice) and _selects_everything(items[-1], t)):
        return None
    return tuple(items)


def _last_dim_slice(x: Node, index: Any) -> Canon | None:
    """``x[..., start:stop:step]`` as ``slice_last(x, start, stop, step)`` with defaults filled in (a slice of a
    size-``d`` last dim: start and stop in ``[0, d]``, step ≥ 1); anything else is not a last-dim slice."""
    t = tensor_meta(x)
    if t is None or t.dim() == 0:
        return None
    if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis:
        sl = index[1]
    elif isinstance(index, tuple) and len(index) == t.dim() and all(i == slice(None) for i in index[:-1]):
        sl = index[-1]
    else:
        return None
    d = t.shape[-1]
    if not isinstance(sl, slice) or not isinstance(d, int):
        return None
    start, stop, step = sl.indices(d)
    if step < 1:
        return None
    return Canon("slice_last", (x, start, stop, step))


def _reshaping(node: Node, op: str) -> Canon | None:
    """Shape changes the patterns read: ``split_pairs(x)`` (``[..., D] → [..., D/2, 2]``, complex-number RoPE),
    ``rows(x)`` (``[..., V] → [N, V]``: ``x.view(-1, V)`` before a loss), each in any ``reshape``/``view``
    spelling, and ``unsqueeze(x, dim)`` with ``dim`` negative in the result."""
    from fuser._compat import statically_equal

    x = node.args[0] if node.args else None
    xt, out = tensor_meta(x), tensor_meta(node)
    if xt is None or out is None or node.kwargs:
        return None
    if op == "unsqueeze":
        if len(node.args) != 2 or not isinstance(node.args[1], int):
            return None
        dim = node.args[1]
        return Canon("unsqueeze", (x, _negative_dim(dim, out.dim())))
    last = xt.shape[-1]
    if out.dim() == 2 and xt.dim() >= 2 and isinstance(last, int) and statically_equal(out.shape[-1], last):
        return Canon("rows", (x,))
    if out.dim() != xt.dim() + 1 or xt.dim() == 0:
        return None
    same_lead = all(statically_equal(a, b) for a, b in zip(out.shape[:-2], xt.shape[:-1], strict=False))
    d, pairs, two = xt.shape[-1], out.shape[-2], out.shape[-1]
    if same_lead and isinstance(d, int) and two == 2 and pairs * 2 == d:
        return Canon("split_pairs", (x,))
    return None


def _joining(node: Node, op: str) -> Canon | None:
    """``cat``/``stack`` of exactly two tensors, ``flatten``; dims as negative indices of the result."""
    args, kwargs = list(node.args), dict(node.kwargs)
    out = tensor_meta(node)
    if out is None:
        return None
    if op == "flatten":
        x = args[0] if args else kwargs.get("input")
        names = ["start_dim", "end_dim"]
        bound = {"start_dim": 0, "end_dim": -1, **dict(zip(names, args[1:], strict=False)), **kwargs}
        xt = tensor_meta(x)
        if xt is None or set(bound) - {"start_dim", "end_dim", "input"}:
            return None
        start, end = (_negative_dim(d, xt.dim()) for d in (bound["start_dim"], bound["end_dim"]))
        return Canon("flatten", (x, start, end))
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or set(kwargs) - {"dim", "tensors"}:
        return None
    if not isinstance(dim, int):
        return None
    return Canon(op, (tensors[0], tensors[1], _negative_dim(dim, out.dim())))


# argument names and defaults of the functions read with every argument bound (defaults filled in)
# F.nll_loss takes F.cross_entropy's arguments but the last, label_smoothing
_NLL_LOSS_SIGNATURE: tuple[tuple[str, Any], ...] = (
    ("input", None),
    ("target", None),
    ("weight", None),
    ("size_average", None),
    ("ignore_index", -100),
    ("reduce", None),
    ("reduction", "mean"),
)
_SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    "linear": (("input", None), ("weight", None), ("bias", None)),
    "cross_entropy": (*_NLL_LOSS_SIGNATURE, ("label_smoothing", 0.0)),
    "nll_loss": _NLL_LOSS_SIGNATURE,
    "sdpa": (
        ("query", None),
        ("key", None),
        ("value", None),
        ("attn_mask", None),
        ("dropout_p", 0.0),
        ("is_causal", False),
        ("scale", None),
        ("enable_gqa", False),
    ),
    "multi_head_attention": (
        ("query", None),
        ("key", None),
        ("value", None),
        ("embed_dim_to_check", None),
        ("num_heads", None),
        ("in_proj_weight", None),
        ("in_proj_bias", None),
        ("bias_k", None),
        ("bias_v", None),
        ("add_zero_attn", None),
        ("dropout_p", None),
        ("out_proj_weight", None),
        ("out_proj_bias", None),
        ("training", True),
        ("key_padding_mask", None),
        ("need_weights", True),
        ("attn_mask", None),
        ("use_separate_proj_weight", False),
        ("q_proj_weight", None),
        ("k_proj_weight", None),
        ("v_proj_weight", None),
        ("static_k", None),
        ("static_v", None),
        ("average_attn_weights", True),
        ("is_causal", False),
    ),
}


def argument_names(op: str) -> tuple[str, ...]:
    """The names of the arguments of ``op`` (one read with every argument bound: ``sdpa``, ``linear``…), in the
    order of its canonical form's ``args``."""
    return tuple(name for name, _ in _SIGNATURES[op])


def _bound(node: Node, op: str) -> Canon | None:
    """``linear(input, weight, bias)``; ``cross_entropy(input, target, weight, ignore_index, reduction,
    label_smoothing)``, whichever were passed by position or keyword. The legacy ``size_average``/``reduce``
    arguments of ``cross_entropy`` are read as nothing."""
    names = [name for name, _ in _SIGNATURES[op]]
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    bound = dict(_SIGNATURES[op])
    bound.update(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    if tensor_meta(bound[names[0]]) is None:
        return None
    if op in ("cross_entropy", "nll_loss") and (bound.pop("size_average"), bound.pop("reduce")) != (None, None):
        return None
    return Canon(op, tuple(bound.values()))


def _softmax(node: Node, op: str) -> Canon | None:
    """``softmax(x, dim, dtype)`` and ``log_softmax(x, dim, dtype)``, ``dim`` negative: ``F.softmax(input, dim,
    _stacklevel, dtype)`` (what ``nn.Softmax`` records), ``torch.softmax(input, dim, dtype)`` or ``x.softmax(dim,
    dtype)``; an implicit ``dim`` (``F.softmax(x)``, deprecated: PyTorch picks one by rank) is nothing."""
    names = ["input", "dim", "dtype"]
    if node.target in (torch.nn.functional.log_softmax, torch.nn.functional.softmax):
        names.insert(2, "_stacklevel")
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    bound = {"dim": None, "dtype": None, **dict(zip(names, node.args, strict=False)), **node.kwargs}
    t = tensor_meta(bound.get("input"))
    if t is None or not isinstance(bound["dim"], int):
        return None
    return Canon(op, (bound["input"], _negative_dim(bound["dim"], t.dim()), bound["dtype"]))


def _products(node: Node, op: str) -> Canon | None:
    """``matmul(a, b)`` (``torch.matmul``, ``a @ b``, ``torch.bmm`` and their methods) and ``baddbmm(input, a, b)``
    with ``beta`` and ``alpha`` 1 (``input + a @ b``; another coefficient is nothing)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if op == "baddbmm":
        beta, alpha = kwargs.pop("beta", 1), kwargs.pop("alpha", 1)
        if len(args) != 3 or kwargs or any(isinstance(c, bool) or c != 1 for c in (beta, alpha)):
            return None
    elif len(args) != 2 or kwargs:
        return None
    if not all(tensor_meta(a) is not None for a in args):
        return None
    return Canon(op, tuple(args))


def _transpose(node: Node) -> Canon | None:
    """``transpose(x, d0, d1)`` with both dims negative, the smaller first: ``x.transpose(-1, -2)``,
    ``torch.transpose(x, 1, 2)`` of a 3-d ``x``, ``swapaxes``/``swapdims``, and ``x.mT`` (``transpose(x, -2, -1)``)."""
    if node.target is builtins.getattr:
        x = node.args[0]
        t = tensor_meta(x)
        if len(node.args) != 2 or node.args[1] != "mT" or t is None or t.dim() < 2:
            return None
        return Canon("transpose", (x, -2, -1))
    names = ["input", "dim0", "dim1"]
    if len(node.args) > 3 or set(node.kwargs) - set(names):
        return None
    bound = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
    t = tensor_meta(bound.get("input"))
    dims = (bound.get("dim0"), bound.get("dim1"))
    if t is None or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    low, high = sorted(_negative_dim(d, t.dim()) for d in dims)
    return Canon("transpose", (bound["input"], low, high))


def _dropout(node: Node) -> Canon | None:
    """``dropout(x, p, training)``: ``F.dropout(input, p, training, inplace)`` (what ``nn.Dropout`` records) or
    ``torch.dropout(input, p, train)``; an in-place dropout is nothing."""
    names = ["input", "p", "training", "inplace"]
    if node.target is torch.dropout:
        names = ["input", "p", "train"]
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    bound = {"p": 0.5, "training": True, "inplace": False, **dict(zip(names, node.args, strict=False)), **node.kwargs}
    if "train" in bound:
        bound["training"] = bound.pop("train")
    if bound["inplace"] is not False or tensor_meta(bound.get("input")) is None:
        return None
    return Canon("dropout", (bound["input"], bound["p"], bound["training"]))


def _cast(node: Node) -> Canon | None:
    """``x.to(dtype)`` in any of its spellings, when it changes nothing but the dtype."""
    if node.op != "call_method" or not node.args:
        return None
    x, rest, kwargs = node.args[0], node.args[1:], dict(node.kwargs)
    xt = tensor_meta(x)
    if xt is None:
        return None
    name = node.target
    if name in _DTYPE_METHODS and not rest and not kwargs:
        return Canon("to", (x, _DTYPE_METHODS[name]))
    if name == "type_as" and len(rest) == 1 and not kwargs:
        other = dtype_of(rest[0])
        return Canon("to", (x, other)) if other is not None else None
    if name == "type" and len(rest) == 1 and isinstance(rest[0], torch.dtype) and not kwargs:
        return Canon("to", (x, rest[0]))
    if name != "to":
        return None
    kwargs.pop("non_blocking", None)
    if kwargs.pop("copy", False):
        return None
    dtype = kwargs.pop("dtype", None)
    device = kwargs.pop("device", None)
    if kwargs:
        return None
    for a in rest:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (torch.device, str)):
            device = a
        elif isinstance(a, Node) and tensor_meta(a) is not None:
            dtype, device = tensor_meta(a).dtype, tensor_meta(a).device
        else:
            return None
    if device is not None and torch.device(device).type != xt.device.type:
        return None
    out = tensor_meta(node)
    if out is None or out.device != xt.device:
        return None
    return Canon("to", (x, dtype if dtype is not None else xt.dtype))


def _contiguous(node: Node) -> Canon | None:
    """``x.contiguous()`` (the same values, in row-major layout); another ``memory_format`` is nothing."""
    kwargs = dict(node.kwargs)
    if len(node.args) != 1 or tensor_meta(node.args[0]) is None:
        return None
    if kwargs.pop("memory_format", torch.contiguous_format) is not torch.contiguous_format or kwargs:
        return None
    return Canon("contiguous", (node.args[0],))


def canonical(node: Any) -> Canon | None:
    """Read ``node`` as one canonical op, or ``None`` when it is nothing the patterns know."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_method":
        cast = _cast(node)
        if cast is not None:
            return cast
        if node.target == "contiguous":
            return _contiguous(node)
        op = _METHODS.get(node.target)
    elif node.op == "call_function":
        if node.target is operator.getitem and (linear := function_linear(node)) is not None:
            return Canon("linear", linear)  # a custom autograd.Function computing a linear (DeepSpeed ZeRO-3's)
        if node.target is builtins.getattr:
            return _transpose(node)  # x.mT; any other attribute is nothing
        op = _FUNCTIONS.get(node.target)
    else:
        return None
    if op is None:
        return None
    if op in ("mean", "sum"):
        return _reduction(node, op)
    if op == "var":
        return _variance(node)
    if op in ("silu", "gelu", "chunk", "unbind", "getitem"):
        return _structural(node, op)
    if op in ("cat", "stack", "flatten"):
        return _joining(node, op)
    if op in ("view_as_complex", "view_as_real") and len(node.args) == 1 and not node.kwargs:
        return Canon(op, (node.args[0],))
    if op in ("reshape", "unsqueeze"):
        return _reshaping(node, op)
    if op in _SIGNATURES:
        return _bound(node, op)
    if op in ("log_softmax", "softmax"):
        return _softmax(node, op)
    if op in ("matmul", "baddbmm"):
        return _products(node, op)
    if op == "transpose":
        return _transpose(node)
    if op == "dropout":
        return _dropout(node)
    kwargs = dict(node.kwargs)
    if op == "rms_norm":
        names = ["input", "normalized_shape", "weight", "eps"]
        bound = dict(zip(names, node.args, strict=False))
        bound.update(kwargs)
        return Canon(op, tuple(bound.get(n) for n in names))
    if op == "layer_norm":  # (input, normalized_shape, weight, bias, eps), F.layer_norm's default eps filled in
        names = ["input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable"]
        bound = {"weight": None, "bias": None, "eps": 1e-5, **dict(zip(names, node.args, strict=False)), **kwargs}
        if set(bound) - set(names):
            return None
        return Canon(op, tuple(bound.get(n) for n in names[:5]))
    if op == "relu" and kwargs.pop("inplace", False) is not False:  # OPT: F.relu(x, inplace=False)
        return None
    if op in ("add", "sub") and kwargs.pop("alpha", 1) != 1:
        return None
    if op == "div" and kwargs.pop("rounding_mode", None) is not None:
        return None
    if kwargs or any(isinstance(a, (list, tuple, dict)) for a in node.args):
        return None
    # a tensor op needs at least one tensor operand: `operator.mul` on two ints is shape arithmetic
    if not any(tensor_meta(a) is not None for a in node.args):
        return None
    if op == "square":
        return Canon("pow", (node.args[0], 2))
    return Canon(op, tuple(node.args))


# what reads a tensor's metadata, never its values: its sizes (``x.size()``, ``x.size(1)``, ``x.shape``), rank or
# element count. Strides are not among them: a rewrite may give a value another layout
_SHAPE_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement"})
_SHAPE_ATTRIBUTES = frozenset({"shape", "ndim"})
_SHAPE_FUNCTIONS = (torch.numel, builtins.len)


def is_shape_query(node: Any) -> bool:
    """Whether ``node`` reads only the shape of its tensor operand: ``x.size()``, ``x.size(d)``, ``x.dim()``,
    ``x.numel()``, ``getattr(x, "shape")`` / ``"ndim"``, ``torch.numel(x)``, ``len(x)``.

    Such a node is never a read of the value: the rewrite points it at another node of the same shape (a graph
    with a symbolic sequence length keeps these queries, dead or alive, inside checkpointed layers), so a block
    whose intermediate is only measured is still fused."""
    if not isinstance(node, Node) or not node.args or tensor_meta(node.args[0]) is None:
        return False
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    if node.op != "call_function":
        return False
    if node.target is builtins.getattr:
        return len(node.args) == 2 and node.args[1] in _SHAPE_ATTRIBUTES
    return node.target in _SHAPE_FUNCTIONS and len(node.args) == 1 and not node.kwargs


def value_readers(node: Node) -> list[Node]:
    """The users of ``node`` that read its values: every user but :func:`is_shape_query` ones. A custom
    autograd.Function that computes a linear (:mod:`fuser.engine.function_linear`) is read through its result, the
    node :func:`canonical` reads as that ``linear``."""
    return [linear_result(user) or user for user in node.users if not is_shape_query(user)]


def is_noop_cast(node: Any) -> bool:
    c = canonical(node)
    return c is not None and c.op == "to" and dtype_of(c.args[0]) == c.args[1]


def strip_exact_upcast(value: Any) -> Any:
    """``x.float()`` of an fp16/bf16/fp32 ``x`` is ``x``, exactly: look through such casts."""
    while True:
        c = canonical(value)
        if c is None or c.op != "to" or c.args[1] != torch.float32:
            return value
        if dtype_of(c.args[0]) not in FLOAT_DTYPES:
            return value
        value = c.args[0]


def module_path(node: Node) -> str:
    """The submodule that produced ``node`` (``model.layers.0.input_layernorm``), from Dynamo's module stack."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    paths = [str(entry[0]) for entry in stack.values()]
    # the innermost module of the model, not a module-level global one: transformers >= 5.25 with the `kernels`
    # package makes apply_rotary_pos_emb a module held in its modeling file's globals, which Dynamo names
    # "G['__import_transformers_dot_models_dot_llama_dot_modeling_llama'].apply_rotary_pos_emb"
    path = next((p for p in reversed(paths) if not p.startswith("G[")), paths[-1])
    # "L['args'][0]._modules['model']._modules['layers']['0']" or "L['self'].model.layers[0]" → "model.layers.0"
    noise = ("L", "self", "args", "_modules", "__dict__")
    parts = [p for p in re.findall(r"[A-Za-z_][A-Za-z0-9_]*|\d+", path) if p not in noise]
    if parts and parts[0] == "0" and "args" in path:
        parts = parts[1:]
    return ".".join(parts)


def source_line(node: Node) -> str:
    """``file:line  code`` of the user code that produced ``node``, from Dynamo's stack trace."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln for ln in trace.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        ln = lines[i].strip()
        if ln.startswith("File "):
            parts = ln.split(",")
            path = parts[0][len("File ") :].strip('"')
            lineno = parts[1].strip().removeprefix("line ") if len(parts) > 1 else "?"
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return location(path, lineno, code)
    return node.name


def code_at(node: Node) -> str:
    """The user's line of code that produced ``node``, for a sentence: ``the code `y = h[:, -1]`
    (llama/modeling_llama.py:471)``; its graph name where Dynamo recorded no line."""
    where = source_line(node)
    if where == node.name:
        return f"`{node.name}`"
    place, _, code = where.partition("  ")
    return f"the code `{code}` ({place})" if code else f"the code at {place}"


def location(path: str, lineno: int | str, code: str) -> str:
    """``file:line  code`` as the report shows a source line: the file's last two path components."""
    return f"{'/'.join(path.split('/')[-2:])}:{lineno}  {code.strip()}"
