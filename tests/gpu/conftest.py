"""Fixtures shared by the GPU tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def module(request: pytest.FixtureRequest) -> torch.nn.MultiheadAttention:
    """The test module's nn.MultiheadAttention(E, H) (its own E and H), seeded, in eval mode."""
    torch.manual_seed(0)
    embed_dim, num_heads = request.module.E, request.module.H
    return torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True).eval()
