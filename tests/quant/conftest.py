import copy

import pytest
import torch

from seekforge.config import preset
from seekforge.model.model import build_model


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset (hidden 64, MoE with 8 experts): every in_features divides by 32."""
    return build_model(preset("tiny"), seed=0).eval()


@pytest.fixture
def tiny_copy(tiny):
    return copy.deepcopy(tiny)


@pytest.fixture(scope="module")
def samples(tiny):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, tiny.cfg.vocab_size, (48,), generator=gen) for _ in range(8)]
