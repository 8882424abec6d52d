"""Test set-up shared by every tier.

Without a GPU the Triton kernels are tested through Triton's interpreter: ``TRITON_INTERPRET`` must be set
before Triton is first imported, so it is set here, before anything imports ``fuser``.

Most of the suite's time is Dynamo tracing tiny models, which is Python: the cyclic garbage collector is tuned
for it (below), and without a GPU torch runs on one thread per pytest-xdist worker.
"""

import gc
import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
    if not _HAS_CUDA:
        # toy sizes gain nothing from threads, and with `-n 2` on a 2-core machine a second OpenMP thread per
        # worker only waits for a core (tests/models/test_rms_norm.py's fp32 steps: 10-20 % faster)
        torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Dynamo allocates millions of short-lived objects per compile: with the default threshold (700) the collector
# ran ~3300 times in two model tests and took 10-15 % of their time, scanning the same long-lived modules. A
# collection every 50 000 net allocations frees the same cycles, later; what is already alive once the tests are
# collected (torch, transformers, the test modules) is frozen out of the scans (pytest_collection_finish).
gc.set_threshold(50_000, 20, 100)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def triton_on_cpu():
    """Call it (``triton_on_cpu()``) to send the ops on CPU tensors through their Triton kernels on the interpreter
    for the rest of the test (``fuser.kernels._triton.triton_on_cpu``); ``triton_on_cpu(False)``: the reference
    path again."""
    import contextlib

    from fuser.kernels._triton import triton_on_cpu as scope

    with contextlib.ExitStack() as stack:
        yield lambda enabled=True: stack.enter_context(scope(enabled))


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    """Each test starts from a clean Dynamo cache, so compile counts are the test's own, and from a global RNG
    seeded by its own id: inputs drawn from the global RNG differ between tests but not between runs (a test's
    outcome no longer depends on which tests ran before it)."""
    import zlib

    import torch._dynamo

    import fuser.dynamo_backend

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    torch._dynamo.reset()
    fuser.dynamo_backend._BACKENDS.clear()  # fresh per-config backends, so `.counts` are this test's own
    yield
    torch._dynamo.reset()
