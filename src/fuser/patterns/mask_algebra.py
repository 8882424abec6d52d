"""Whether an attention mask built in a graph with a symbolic sequence length is the causal mask, or a causal sliding
window, at every length: proved by algebra on the mask's index expressions, never by evaluating it.

With a symbolic length ``T`` the mask's nodes cannot run at compile time, and running them at the traced length
would prove nothing about the others: a sliding window of ``w`` keys equals the causal mask at every length up to
``w``. Instead, each tensor the mask is computed from is read as a function of its element's indices (sympy):
``arange(T)`` is ``i0`` over ``[T]``; broadcasting views, ``unsqueeze``, ``expand``, slices and index gathers
(``x[batch_idx, q_idx]``) substitute indices; elementwise arithmetic, comparisons and ``&``/``|``/``~`` combine
expressions; ``diff`` along a dim is a difference of two positions; ``cumsum`` is taken where its summand is one
number along the dim. The mask is then a boolean formula over comparisons of integer expressions of the indices,
and it is accepted where that formula is equivalent, for every index, to ``kv <= q`` (causal) or to
``q - w < kv <= q`` (a window of ``w`` keys):

- each comparison is brought to one form, ``e <= 0`` or ``e == 0`` with ``e`` expanded (the indices are integers,
  so ``a < b`` is ``a - b + 1 <= 0``); one that the indices' ranges decide (``kv < T``) becomes its truth value;
- the remaining comparisons are taken as propositional atoms, and the two formulas are equivalent where their
  exclusive or is unsatisfiable (sympy's ``satisfiable``).

That is sound (formulas equivalent as propositions are equivalent for every value of their atoms) and incomplete:
a mask spelled another way is not proved and declines. The ops read are those transformers' ``masking_utils``
builds its masks from under ``torch.compile`` (causal, sliding window, and the packed-sequence detection over
positions derived from ``arange``); any other op declines, named in the reason.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx
from sympy.logic.inference import satisfiable

from fuser._compat import sympy_expr
from fuser.engine.canonical import code_at, meta_value, tensor_meta
from fuser.engine.match import OUTER_VALUE
from fuser.patterns.base import Decline

Node = torch.fx.Node

# what a mask computed from a tensor the graph receives is declined with (a padding mask: its values are unknown)
INPUT_DEPENDENT = "the mask depends on the graph input"


@dataclass(frozen=True)
class Indexed:
    """A tensor as a function of its indices: element ``[i0, i1, …]`` is ``expr`` with :func:`index` ``k`` standing
    for ``ik``; a dim of size 1 does not appear in ``expr``. ``boolean``: ``expr`` is a truth value (a bool
    tensor), else an integer."""

    shape: tuple[sympy.Expr, ...]
    expr: sympy.Basic
    boolean: bool


def index(k: int) -> sympy.Symbol:
    """The symbol for a tensor's ``k``-th index (integer, ≥ 0)."""
    return sympy.Symbol(f"fuser_i{k}", integer=True, nonnegative=True)


def _scalar(value: Any) -> Indexed:
    if isinstance(value, bool):
        return Indexed((), sympy.true if value else sympy.false, True)
    if isinstance(value, int):
        return Indexed((), sympy.Integer(value), False)
    raise Decline(f"the mask is computed with {value!r}, not an integer or a truth value")


def _size(value: Any) -> sympy.Expr:
    """A size argument (an int or a symbolic size's node) as a sympy expression."""
    number = meta_value(value) if isinstance(value, Node) else value
    if isinstance(number, bool) or not isinstance(number, (int, torch.SymInt)):
        raise Decline(f"the mask uses a size {value!r} that is not an integer")
    return sympy_expr(number)


