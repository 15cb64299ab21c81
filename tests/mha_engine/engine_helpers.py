"""Shared helpers for engine tests: seeded PyTorch reference modules and loaded engine copies."""

from __future__ import annotations

import torch
from torch import nn

from mha_engine.checkpoint import model_from_state_dict
from mha_engine.save import module_config, module_state

# fp32 parity tolerance from the project brief; widen only with a measured reason next to it.
FP32 = {"atol": 1e-5, "rtol": 1.3e-6}


def engine_from(module: nn.Module, dtype: torch.dtype = torch.float32):
    """Build an engine model from a PyTorch module in memory (same path as save/load)."""
    return model_from_state_dict(module_config(module), module_state(module), "cpu", dtype)


def make_mha(embed_dim=12, num_heads=3, seed=0, **kwargs) -> nn.MultiheadAttention:
    """Seeded eval-mode nn.MultiheadAttention with non-zero biases (PyTorch inits them to 0)."""
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True, **kwargs).eval()
    with torch.no_grad():
        for name, p in mha.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.5)
    return mha
