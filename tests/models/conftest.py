"""Fixtures of the model tests (their helpers: ``harness.py``)."""

import pytest


@pytest.fixture
def rewritten(monkeypatch):
    """The graphs fuser's backend hands its inner compiler (rewritten, refinements applied), in order."""
    from fuser.dynamo_backend import FuserBackend

    graphs = []
    real = FuserBackend.compile_inner
    monkeypatch.setattr(FuserBackend, "compile_inner", lambda self, gm, ex: graphs.append(gm) or real(self, gm, ex))
    return graphs


@pytest.fixture
def inductor_caches_off():
    """``harness.inductor_caches_off`` around the test: its Inductor compiles run fuser's post-grad passes."""
    from tests.models.harness import inductor_caches_off

    with inductor_caches_off():
        yield