def _broadcast(shapes: list[tuple[sympy.Expr, ...]]) -> tuple[sympy.Expr, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(rank):
        sizes = {s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0} - {sympy.Integer(1)}
        if len(sizes) > 1:
            raise Decline(f"the mask broadcasts sizes {sorted(map(str, sizes))} that are not provably equal")
        out.append(sizes.pop() if sizes else sympy.Integer(1))
    return tuple(out)


def _aligned(value: Indexed, shape: tuple[sympy.Expr, ...]) -> sympy.Basic:
    """``value``'s expression read at the indices of ``shape`` it broadcasts to (its dims aligned to the right)."""
    offset = len(shape) - len(value.shape)
    moves = {}
    for k, size in enumerate(value.shape):
        moves[index(k)] = sympy.Integer(0) if size == 1 and shape[k + offset] != 1 else index(k + offset)
    return value.expr.xreplace(moves)


def _elementwise(op: Callable[..., sympy.Basic], boolean: bool, *values: Indexed) -> Indexed:
    shape = _broadcast([v.shape for v in values])
    return Indexed(shape, op(*(_aligned(v, shape) for v in values)), boolean)


def _arith(op: Callable[[Any, Any], Any]) -> Callable[..., Indexed]:
    def apply(a: Indexed, b: Indexed) -> Indexed:
        if a.boolean or b.boolean:
            raise Decline("the mask does arithmetic on truth values")
        return _elementwise(op, False, a, b)

    return apply


def _compare(relation: Callable[[Any, Any], sympy.Basic], on_booleans: Callable[..., Any] | None = None):
    def apply(a: Indexed, b: Indexed) -> Indexed:
        if a.boolean or b.boolean:
            if on_booleans is None or not (a.boolean and b.boolean):
                raise Decline("the mask orders truth values")
            return _elementwise(on_booleans, True, a, b)
        return _elementwise(relation, True, a, b)

    return apply


def _logical(op: Callable[..., sympy.Basic]) -> Callable[..., Indexed]:
    def apply(*values: Indexed) -> Indexed:
        if not all(v.boolean for v in values):
            raise Decline("the mask combines integers bitwise (only truth values are read)")
        return _elementwise(op, True, *values)

    return apply


_ELEMENTWISE: dict[Any, Callable[..., Indexed]] = {
    operator.add: _arith(operator.add),
    operator.sub: _arith(operator.sub),
    operator.mul: _arith(operator.mul),
    operator.le: _compare(sympy.Le),
    operator.lt: _compare(sympy.Lt),
    operator.ge: _compare(sympy.Ge),
    operator.gt: _compare(sympy.Gt),
    operator.eq: _compare(sympy.Eq, sympy.Equivalent),
    operator.ne: _compare(sympy.Ne, sympy.Xor),
    operator.and_: _logical(sympy.And),
    operator.or_: _logical(sympy.Or),
    operator.xor: _logical(sympy.Xor),
    operator.invert: _logical(sympy.Not),
    torch.logical_and: _logical(sympy.And),
    torch.logical_or: _logical(sympy.Or),
    torch.logical_not: _logical(sympy.Not),
}
_ELEMENTWISE_METHODS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "le": operator.le, "lt": operator.lt,
    "ge": operator.ge, "gt": operator.gt, "eq": operator.eq, "ne": operator.ne, "__and__": operator.and_,
    "__or__": operator.or_, "logical_and": torch.logical_and, "logical_or": torch.logical_or,
    "logical_not": torch.logical_not, "bitwise_not": operator.invert,
}  # fmt: skip


def _dim(dim: Any, rank: int) -> int:
    if not isinstance(dim, int) or not -rank <= dim < rank:
        raise Decline(f"the mask uses dim {dim!r} of a rank-{rank} tensor")
    return dim % rank


def _renumbered(value: Indexed, moves: dict[int, sympy.Basic], shape: tuple[sympy.Expr, ...]) -> Indexed:
    return Indexed(shape, value.expr.xreplace({index(k): e for k, e in moves.items()}), value.boolean)


def _unsqueeze(value: Indexed, dim: int) -> Indexed:
    dim = _dim(dim, len(value.shape) + 1)
    moves = {k: index(k + (k >= dim)) for k in range(len(value.shape))}
    return _renumbered(value, moves, (*value.shape[:dim], sympy.Integer(1), *value.shape[dim:]))


def _expand(value: Indexed, sizes: tuple[Any, ...]) -> Indexed:
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    new = len(sizes) - len(value.shape)
    if new < 0:
        raise Decline("the mask expands to fewer dims")
    shape, moves = [], {}
    for k, size in enumerate(sizes):
        old = value.shape[k - new] if k >= new else None
        target = old if isinstance(size, int) and size == -1 and old is not None else _size(size)
        if old is not None:
            if old == 1 and target != 1:
                moves[k - new] = sympy.Integer(0)
            elif old != target:
                raise Decline(f"the mask expands a dim of size {old} to {target}")
            else:
                moves[k - new] = index(k)
        shape.append(target)
    return _renumbered(value, moves, tuple(shape))


