"""mha_engine: fused multi-head attention and transformer encoders with PyTorch's exact numbers.

Pure PyTorch inference engine used by the mha-serve service: load_model/save_model for model
directories, fast SDPA path, attention-weights path for debugging, and packed varlen batches.
"""

from .checkpoint import CheckpointError, load_model, save_model
from .demo import build_demo_model, demo_module
from .models import EngineModel, MultiheadAttentionModel, TransformerEncoderModel

__all__ = [
    "CheckpointError",
    "EngineModel",
    "MultiheadAttentionModel",
    "TransformerEncoderModel",
    "build_demo_model",
    "demo_module",
    "load_model",
    "save_model",
]
