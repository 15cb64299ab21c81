"""Model directories: config.json + model.safetensors (or a weights_only torch.save state dict).

Configs and state-dict keys use PyTorch's own names, so any nn.MultiheadAttention,
nn.TransformerEncoder(Layer), nn.TransformerDecoder(Layer) or nn.Transformer state dict loads as
is. A lone Transformer{Encoder,Decoder}Layer is a transformer_{encoder,decoder} with
num_layers=1 and keys prefixed `layers.0.` (unprefixed layer keys are accepted too).
Everything is validated before a model is built.
multihead_attention also loads other attention layouts (W_q/W_k/W_v/W_o, wq/wk/wv/wo, wqkv,
q_proj/..., qkv_proj; see layouts.py) and grouped-query attention (num_kv_heads); a Hugging Face
BERT-family directory (config.json with model_type) loads as a TextEncoderModel (hf_bert.py).
"""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from . import (
    heads,
    hf_bert,
    hf_gemma3,
    hf_jina,
    hf_llama,
    hf_modernbert,
    hf_qwen3,
    hf_rotary_bert,
    layouts,
    lexical,
    sparse,
)
from .config import (
    EngineConfig,
    LayerStackConfig,
    MultiheadAttentionConfig,
    TransformerConfig,
    TransformerDecoderConfig,
    config_from_dict,
)
from .decoder_models import TransformerDecoderModel
from .devices import resolve_device, resolve_precision
from .engine_model import EngineModel
from .errors import CheckpointError, check_state
from .fused import prepack
from .gemma3 import Gemma3Model
from .heads import TextClassifierModel
from .models import MultiheadAttentionModel, TransformerEncoderModel
from .modernbert import ModernBertClassifierModel, ModernBertModel
from .quantize import quantize_int8
from .qwen3 import Qwen3ClassifierModel, Qwen3Model
from .rotary_bert import RotaryBertClassifierModel, RotaryBertModel
from .score_head import RERANKER_INFO
from .st_files import TextSettings, read_text_settings
from .text_model import TextEncoderModel
from .transformer_model import TransformerModel

log = logging.getLogger(__name__)
WEIGHT_FILES = ("model.safetensors", "model.pt", "pytorch_model.bin")
# model_type -> (its mapping, encoder class, classifier class or None) for the families with
# their own stack; every other model_type maps through hf_bert onto EncoderStack
OWN_STACKS: dict[str, tuple] = {
    hf_modernbert.MODEL_TYPE: (hf_modernbert, ModernBertModel, ModernBertClassifierModel),
    hf_qwen3.MODEL_TYPE: (hf_qwen3, Qwen3Model, Qwen3ClassifierModel),
    **{name: (hf_llama, Qwen3Model, Qwen3ClassifierModel) for name in hf_llama.MODEL_TYPES},
    hf_gemma3.MODEL_TYPE: (hf_gemma3, Gemma3Model, None),
    **{
        name: (hf_rotary_bert, RotaryBertModel, RotaryBertClassifierModel)
        for name in hf_rotary_bert.MODEL_TYPES
    },
}
SUPPORTED_MODEL_TYPES = (*hf_bert.FAMILIES, *OWN_STACKS)  # every text model_type that loads


MODEL_CLASSES: dict[str, type[EngineModel]] = {
    cls.architecture: cls
    for cls in (
        MultiheadAttentionModel,
        TransformerEncoderModel,
        TransformerDecoderModel,
        TransformerModel,
    )
}


def parse_config(config: object) -> EngineConfig:
    """The typed config of a config.json object; raises CheckpointError naming the field."""
    if isinstance(config, MultiheadAttentionConfig | LayerStackConfig | TransformerConfig):
        return config
    typed = config_from_dict(config)
    if isinstance(typed, MultiheadAttentionConfig) and config.get("attention_keys") is not None:
        layouts.parse_key_map(config["attention_keys"])  # fail early, naming the field
    return typed


