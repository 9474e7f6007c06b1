import os

import pytest
import torch

# No GPU here: our Triton kernels (seekforge/model/gpu) run in Triton's interpreter on CPU tensors. Read when a
# kernel is defined, so before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from seekforge.model import kernels


@pytest.fixture(autouse=True, scope="session")
def _cpu_kernels():
    """Our CPU kernels loaded from the first test on, where this CPU runs them (as an engine loads them): every
    test sees the model's paths as serving takes them, whichever test happens to build an engine first."""
    kernels.load()
    yield


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