def _basic_index(value: Indexed, items: tuple[Any, ...]) -> Indexed:
    """``value[items]`` for ``None``, ``...``, whole dims, integer slices of step 1 and integer positions."""
    if items.count(Ellipsis) > 1:
        raise Decline("the mask indexes with two ellipses")
    rank = len(value.shape)
    if Ellipsis in items:
        at, named = items.index(Ellipsis), sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:at] + (slice(None),) * (rank - named) + items[at + 1 :]
    shape, moves, k = [], {}, 0
    for item in items:
        if item is None:
            shape.append(sympy.Integer(1))
            continue
        if k >= rank:
            raise Decline("the mask indexes more dims than it has")
        size = value.shape[k]
        if isinstance(item, int) and not isinstance(item, bool):
            if item < 0:
                raise Decline("the mask indexes from the end")
            moves[k] = sympy.Integer(item)
        elif isinstance(item, slice):
            start, stop, step = item.start, item.stop, item.step
            if step not in (None, 1) or not all(v is None or type(v) is int for v in (start, stop)):
                raise Decline(f"the mask slices {item} (only integer slices of step 1 are read)")
            if (start or 0) < 0 or (stop is not None and stop < 0):
                raise Decline(f"the mask slices {item} from the end")
            start = start or 0
            end = size if stop is None else sympy.Min(size, stop)
            moves[k] = index(len(shape)) + start
            shape.append(sympy.Max(end - start, 0))
        else:
            raise Decline(f"the mask indexes with {item!r}")
        k += 1
    # dims not named keep their place after the ones named
    for rest in range(k, rank):
        moves[rest] = index(len(shape))
        shape.append(value.shape[rest])
    return _renumbered(value, moves, tuple(shape))


def _gather(value: Indexed, indices: list[Indexed]) -> Indexed:
    """``value[indices]`` with integer index tensors for its leading dims (advanced indexing): element ``[j…, r…]``
    is ``value[indices[0][j…], …, r…]``. Each index must be proved inside its dim: a negative one would wrap around
    to the end, which the substitution does not compute."""
    if any(i.boolean for i in indices) or len(indices) > len(value.shape):
        raise Decline("the mask indexes with a bool tensor or more index tensors than dims")
    shape = _broadcast([i.shape for i in indices])
    rest = value.shape[len(indices) :]
    moves = {k: _aligned(i, shape) for k, i in enumerate(indices)}
    bounds = {index(k): size - 1 for k, size in enumerate(shape)}
    for k, position in moves.items():
        span = _linear_range(sympy.expand(position), bounds)
        inside = span is not None and sympy.Ge(span[0], 0) is sympy.true
        if not inside or sympy.Le(span[1], value.shape[k] - 1) is not sympy.true:
            raise Decline(f"the mask gathers at `{position}`, not proved inside a dim of size {value.shape[k]}")
    moves.update({len(indices) + r: index(len(shape) + r) for r in range(len(rest))})
    return _renumbered(value, moves, (*shape, *rest))


def _diff(value: Indexed, dim: int, prepend: Indexed | None) -> Indexed:
    """``torch.diff(value, dim=dim, prepend=prepend)`` (n=1): ``z[t + 1] - z[t]`` over ``z = cat(prepend, value)``."""
    dim = _dim(dim, len(value.shape))
    if value.boolean or (prepend is not None and prepend.boolean):
        raise Decline("the mask takes differences of truth values")
    t = index(dim)
    if prepend is None:
        joined, size = value.expr, value.shape[dim]
    else:
        if len(prepend.shape) != len(value.shape):
            raise Decline("the mask's diff prepends a tensor of another rank")
        before = prepend.shape[dim]
        outer = value.shape[:dim] + (before,) + value.shape[dim + 1 :]
        head = _aligned(Indexed(prepend.shape, prepend.expr, False), outer)
        joined = sympy.Piecewise((head, t < before), (value.expr.xreplace({t: t - before}), True))
        size = value.shape[dim] + before
    step = sympy.simplify(joined.xreplace({t: t + 1}) - joined)
    shape = value.shape[:dim] + (size - 1,) + value.shape[dim + 1 :]
    return Indexed(shape, step, False)


def _cumsum(value: Indexed, dim: int) -> Indexed:
    """``cumsum`` along ``dim`` where every position along it holds one number ``c``: ``c · (t + 1)``."""
    dim = _dim(dim, len(value.shape))
    term = sympy.simplify(value.expr)
    if value.boolean:
        term = sympy.Integer(1) if term is sympy.true else sympy.Integer(0) if term is sympy.false else None
        if term is None:
            raise Decline("the mask sums truth values that vary")
    if index(dim) in term.free_symbols:
        raise Decline("the mask sums values that vary along the summed dim")
    return Indexed(value.shape, term * (index(dim) + 1), False)


