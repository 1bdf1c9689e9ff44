"""Test set-up. Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors, so the
interpreter flag must be set before triton is first imported."""
import os
import platform

# The interpreter's dots are NumPy's, and OpenBLAS picks its float32 kernel by CPU (AVX-512 hosts
# sum in another order than AVX2 ones): one kernel everywhere, so that a case near the oracle
# rule's bound passes or fails the same on every x86-64 machine. Set before NumPy loads.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def fused_blocks(monkeypatch):
    """The blocks' fused residual passes serve test-sized calls too, with autograd or without. Outside
    tests a call under blocks.MIN_ELEMENTS (MIN_TRAINING_ELEMENTS under autograd) goes to the block's
    own ops (they cost less host time there); the test files that do not ask for this keep those
    thresholds, so their small models run the blocks' own ops."""
    from elsa_vision.adapters import blocks
    monkeypatch.setattr(blocks, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(blocks, "MIN_TRAINING_ELEMENTS", 0)


@pytest.fixture(scope="session", autouse=True)
def native_replay():
    """On a GPU, repeated eager calls are replayed from C++ (kernels/native.py), whose extension
    otherwise builds in the background while the first tests run: built (or loaded) up front, so that
    every GPU test's repeated calls take that path from the start."""
    if torch.cuda.is_available():
        from elsa_vision.kernels import native
        native.load()
