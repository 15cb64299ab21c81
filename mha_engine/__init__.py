"""mha_engine: fused multi-head attention and transformer blocks with PyTorch's exact numbers.

Pure PyTorch inference engine used by the mha-serve service: nn.Modules with typed, frozen
configs (config.py), load_model/save_model for model directories, fast SDPA path,
attention-weights path for debugging, and packed varlen batches. Encoders, decoders
(nn.TransformerDecoder: target + memory) and whole nn.Transformer models load by their
PyTorch state dicts.
Hugging Face BERT-family directories load as TextEncoderModel (token ids in, sentence vectors out),
TextClassifierModel for `...ForSequenceClassification` checkpoints (logits out), or
SparseEncoderModel for SPLADE sparse encoders (a weight per vocabulary entry out), or
LexicalEncoderModel for BGE-M3 (dense vectors and lexical weights from sparse_linear.pt); ModernBERT
directories as ModernBertModel (a TextEncoderModel with rotary, sliding-window layers) or
ModernBertClassifierModel (a TextClassifierModel) with a sequence-classification head; Qwen3
directories (Qwen3-Embedding), and the Llama family's (Llama, Mistral, Qwen2), as Qwen3Model (a
TextEncoderModel with causal, rotary GQA layers),
Qwen3 rerankers (a causal LM scored by LogitScore, or a sequence classifier) as
Qwen3ClassifierModel (a ScoreClassifierModel: one Linear at one token); bidirectional Gemma 3
directories (EmbeddingGemma) as Gemma3Model.
"""

from .attention import FusedAttention
from .blocks import EncoderLayer, EncoderStack
from .checkpoint import CheckpointError, load_model
from .config import (
    EngineConfig,
    MultiheadAttentionConfig,
    TransformerConfig,
    TransformerDecoderConfig,
    TransformerEncoderConfig,
    config_from_dict,
)
from .cpu_memory import cpu_allocator_tuned, tune_cpu_allocator
from .decoder_blocks import DecoderLayer, DecoderStack
from .decoder_models import TransformerDecoderModel
from .demo import build_demo_model, demo_module
from .devices import check_device, moved
from .engine_model import EngineModel
from .errors import DeviceError
from .gemma3 import Gemma3Model
from .heads import ClassifierInfo, TextClassifierModel
from .lexical import LexicalEncoderModel
from .models import MultiheadAttentionModel, TransformerEncoderModel
from .modernbert import ModernBertClassifierModel, ModernBertModel
from .protocol import ServedClassifierModel, ServedModel, ServedSparseModel, ServedTextModel
from .quantize import Int8Linear, Int8Unsupported, quantize_int8
from .qwen3 import Qwen3ClassifierModel, Qwen3Model
from .rotary_bert import RotaryBertClassifierModel, RotaryBertModel
from .save import save_model
from .score_head import ScoreClassifierModel
from .sparse import SparseEncoderModel
from .text import TextEmbeddings
from .text_config import (
    DenseConfig,
    Gemma3EncoderConfig,
    ModernBertEncoderConfig,
    Qwen3EncoderConfig,
    RopeScaling,
    RotaryBertConfig,
    TextEncoderConfig,
)
from .text_model import TextEncoderModel
from .transformer_model import TransformerModel

__all__ = [
    "CheckpointError",
    "ClassifierInfo",
    "DecoderLayer",
    "DecoderStack",
    "DenseConfig",
    "DeviceError",
    "EncoderLayer",
    "EncoderStack",
    "EngineConfig",
    "EngineModel",
    "FusedAttention",
    "Gemma3EncoderConfig",
    "Gemma3Model",
    "Int8Linear",
    "Int8Unsupported",
    "LexicalEncoderModel",
    "ModernBertClassifierModel",
    "ModernBertEncoderConfig",
    "ModernBertModel",
    "MultiheadAttentionConfig",
    "MultiheadAttentionModel",
    "Qwen3ClassifierModel",
    "Qwen3EncoderConfig",
    "Qwen3Model",
    "RopeScaling",
    "RotaryBertClassifierModel",
    "RotaryBertConfig",
    "RotaryBertModel",
    "ScoreClassifierModel",
    "ServedClassifierModel",
    "ServedModel",
    "ServedSparseModel",
    "ServedTextModel",
    "SparseEncoderModel",
    "TextClassifierModel",
    "TextEmbeddings",
    "TextEncoderConfig",
    "TextEncoderModel",
    "TransformerConfig",
    "TransformerDecoderConfig",
    "TransformerDecoderModel",
    "TransformerEncoderConfig",
    "TransformerEncoderModel",
    "TransformerModel",
    "build_demo_model",
    "check_device",
    "config_from_dict",
    "cpu_allocator_tuned",
    "demo_module",
    "load_model",
    "moved",
    "quantize_int8",
    "save_model",
    "tune_cpu_allocator",
]
