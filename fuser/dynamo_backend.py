"""The Dynamo backend: rewrite the captured graph, then hand it to the inner compiler."""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from fuser import _compat
from fuser.config import FuserConfig
from fuser.engine import inplace
from fuser.engine.rewrite import RewriteResult, count_by_pattern, rewrite
from fuser.patterns import PATTERNS

log = logging.getLogger("fuser")


class FuserError(RuntimeError):
    """A rewrite failed under ``FuserConfig(strict=True)``."""


def _source_digest() -> str:
    """A hash of fuser's own source: a changed pattern or kernel must never reuse a stale compiled graph."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


_SOURCE_DIGEST = _source_digest()


def _post_grad_pass(config: FuserConfig, counts: dict[str, int]) -> Any:
    """fuser's post-grad pass: :func:`fuser.engine.inplace.accumulate_gated_dx` and
    :func:`~fuser.engine.inplace.reinplace_gated_backward` (unless switched off), then the user's own post-grad
    pass, if any; the numbers of calls rewritten are added to ``counts``.

    Inductor folds ``CustomGraphPass.uuid()`` of its custom passes into the FX-graph and AOT-autograd cache
    keys: fuser's source, config and switch are in it, and the user's pass keeps its uuid in the key.
    """
    base = _compat.custom_graph_pass_base()
    previous = _compat.current_post_grad_custom_post_pass()

    class FuserPostGrad(base):
        def __call__(self, graph: torch.fx.Graph) -> None:
            for name, plan_pass, apply_pass in inplace.PASSES if inplace.GATED_BACKWARD_IN_PLACE else ():
                try:
                    plan = plan_pass(graph)
                except Exception as error:
                    # a backward graph compiles at the first backward call, outside the rewrite's fallback: a
                    # failing analysis leaves the graph as Inductor gave it (it has not been touched)
                    if config.strict:
                        raise FuserError(f"fuser: the post-grad pass {name} failed: {error!r}") from error
                    warnings.warn(
                        f"fuser: the post-grad pass {name} failed ({error!r}); that graph keeps its out-of-place "
                        "ops. Set FuserConfig(strict=True) to raise, and please report this.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    continue
                counts[name] = counts.get(name, 0) + apply_pass(graph, plan)
            if previous is not None:
                previous(graph)

        def uuid(self) -> Any:
            prev = previous.uuid() if previous is not None and hasattr(previous, "uuid") else None
            return ("fuser", _SOURCE_DIGEST, repr(config), inplace.GATED_BACKWARD_IN_PLACE, prev)

    return FuserPostGrad()


class FuserBackend:
    """``backend(gm, example_inputs)`` as Dynamo calls it; one instance per config (see :func:`backend`)."""

    def __init__(self, config: FuserConfig) -> None:
        self.config = config
        self.patterns = [p for name, p in PATTERNS.items() if config.enabled(name)]
        self.results: list[RewriteResult] = []  # one per graph compiled through this backend, in order
        # what fuser's post-grad pass changed in the graphs Inductor compiled (forward and backward), e.g.
        # {"gated_backward_in_place": 32}; filled as Inductor compiles them (a backward graph maybe only at the
        # first backward call), and not when a graph comes from Inductor's cache
        self.post_grad_counts: dict[str, int] = {}

    @property
    def counts(self) -> dict[str, int]:
        """Fused ops emitted so far, summed over every graph this backend compiled (graph breaks included)."""
        return count_by_pattern(m for result in self.results for m in result.matches)

    @property
    def last_result(self) -> RewriteResult | None:
        return self.results[-1] if self.results else None

    def __repr__(self) -> str:
        return f"FuserBackend({self.config!r})"

    def rewrite(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, RewriteResult | None]:
        """The rewritten copy of ``gm``; on failure ``gm`` itself with a warning (or FuserError under strict)."""
        try:
            new_gm, result = rewrite(gm, self.patterns, self.config)
        except Exception as error:
            if self.config.strict:
                raise FuserError(f"fuser: the rewrite failed: {error!r}") from error
            warnings.warn(
                f"fuser: the rewrite failed ({error!r}); compiling the unrewritten graph instead. "
                "Set FuserConfig(strict=True) to raise, and please report this.",
                RuntimeWarning,
                stacklevel=2,
            )
            return gm, None
        log.info("fuser: fused %s", result.counts or "nothing")
        return new_gm, result

    def compile_inner(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if self.config.inner_compiler == "eager":
            return gm.forward
        if self.config.inner_compiler == "aot_eager":
            return _compat.lookup_dynamo_backend("aot_eager")(gm, example_inputs)
        post_grad = _post_grad_pass(self.config, self.post_grad_counts)
        return _compat.inductor_compile(gm, example_inputs, config_patches={"post_grad_custom_post_pass": post_grad})

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        new_gm, result = self.rewrite(gm)
        if result is not None:
            self.results.append(result)
        if new_gm is gm:
            return self.compile_inner(gm, example_inputs)
        try:
            return self.compile_inner(new_gm, example_inputs)
        except Exception as error:
            if self.config.strict:
                raise FuserError(f"fuser: compiling the rewritten graph failed: {error!r}") from error
            warnings.warn(
                f"fuser: compiling the rewritten graph failed ({error!r}); compiling the unrewritten graph instead.",
                RuntimeWarning,
                stacklevel=2,
            )
            if result is not None:
                self.results.remove(result)
            return self.compile_inner(gm, example_inputs)


_BACKENDS: dict[FuserConfig, FuserBackend] = {}


def backend(config: FuserConfig | None = None) -> FuserBackend:
    """The Dynamo backend for ``config``: the same object for equal configs, so Dynamo does not recompile."""
    config = config or FuserConfig()
    if config not in _BACKENDS:
        _BACKENDS[config] = FuserBackend(config)
    return _BACKENDS[config]


def fuser_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable:
    """The backend registered as ``"fuser"`` (entry point ``torch_dynamo_backends``).

    ``torch.compile(model, backend="fuser", options={...})`` maps ``options`` onto :class:`FuserConfig`.
    """
    if mode not in (None, "default"):
        log.warning("fuser: torch.compile mode=%r is ignored; configure Inductor through torch._inductor.config", mode)
    return backend(FuserConfig.from_options(options))(gm, example_inputs)


def optimize(model: torch.nn.Module, config: FuserConfig | None = None) -> torch.nn.Module:
    """``torch.compile(model, backend=fuser.backend(config))``. ``model`` itself is not modified."""
    return torch.compile(model, backend=backend(config))
