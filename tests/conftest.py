import pytest
import torch

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
