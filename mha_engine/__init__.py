"""mha_engine: fused multi-head attention and transformer encoders with PyTorch's exact numbers.

Pure PyTorch inference engine used by the mha-serve service: load_model/save_model for model
directories, fast SDPA path, attention-weights path for debugging, and packed varlen batches.
Hugging Face BERT-family directories load as TextEncoderModel (token ids in, sentence vectors out).
"""

from .checkpoint import CheckpointError, load_model, save_model
from .demo import build_demo_model, demo_module
from .models import EngineModel, MultiheadAttentionModel, TransformerEncoderModel
from .text_model import TextEncoderModel

__all__ = [
    "CheckpointError",
    "EngineModel",
    "MultiheadAttentionModel",
    "TextEncoderModel",
    "TransformerEncoderModel",
    "build_demo_model",
    "demo_module",
    "load_model",
    "save_model",
]
