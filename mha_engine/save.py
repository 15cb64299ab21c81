"""save_model: any PyTorch block or loaded engine model as a directory load_model reads back.

nn.MultiheadAttention / nn.TransformerEncoder(Layer) / nn.TransformerDecoder(Layer) /
nn.Transformer and loaded multihead_attention / transformer_* models (from any layout) are
written as config.json (config dataclass `to_dict`) + model.safetensors in PyTorch's names;
text models as a Hugging Face directory (config.json with model_type, HF weight names) plus
sentence-transformers' pooling files, loadable by transformers and sentence-transformers too.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch.nn.functional as F
from torch import Tensor, nn

from . import hf_bert
from .checkpoint import OWN_STACKS
from .config import MultiheadAttentionConfig
from .engine_model import EngineModel
from .heads import SequenceClassifier
from .lexical import LexicalEncoderModel
from .sparse import SparseEncoderModel
from .st_files import write_text_settings
from .text_model import TextEncoderModel


def _cpu_copies(state: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """Detached CPU tensors with storage of their own (safetensors refuses shared storage)."""
    return {f"{prefix}{k}": v.detach().cpu().clone() for k, v in state.items()}


def module_config(module: nn.Module) -> dict:
    """config.json contents for an nn.MultiheadAttention, TransformerEncoder(Layer),
    TransformerDecoder(Layer) or Transformer."""
    if isinstance(module, nn.MultiheadAttention):
        return {
            "architecture": "multihead_attention",
            "embed_dim": module.embed_dim,
            "num_heads": module.num_heads,
            "bias": module.in_proj_bias is not None,
            "add_bias_kv": module.bias_k is not None,
            "add_zero_attn": bool(module.add_zero_attn),
            "kdim": module.kdim,
            "vdim": module.vdim,
        }
    if isinstance(module, nn.TransformerEncoder | nn.TransformerDecoder):
        return _stack_config(module)
    if isinstance(module, nn.TransformerEncoderLayer | nn.TransformerDecoderLayer):
        return _layer_config(module)
    if isinstance(module, nn.Transformer):
        if not isinstance(module.encoder, nn.TransformerEncoder) or not isinstance(
            module.decoder, nn.TransformerDecoder
        ):
            raise ValueError("a custom_encoder or custom_decoder cannot be exported")
        enc, dec = _stack_config(module.encoder), _stack_config(module.decoder)
        if not enc["final_norm"] or not dec["final_norm"]:
            raise ValueError("nn.Transformer's encoder and decoder must keep their norms")
        per_stack = ("architecture", "num_layers", "final_norm")
        shared = {k: v for k, v in dec.items() if k not in per_stack}
        if {k: v for k, v in enc.items() if k not in per_stack} != shared:
            raise ValueError("the encoder and decoder of the Transformer must share one config")
        return {
            "architecture": "transformer",
            **shared,
            "num_encoder_layers": enc["num_layers"],
            "num_decoder_layers": dec["num_layers"],
        }
    raise TypeError(f"cannot export {type(module).__name__}")


def _activation(module: nn.Module) -> str:
    """relu | gelu | gelu_tanh of an encoder or decoder layer, else ValueError."""
    if isinstance(module, nn.TransformerEncoderLayer):
        act = getattr(module, "activation_relu_or_gelu", 0)
        approximate = getattr(module.activation, "approximate", "none")
        if act in (1, 2) and approximate == "none":
            return "relu" if act == 1 else "gelu"
    else:  # a decoder layer keeps F.relu / F.gelu (from a name) or the module it was given
        fn = module.activation
        if fn is F.relu or isinstance(fn, nn.ReLU):
            return "relu"
        if fn is F.gelu or (isinstance(fn, nn.GELU) and fn.approximate == "none"):
            return "gelu"
    raise ValueError("only relu and exact gelu activations can be exported")


def _layer_config(module: nn.Module) -> dict:
    """config.json of a lone nn.TransformerEncoderLayer / DecoderLayer (num_layers=1)."""
    decoder = isinstance(module, nn.TransformerDecoderLayer)
    norms = [module.norm1, module.norm2, *([module.norm3] if decoder else [])]
    if any(n.eps != norms[0].eps for n in norms):
        raise ValueError("the layer's norms have different eps; config has one layer_norm_eps")
    return {
        "architecture": "transformer_decoder" if decoder else "transformer_encoder",
        "d_model": module.self_attn.embed_dim,
        "nhead": module.self_attn.num_heads,
        "dim_feedforward": module.linear1.out_features,
        "activation": _activation(module),
        "layer_norm_eps": module.norm1.eps,
        "norm_first": bool(module.norm_first),
        "bias": module.linear1.bias is not None,
        "num_layers": 1,
        "final_norm": False,
    }


def _stack_config(module: nn.TransformerEncoder | nn.TransformerDecoder) -> dict:
    """config.json of an nn.TransformerEncoder / nn.TransformerDecoder of identical layers."""
    kind = type(module).__name__
    layers = [_layer_config(layer) for layer in module.layers]
    if any(c != layers[0] for c in layers):
        raise ValueError(f"all layers of the {kind} must share one config")
    config = dict(layers[0], num_layers=len(layers), final_norm=module.norm is not None)
    norm = module.norm
    if norm is not None and (
        not isinstance(norm, nn.LayerNorm)
        or norm.eps != config["layer_norm_eps"]
        or (norm.bias is not None) != config["bias"]
    ):
        raise ValueError("final norm must be a LayerNorm with the layers' eps and bias")
    return config


def module_state(module: nn.Module) -> dict[str, Tensor]:
    """The module's state dict in engine layout (a lone encoder layer gets `layers.0.`)."""
    lone = isinstance(module, nn.TransformerEncoderLayer | nn.TransformerDecoderLayer)
    prefix = "layers.0." if lone else ""
    return _cpu_copies(module.state_dict(), prefix)