def expected_shapes(config: EngineConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict key PyTorch would produce for this config, with its shape."""
    if isinstance(config, MultiheadAttentionConfig):
        E, KV = config.embed_dim, config.kv_dim  # K/V width (E without GQA)
        shapes: dict[str, tuple[int, ...]] = {}
        if config.same_embed_dim:
            shapes["in_proj_weight"] = (E + 2 * KV, E)
        else:
            shapes["q_proj_weight"] = (E, E)
            shapes["k_proj_weight"] = (KV, config.kdim)
            shapes["v_proj_weight"] = (KV, config.vdim)
        shapes["out_proj.weight"] = (E, E)
        if config.bias:
            shapes["in_proj_bias"] = (E + 2 * KV,)
            shapes["out_proj.bias"] = (E,)
        if config.add_bias_kv:
            shapes["bias_k"] = shapes["bias_v"] = (1, 1, KV)
        return shapes
    if isinstance(config, TransformerConfig):
        return {
            **{f"encoder.{k}": v for k, v in _stack_shapes(config.encoder).items()},
            **{f"decoder.{k}": v for k, v in _stack_shapes(config.decoder).items()},
        }
    return _stack_shapes(config)


def _stack_shapes(config: LayerStackConfig) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of an nn.TransformerEncoder or nn.TransformerDecoder (layers + norm)."""
    E, F, bias = config.d_model, config.dim_feedforward, config.bias
    attentions = ["self_attn"]
    norms = ["norm1", "norm2"]
    if isinstance(config, TransformerDecoderConfig):
        attentions.append("multihead_attn")
        norms.append("norm3")
    gated = getattr(config, "gated_ffn", False)  # JinaBERT's GLU: [gate; up] rows, no bias
    layer: dict[str, tuple[int, ...]] = {
        "linear1.weight": (2 * F if gated else F, E),
        "linear2.weight": (E, F),
    }
    for name in attentions:
        layer[f"{name}.in_proj_weight"] = (3 * E, E)
        layer[f"{name}.out_proj.weight"] = (E, E)
        if bias:
            layer[f"{name}.in_proj_bias"] = (3 * E,)
            layer[f"{name}.out_proj.bias"] = (E,)
    for name in norms:
        layer[f"{name}.weight"] = (E,)
        if bias:
            layer[f"{name}.bias"] = (E,)
    if bias:
        layer["linear2.bias"] = (E,)
        if not gated:
            layer["linear1.bias"] = (F,)
    shapes = {f"layers.{i}.{k}": s for i in range(config.num_layers) for k, s in layer.items()}
    if config.final_norm:
        shapes["norm.weight"] = (E,)
        if bias:
            shapes["norm.bias"] = (E,)
    buckets = getattr(config, "relative_attention_num_buckets", 0)  # MPNet (TextEncoderConfig)
    if buckets:
        shapes["position_bias.relative_attention_bias.weight"] = (buckets, config.nhead)
    return shapes


def validate_state_dict(state: dict, config: EngineConfig) -> None:
    """Raise CheckpointError for missing/unexpected keys, wrong shapes or non-float tensors."""
    check_state(state, expected_shapes(config), f"{config.architecture} config")


def attention_to_pytorch_names(
    state: dict, config: MultiheadAttentionConfig, key_map: object = None
) -> tuple[dict, MultiheadAttentionConfig]:
    """A multihead_attention state dict in another layout, renamed and fused into PyTorch's.

    The layout comes from config.json's attention_keys or is detected; PyTorch's own names pass
    through. Such layouts say themselves whether they carry biases, so `bias` follows them.
    """
    keys = layouts.parse_key_map(key_map) if key_map is not None else layouts.detect(state)
    if keys is None:
        return state, config
    state, has_bias = layouts.to_pytorch_names(state, keys, config)
    return state, replace(config, bias=has_bias, attention_layout=keys.describe())


def _assign(module: nn.Module, state: dict[str, Tensor], device, dtype) -> None:
    """Load `state` (cast once) into a module built on the meta device; freeze it for inference."""
    weights = {k: v.detach().to(device=device, dtype=dtype).contiguous() for k, v in state.items()}
    module.load_state_dict(weights, strict=True, assign=True)


def model_from_state_dict(
    config: dict | EngineConfig,
    state: dict[str, Tensor],
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> EngineModel:
    """Validate config and state dict, cast weights once, and build the fused model."""
    key_map = config.get("attention_keys") if isinstance(config, dict) else None
    config = parse_config(config)
    bare_layer = not any(k.startswith("layers.") for k in state)
    if isinstance(config, LayerStackConfig) and config.num_layers == 1 and bare_layer:
        state = {f"layers.0.{k}": v for k, v in state.items()}
    if isinstance(config, MultiheadAttentionConfig):
        state, config = attention_to_pytorch_names(state, config, key_map)
    validate_state_dict(state, config)
    device = resolve_device(device)
    dtype, int8 = resolve_precision(dtype, device)
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    _assign(model.core, state, device, dtype)
    model = model.requires_grad_(False).eval()
    return prepack(quantize_int8(model) if int8 else model)


def _dense_state(settings: TextSettings) -> dict[str, Tensor]:
    """TextEncoderModel.dense's state from the Dense modules' weight files, shapes checked."""
    state: dict[str, Tensor] = {}
    for i, (config, where) in enumerate(zip(settings.dense, settings.dense_dirs, strict=True)):
        expected = {"linear.weight": (config.out_features, config.in_features)}
        if config.bias:
            expected["linear.bias"] = (config.out_features,)
        weights = _read_weights(where)
        check_state(weights, expected, f"{where / 'config.json'} (Dense)")
        state.update({f"{i}.{k}": v for k, v in weights.items()})
    return state


def _read_weights(directory: Path) -> dict:
    for name in WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if name.endswith(".safetensors"):
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                return load_file(str(path))
            except (SafetensorError, OSError, ValueError) as exc:
                raise CheckpointError(f"{path} is not a valid safetensors file: {exc}") from exc
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"{path} was refused by torch.load(weights_only=True): it holds objects other "
                f"than tensors, which are never unpickled ({str(exc).splitlines()[0]})"
            ) from exc
        except (RuntimeError, OSError, EOFError, ValueError) as exc:
            raise CheckpointError(f"{path} is not a readable torch.save file: {exc}") from exc
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise CheckpointError(f"{path} must hold a state dict (str -> Tensor)")
        return dict(state)
    raise CheckpointError(f"{directory} has none of the weight files {list(WEIGHT_FILES)}")


def load_model(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    dense_path: str | None = None,
) -> EngineModel:
    """Load a model directory (config.json + weights) into a fused EngineModel.

    dtype: float32 (default), bfloat16, float16, or "int8" (int8 Linears, the rest float32).
    dense_path: a text model's folder holding the Dense module to run instead of the one its
    modules.json lists (TEI's --dense-path).
    """
    directory = Path(path)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} not found")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    config = hf_jina.with_model_type(config)  # Jina's XLM-RoBERTa names none
    if hf_bert.is_hf_config(config):
        return text_model_from_directory(directory, config, device, dtype, dense_path)
    if dense_path is not None:
        raise CheckpointError(f"dense_path {dense_path!r}: {directory} is not a text model")
    if isinstance(config, dict) and "architectures" in config and "architecture" not in config:
        raise CheckpointError(
            f"{config_path} names no model_type: a Hugging Face config needs one (one of "
            f"{list(SUPPORTED_MODEL_TYPES)}), or Jina's XLM-RoBERTa code in its auto_map"
        )
    parse_config(config)  # fail on config errors before reading weights
    return model_from_state_dict(config, _read_weights(directory), device, dtype)


