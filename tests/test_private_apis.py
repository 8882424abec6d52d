"""Private PyTorch APIs (``torch._*``) are used in ``src/fuser/_compat.py`` only, or listed there with the reason.

Every ``.py`` under ``src/fuser/`` but ``_compat.py`` is parsed (``ast``: strings, such as messages that name
``torch._dynamo.config``, are not code) for attribute chains and imports whose name after ``torch.`` starts with an
underscore; each (file, API) found must be in ``_compat.PRIVATE_USES_ELSEWHERE``, and each entry there must still be
found and be named in ``_compat``'s docstring.
"""

from __future__ import annotations

import ast
import pathlib

from fuser import _compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPAT = ROOT / "src" / "fuser" / "_compat.py"


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain rooted at a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _is_private(dotted: str) -> bool:
    parts = dotted.split(".")
    return len(parts) > 1 and parts[0] == "torch" and parts[1].startswith("_")


def private_uses(source: str) -> set[str]:
    """The private torch APIs ``source`` uses: the longest attribute chain (``torch._C._has_storage``), or the
    imported name (``torch._subclasses.fake_tensor.FakeTensor``)."""
    tree = ast.parse(source)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            dotted = _dotted(node)
            if dotted is not None and _is_private(dotted):
                found.add(dotted)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if _is_private(alias.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _is_private(node.module):
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif node.module == "torch":
                found |= {f"torch.{alias.name}" for alias in node.names if alias.name.startswith("_")}
    return found


def _found() -> set[tuple[str, str]]:
    out = set()
    for path in sorted((ROOT / "src" / "fuser").rglob("*.py")):
        if path == COMPAT:
            continue
        rel = path.relative_to(ROOT).as_posix()
        out |= {(rel, api) for api in private_uses(path.read_text(encoding="utf-8"))}
    return out


def test_private_uses_outside_compat_are_listed() -> None:
    listed = {(path, api) for path, api, _ in _compat.PRIVATE_USES_ELSEWHERE}
    found = _found()
    assert not found - listed, (
        "private torch APIs used outside src/fuser/_compat.py: move them there (a named function or alias), or list "
        f"them in its PRIVATE_USES_ELSEWHERE and docstring with why they cannot move: {sorted(found - listed)}"
    )
    assert not listed - found, f"listed in _compat.PRIVATE_USES_ELSEWHERE but no longer used: {sorted(listed - found)}"


def test_listed_uses_are_in_the_docstring() -> None:
    doc = _compat.__doc__ or ""
    for path, api, why in _compat.PRIVATE_USES_ELSEWHERE:
        assert why, (path, api)
        assert f"``{path}``" in doc and f"``{api}``" in doc, (path, api)


def test_finds_the_forms_of_a_private_use() -> None:
    source = (
        "import torch\n"
        "import torch._dynamo\n"
        "from torch._ops import OpOverload\n"
        "from torch import _C\n"
        "x = torch._C._has_storage(t)\n"
        "y: torch._ops.OpOverload\n"
        "z = torch.ops.aten.mm.default\n"
        "msg = 'set torch._dynamo.config.recompile_limit'\n"
    )
    assert private_uses(source) == {
        "torch._dynamo",
        "torch._ops.OpOverload",
        "torch._C",
        "torch._C._has_storage",
    }