def _filled(sizes: tuple[Any, ...], dtype: Any, one: bool) -> Indexed:
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    shape = tuple(_size(s) for s in sizes)
    if dtype is torch.bool:
        return Indexed(shape, sympy.true if one else sympy.false, True)
    if dtype is not None and (dtype.is_floating_point or dtype.is_complex):
        raise Decline(f"the mask is a {dtype} tensor (a float mask is not read symbolically)")
    return Indexed(shape, sympy.Integer(int(one)), False)


# integer dtypes whose range holds every position of a sequence (a narrower one would wrap around)
_WIDE_INTEGERS = (torch.int32, torch.int64)


def _cast(value: Indexed, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Indexed:
    """``.to(device)``, or a cast of truth values to bool or of integers to int32/int64: the same values."""
    dtypes = [a for a in (*args, kwargs.get("dtype")) if isinstance(a, torch.dtype)]
    for dtype in dtypes:
        if dtype not in ((torch.bool,) if value.boolean else _WIDE_INTEGERS):
            raise Decline(f"the mask casts to {dtype}")
    return value


class _Reader:
    """Reads each node the mask is computed from as an :class:`Indexed`, once (the layers share the mask)."""

    def __init__(self) -> None:
        self.values: dict[Node, Indexed] = {}

    def __call__(self, node: Node) -> Indexed:
        if node not in self.values:
            ancestors = unmutated_ancestors(node)
            for ancestor in ancestors:
                if ancestor not in self.values:
                    self.values[ancestor] = self._read(ancestor)
        return self.values[node]

    def _read(self, node: Node) -> Indexed:
        example = meta_value(node)
        if isinstance(example, (torch.SymInt, int)) and not isinstance(example, bool):  # a size: known symbolically
            return Indexed((), sympy_expr(example), False)
        if node.op == "placeholder":
            outer = node.meta.get(OUTER_VALUE)
            if not isinstance(outer, Node):
                raise Decline(f"{INPUT_DEPENDENT} `{node.name}` (a padding mask?): values unknown")
            return self(outer)
        if node.op not in ("call_function", "call_method"):
            raise Decline(f"the mask is computed by {code_at(node)}, which is not read symbolically")
        if tensor_meta(node) is None:
            raise Decline(f"`{node.name}` computes a value the mask uses that is not a tensor or a size")
        target = node.target
        name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
        args = tuple(node.args)
        kwargs = dict(node.kwargs)
        if node.op == "call_method":
            if target in _ELEMENTWISE_METHODS and not kwargs:
                return _ELEMENTWISE[_ELEMENTWISE_METHODS[target]](*map(self._operand, args))
            return self._method(target, self(args[0]), args[1:], kwargs)
        if target in _ELEMENTWISE and not kwargs:
            return _ELEMENTWISE[target](*map(self._operand, args))
        if target is torch.arange:
            return self._arange(args, kwargs)
        if target is operator.getitem and len(args) == 2:
            return self._getitem(self(args[0]), args[1])
        if target is torch.diff:
            return self._diff(args, kwargs)
        if target in (torch.cumsum, torch.unsqueeze, torch.tril, torch.triu):
            return self._method(name, self(args[0]), args[1:], kwargs)
        if target in (torch.ones, torch.zeros):
            kwargs.pop("device", None)
            dtype = kwargs.pop("dtype", None) or torch.get_default_dtype()
            if kwargs:
                raise Decline(f"the mask calls `{name}` with {sorted(kwargs)}")
            return _filled(args, dtype, target is torch.ones)
        raise Decline(f"the mask calls `{name}`, which is not read symbolically")

    def _operand(self, value: Any) -> Indexed:
        return self(value) if isinstance(value, Node) else _scalar(value)

    def _arange(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Indexed:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory", "requires_grad", "layout")}
        dtype = kwargs.pop("dtype", None)
        step = kwargs.pop("step", args[2] if len(args) > 2 else 1)
        if kwargs or len(args) not in (1, 2, 3) or step != 1:
            raise Decline("the mask calls arange with a step or arguments other than start and end")
        if dtype not in (None, *_WIDE_INTEGERS):
            raise Decline(f"the mask calls arange of {dtype}")
        start, end = (0, args[0]) if len(args) == 1 else args[:2]
        start, end = _size(start), _size(end)
        return Indexed((sympy.Max(end - start, 0),), start + index(0), False)

    def _getitem(self, value: Indexed, item: Any) -> Indexed:
        items = item if isinstance(item, tuple) else (item,)
        tensors = [i for i in items if isinstance(i, Node)]
        if not tensors:
            return _basic_index(value, items)
        if len(tensors) != len(items):
            raise Decline("the mask mixes index tensors with slices")
        return _gather(value, [self(i) for i in tensors])

    def _diff(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Indexed:
        bound = dict(zip(("input", "n", "dim", "prepend", "append"), args, strict=False)) | kwargs
        if bound.get("n", 1) != 1 or bound.get("append") is not None:
            raise Decline("the mask takes a diff with n > 1 or an appended tensor")
        prepend = bound.get("prepend")
        return _diff(self(bound["input"]), bound.get("dim", -1), self(prepend) if prepend is not None else None)

    def _method(self, name: str, value: Indexed, args: tuple, kwargs: dict[str, Any]) -> Indexed:
        if name in ("to", "contiguous", "clone"):
            return _cast(value, args, kwargs)
        if name == "unsqueeze":
            return _unsqueeze(value, args[0] if args else kwargs.get("dim"))
        if name == "expand":
            return _expand(value, args)
        if name == "cumsum":
            if kwargs.get("dtype") is not None:
                raise Decline("the mask takes a cumsum with a dtype")
            return _cumsum(value, args[0] if args else kwargs.get("dim"))
        if name in ("new_ones", "new_zeros"):
            if set(kwargs) - {"dtype", "device"}:
                raise Decline(f"the mask calls `.{name}()` with {sorted(kwargs)}")
            dtype = kwargs.get("dtype")
            if dtype is None:
                dtype = torch.bool if value.boolean else torch.int64
            return _filled(args, dtype, name == "new_ones")
        if name in ("tril", "triu") and value.boolean and len(value.shape) >= 2:
            diagonal = args[0] if args else kwargs.get("diagonal", 0)
            if not isinstance(diagonal, int):
                raise Decline(f"the mask takes {name} of a diagonal {diagonal!r}")
            row, col = index(len(value.shape) - 2), index(len(value.shape) - 1)
            keep = sympy.Le(col - row, diagonal) if name == "tril" else sympy.Ge(col - row, diagonal)
            return Indexed(value.shape, sympy.And(value.expr, keep), True)
        raise Decline(f"the mask calls `.{name}()`, which is not read symbolically")


def mutates(node: Node) -> bool:
    """Whether ``node`` writes into one of its inputs: ``x[i] = v`` or an in-place method or function (``x.add_``)."""
    if node.op == "call_function" and node.target is operator.setitem:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and name.endswith("_") and not name.startswith("_")


def unmutated_ancestors(node: Node) -> list[Node]:
    """``node`` and every node of its graph it is computed from, in graph order; Decline where one of them is written
    in place after it was computed (its value is then not what its nodes compute). A nested body's input is read
    through the enclosing graph's node it receives, by the caller."""
    seen: set[Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    for ancestor in seen:
        for user in ancestor.users:
            if user not in seen and mutates(user):
                raise Decline(f"the mask is modified in place by {code_at(user)}")
    return [n for n in node.graph.nodes if n in seen]


# ---------------------------------------------------------------------------------------------------------
# Equivalence of two masks' formulas
# ---------------------------------------------------------------------------------------------------------


def _linear_range(e: sympy.Expr, bounds: dict[sympy.Symbol, sympy.Expr]) -> tuple[sympy.Expr, sympy.Expr] | None:
    """(least, greatest) value of ``e`` over the indices' ranges (each ``0 .. bound``), where ``e`` is linear in them
    with number coefficients; else None."""
    low = high = e.xreplace({s: 0 for s in bounds})
    for s, top in bounds.items():
        c = e.diff(s)
        if not c.is_number:
            return None
        if c > 0:
            high += c * top
        else:
            low += c * top
    return low, high


def _comparison(relation: sympy.Basic) -> tuple[str, sympy.Expr]:
    """``("le", e)`` for ``e <= 0`` or ``("eq", e)`` for ``e == 0``: ``relation`` over integers in one form."""
    a, b = relation.lhs, relation.rhs
    if isinstance(relation, sympy.Le):
        return "le", sympy.expand(a - b)
    if isinstance(relation, sympy.Lt):
        return "le", sympy.expand(a - b + 1)
    if isinstance(relation, sympy.Ge):
        return "le", sympy.expand(b - a)
    if isinstance(relation, sympy.Gt):
        return "le", sympy.expand(b - a + 1)
    e = sympy.expand(a - b)
    return "eq", min(e, sympy.expand(-e), key=sympy.default_sort_key)


class _Atoms:
    """Comparisons as propositional symbols: one symbol per comparison in :func:`_comparison`'s form, a truth value
    for a comparison the indices' ranges decide."""

    def __init__(self, bounds: dict[sympy.Symbol, sympy.Expr]) -> None:
        self.bounds = bounds
        self.symbols: dict[tuple[str, sympy.Expr], sympy.Symbol] = {}

    def atom(self, kind: str, e: sympy.Expr) -> sympy.Basic:
        span = _linear_range(e, self.bounds)
        if span is not None:
            low, high = span
            if kind == "le" and sympy.Le(high, 0) is sympy.true:
                return sympy.true
            if (kind == "le" and sympy.Gt(low, 0) is sympy.true) or (
                kind == "eq" and (sympy.Gt(low, 0) is sympy.true or sympy.Lt(high, 0) is sympy.true)
            ):
                return sympy.false
        return self.symbols.setdefault((kind, e), sympy.Symbol(f"fuser_atom{len(self.symbols)}"))

    def propositional(self, formula: sympy.Basic) -> sympy.Basic:
        if formula in (sympy.true, sympy.false):
            return formula
        if isinstance(formula, sympy.Ne):
            return sympy.Not(self.atom(*_comparison(sympy.Eq(formula.lhs, formula.rhs, evaluate=False))))
        if isinstance(formula, sympy.core.relational.Relational):
            return self.atom(*_comparison(formula))
        if isinstance(formula, sympy.logic.boolalg.BooleanFunction):
            return formula.func(*(self.propositional(arg) for arg in formula.args))
        raise Decline(f"the mask's formula holds `{formula}`, which is not a comparison of integers")


def equivalent(a: sympy.Basic, b: sympy.Basic, bounds: dict[sympy.Symbol, sympy.Expr]) -> bool:
    """Whether the boolean formulas ``a`` and ``b`` (over the indices in ``bounds``, each ``0 .. bound``) are provably
    equal for every index (module docstring)."""
    atoms = _Atoms(bounds)
    return satisfiable(sympy.Xor(atoms.propositional(a), atoms.propositional(b))) is False


def symbolic_verdict(mask: Node, length: sympy.Expr) -> str | int | None:
    """None when ``mask`` is, for every value of the symbolic sizes, the plain causal mask of ``length`` tokens (for
    every batch and head); the window ``w`` when it is the causal sliding window of ``w`` keys; else why not."""
    try:
        value = _Reader()(mask)
    except Decline as why:
        return str(why)
    if not value.boolean:
        return "the mask is not a bool tensor (a float mask is not read symbolically)"
    if len(value.shape) < 2 or value.shape[-2:] != (length, length):
        return f"the mask's shape {tuple(map(str, value.shape))} does not end in [{length}, {length}]"
    rank = len(value.shape)
    bounds = {index(k): size - 1 for k, size in enumerate(value.shape)}
    q, kv = index(rank - 2), index(rank - 1)
    causal = sympy.Le(kv, q)
    try:
        if equivalent(value.expr, causal, bounds):
            return None
        # a window: the comparison q - kv + c <= 0 that bounds it, w = 1 - c (query q sees keys q - w < kv <= q)
        for kind, e in _comparisons(value.expr):
            rest = sympy.expand(e - q + kv)
            if kind == "le" and rest.is_Integer and 1 - int(rest) >= 1:
                window = 1 - int(rest)
                if equivalent(value.expr, sympy.And(causal, sympy.Gt(kv, q - window)), bounds):
                    return window
    except Decline as why:
        return str(why)
    return "the mask is neither the plain causal mask nor a causal sliding window at every length"


def _comparisons(formula: sympy.Basic) -> list[tuple[str, sympy.Expr]]:
    """The comparisons in ``formula``, each in :func:`_comparison`'s form."""
    return [
        _comparison(r)
        for r in formula.atoms(sympy.core.relational.Relational)
        if not isinstance(r, (sympy.Eq, sympy.Ne))
    ]