def text_model_from_directory(
    directory: Path,
    hf_config: dict,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    dense_path: str | None = None,
) -> TextEncoderModel:
    """A Hugging Face BERT-family directory as a TextEncoderModel (encoder + embeddings), a
    TextClassifierModel when config.architectures names a `...ForSequenceClassification`, or a
    SparseEncoderModel when modules.json asks for SPLADE pooling (sentence-transformers'
    SparseEncoder), or a LexicalEncoderModel when BGE-M3's sparse_linear.pt lies beside it."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    own = OWN_STACKS.get(model_type)
    bert = (hf_bert, TextEncoderModel, TextClassifierModel)
    family, encoder_class, classifier_class = own or bert
    config = family.engine_config(hf_config)  # fail on config errors before reading weights
    # the engine implements JinaBERT's code; other auto_maps name code it does not run
    if hf_config.get("auto_map") and config.model_type != hf_bert.JINA:
        log.warning(
            "%s: config.json names the model's own code (auto_map); the engine runs the "
            "built-in %s architecture on this config, as transformers does without "
            "trust_remote_code, reading the fields docs/models.md lists for the family (code "
            "that changes the attention, e.g. to bidirectional, is not run: set config.json's "
            "is_causal to false where the model needs that)",
            directory,
            config.model_type,
        )
    settings = read_text_settings(directory, dense_path)
    config = replace(
        config,
        pooling=settings.pooling,
        normalize=settings.normalize,
        max_seq_len=settings.max_seq_len or 0,
        dense=settings.dense,
    )
    info = heads.classifier_info(hf_config) if heads.is_sequence_classifier(hf_config) else None
    if settings.logit_score is not None:
        if info is not None or not hasattr(family, "classifier_head"):
            raise CheckpointError(
                f"{directory}: modules.json's LogitScore scores a causal LM's logits; "
                f"{hf_config.get('architectures')} of model_type {model_type!r} is not one the "
                "engine scores that way (Qwen3's and the Llama family's are)"
            )
        info = RERANKER_INFO
    if settings.sparse and config.model_type not in sparse.MLM_NAMES:
        raise CheckpointError(
            f"{directory}: a {config.model_type} SPLADE model (its masked-LM head) is not "
            f"supported (only {list(sparse.MLM_NAMES)})"
        )
    if info is not None and classifier_class is None:
        raise CheckpointError(
            f"{directory}: a {model_type} sequence classifier ({hf_config.get('architectures')}) "
            "is not supported; its base model serves embeddings"
        )
    # a decoder family reads its own head (classifier_head); BERT-like ones the heads.py forms
    own_head = getattr(family, "classifier_head", None)
    spec = heads.head_spec(hf_config, config) if info is not None and not own_head else None
    if settings.sparse and not sparse.is_masked_lm(hf_config):
        raise CheckpointError(
            f"{directory}: modules.json asks for SPLADE pooling, but config.json's architectures "
            f"{hf_config.get('architectures')} name no ...ForMaskedLM; SPLADE needs a "
            "...ForMaskedLM checkpoint (its masked-LM head)"
        )
    weights = _read_weights(directory)
    encoder_state, embedding_state = family.engine_state(weights, config)
    if own is None:
        validate_state_dict(encoder_state, config)
    head = None  # the head's weights, checked before anything is built
    if info is not None and own_head is not None:
        spec, head = own_head(weights, hf_config, config, info.num_labels, settings.logit_score)
    elif info is not None:
        base = family.base_prefix(weights)
        head = heads.head_state(
            weights, config.model_type, base, config.d_model, info.num_labels, spec
        )
    elif settings.sparse:
        head = sparse.mlm_head_state(weights, config)
    lexical_head = None  # BGE-M3's sparse_linear.pt, for a plain BERT-family embedder
    if info is None and not settings.sparse and encoder_class is TextEncoderModel:
        lexical_head = lexical.read_head(directory, config)
    elif (directory / lexical.FILE).exists():
        log.warning("%s: %s is not used: lexical weights are served for BERT-family embedding "
                    "models (BGE-M3's form) only", directory, lexical.FILE)  # fmt: skip
    del weights
    dense = _dense_state(settings)
    device = resolve_device(device)
    dtype, int8 = resolve_precision(dtype, device)
    with torch.device("meta"):
        if info is not None:
            model = classifier_class(config, info, spec)
        elif settings.sparse:
            model = sparse.SparseEncoderModel(config)
        elif lexical_head is not None:
            model = lexical.LexicalEncoderModel(config, lexical.special_ids(directory, hf_config))
        else:
            model = encoder_class(config)
    _assign(model.encoder, encoder_state, device, dtype)
    if head is not None:
        _assign(model.head, head, device, dtype)
    _assign(model.embeddings, embedding_state, device, torch.float32)  # see TextEmbeddings
    _assign(model.dense, dense, device, torch.float32)  # float32 vectors, as pooling gives
    if lexical_head is not None:
        _assign(model.lexical, lexical_head, device, torch.float32)
    model = model.requires_grad_(False).eval()
    return prepack(quantize_int8(model) if int8 else model)