def engine_files(model: EngineModel) -> tuple[dict, dict[str, Tensor]]:
    """(config.json contents, state dict) of a loaded model, in the form load_model reads."""
    if isinstance(model, TextEncoderModel):
        own = OWN_STACKS.get(model.config.model_type)  # the family's mapping, by model_type
        family = own[0] if own is not None else hf_bert
        state = family.hf_state(
            model.encoder.state_dict(), model.embeddings.state_dict(), model.config
        )
        return family.hf_config(model.config), _cpu_copies(state)
    config = model.config
    if isinstance(config, MultiheadAttentionConfig):
        config = replace(config, attention_layout=None)  # the weights are in PyTorch's names now
    return config.to_dict(), _cpu_copies(model.core.state_dict())


def save_model(model: nn.Module, path: str | Path) -> None:
    """Write config.json + model.safetensors so load_model gives back the same function.

    `model` is an nn.MultiheadAttention, nn.TransformerEncoder(Layer),
    nn.TransformerDecoder(Layer), nn.Transformer or a model load_model returned (weights keep
    its dtype), but for a text model with a task head (classifier, reranker, SPLADE, BGE-M3's
    sparse_linear: refused, its head would be lost). A text model's tokenizer files are not
    part of the model: copy them beside it to serve /v1/embeddings from the directory.
    """
    from safetensors.torch import save_file

    if isinstance(model, EngineModel):
        if isinstance(model, SequenceClassifier | SparseEncoderModel | LexicalEncoderModel):
            raise ValueError(
                f"a {type(model).__name__} is not saved: its task head would be lost and the "
                "directory would load as a plain encoder; keep the model's original directory "
                "(save_pretrained from transformers or sentence-transformers)"
            )
        if model.precision == "int8":
            raise ValueError(
                "an int8 model is not saved: save the float32 model and load it with "
                "dtype='int8' (weights are quantized at load)"
            )
        config, state = engine_files(model)
    else:
        config, state = module_config(model), module_state(model)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if isinstance(model, TextEncoderModel):
        write_text_settings(directory, model.config, _cpu_copies(model.dense.state_dict()))
