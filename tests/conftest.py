"""Shared pytest setup: `gpu` tests are skipped where CUDA is absent, and without CUDA the Triton
kernels run under the interpreter (TRITON_INTERPRET=1 must be set before they are first compiled)."""

import os

import pytest
import torch

# torch.compile's on-disk caches key a graph by what Dynamo traced, not by the bodies invact's ops are
# traced as (invact._traced): a graph cached by an earlier checkout would run that checkout's bodies.
# The tests compile afresh (subprocesses inherit this).
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def portable(monkeypatch):
    """Eager runs the torch ops a compiled graph runs (invact._traced: the ops' bodies), not numba's CPU
    kernels, which round otherwise: eager and aot_eager are then comparable bit for bit."""
    from invact import _numba

    monkeypatch.setattr(_numba, "available", lambda: False)
