"""Deterministic demo model the server uses when no model directory is given."""

from __future__ import annotations

import torch
from torch import nn

from .checkpoint import model_from_state_dict
from .engine_model import EngineModel
from .save import module_config, module_state

DEMO_D_MODEL, DEMO_NHEAD, DEMO_DIM_FEEDFORWARD = 512, 8, 2048


def demo_module(seed: int = 0) -> nn.TransformerEncoder:
    """The seeded one-layer post-norm relu nn.TransformerEncoder (eval, batch_first) of the demo.

    Weights are those of nn.TransformerEncoderLayer built right after torch.manual_seed(seed);
    the global RNG state is restored afterwards.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = nn.TransformerEncoderLayer(
            DEMO_D_MODEL,
            DEMO_NHEAD,
            DEMO_DIM_FEEDFORWARD,
            dropout=0.0,
            activation="relu",
            batch_first=True,
            norm_first=False,
        )
    encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
    return encoder.eval()


def build_demo_model(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
) -> EngineModel:
    """EngineModel with the weights of demo_module(seed)."""
    module = demo_module(seed)
    return model_from_state_dict(module_config(module), module_state(module), device, dtype)
