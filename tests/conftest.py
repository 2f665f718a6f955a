"""Shared pytest setup: `gpu` tests are skipped where CUDA is absent, and without CUDA the Triton
kernels run under the interpreter (TRITON_INTERPRET=1 must be set before they are first compiled)."""

import os

import pytest
import torch

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
    from invact.activation import _numba

    monkeypatch.setattr(_numba, "available", lambda: False)
