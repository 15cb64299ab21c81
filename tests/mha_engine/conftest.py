"""Engine tests start from a fixed RNG state so every run sees the same inputs."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
