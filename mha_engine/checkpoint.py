"""Model directories: config.json + model.safetensors (or a weights_only torch.save state dict).

Configs and state-dict keys use PyTorch's own names, so any nn.MultiheadAttention,
nn.TransformerEncoderLayer or nn.TransformerEncoder state dict loads as is. A lone
TransformerEncoderLayer is a transformer_encoder with num_layers=1 and keys prefixed `layers.0.`
(unprefixed layer keys are accepted too). Everything is validated before a model is built.
multihead_attention also loads other attention layouts (W_q/W_k/W_v/W_o, wq/wk/wv/wo, wqkv,
q_proj/..., qkv_proj; see layouts.py) and grouped-query attention (num_kv_heads); a Hugging Face
BERT-family directory (config.json with model_type) loads as a TextEncoderModel (hf_bert.py).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from torch import Tensor, nn

from . import hf_bert, layouts
from .attention import FusedAttention
from .blocks import EncoderStack
from .errors import CheckpointError, check_state, positive_int
from .models import EngineModel, MultiheadAttentionModel, TransformerEncoderModel
from .text import TextEmbeddings
from .text_model import TextEncoderModel, read_text_settings

WEIGHT_FILES = ("model.safetensors", "model.pt", "pytorch_model.bin")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARCHITECTURES = ("multihead_attention", "transformer_encoder")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None means cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A torch floating dtype or one of the names float32 | bfloat16 | float16 (default float32)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {list(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {list(DTYPES)}")
    return DTYPES[dtype]


def normalise_config(config: dict) -> dict:
    """Check a config and fill PyTorch's defaults; raises CheckpointError naming the field."""
    if not isinstance(config, dict):
        raise CheckpointError(f"config.json must hold an object, got {type(config).__name__}")
    arch = config.get("architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"unknown architecture {arch!r}; expected one of {ARCHITECTURES}")
    c = dict(config)
    if arch == "multihead_attention":
        E, H = positive_int(c, "embed_dim"), positive_int(c, "num_heads")
        c["kdim"] = E if c.get("kdim") is None else positive_int(c, "kdim")
        c["vdim"] = E if c.get("vdim") is None else positive_int(c, "vdim")
        for flag, default in (("bias", True), ("add_bias_kv", False), ("add_zero_attn", False)):
            c[flag] = bool(c.get(flag, default))
        c["num_kv_heads"] = H if c.get("num_kv_heads") is None else positive_int(c, "num_kv_heads")
        if H % c["num_kv_heads"]:
            raise CheckpointError(
                f"num_heads {H} is not divisible by num_kv_heads {c['num_kv_heads']}"
            )
        if c.get("attention_keys") is not None:
            layouts.parse_key_map(c["attention_keys"])  # fail early, naming the field
    else:
        E, H = positive_int(c, "d_model"), positive_int(c, "nhead")
        positive_int(c, "dim_feedforward")
        c["num_layers"] = positive_int(c, "num_layers") if "num_layers" in c else 1
        c.setdefault("activation", "relu")
        if c["activation"] not in ACTIVATIONS:
            raise CheckpointError(
                f"config.activation must be relu or gelu (or gelu_tanh), got {c['activation']!r}"
            )
        c["layer_norm_eps"] = float(c.get("layer_norm_eps", 1e-5))
        for flag, default in (("norm_first", False), ("bias", True), ("final_norm", False)):
            c[flag] = bool(c.get(flag, default))
    if E % H:
        raise CheckpointError(f"embed_dim {E} is not divisible by num_heads {H}")
    return c


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every state-dict key PyTorch would produce for this config, with its shape."""
    if config["architecture"] == "multihead_attention":
        E, kdim, vdim = config["embed_dim"], config["kdim"], config["vdim"]
        KV = E // config["num_heads"] * config["num_kv_heads"]  # K/V width (E without GQA)
        shapes: dict[str, tuple[int, ...]] = {}
        if kdim == E and vdim == E:
            shapes["in_proj_weight"] = (E + 2 * KV, E)
        else:
            shapes.update(q_proj_weight=(E, E), k_proj_weight=(KV, kdim), v_proj_weight=(KV, vdim))
        shapes["out_proj.weight"] = (E, E)
        if config["bias"]:
            shapes["in_proj_bias"] = (E + 2 * KV,)
            shapes["out_proj.bias"] = (E,)
        if config["add_bias_kv"]:
            shapes["bias_k"] = shapes["bias_v"] = (1, 1, KV)
        return shapes
    E, F, bias = config["d_model"], config["dim_feedforward"], config["bias"]
    layer = {
        "self_attn.in_proj_weight": (3 * E, E),
        "self_attn.out_proj.weight": (E, E),
        "linear1.weight": (F, E),
        "linear2.weight": (E, F),
        "norm1.weight": (E,),
        "norm2.weight": (E,),
    }
    if bias:
        layer.update(
            {
                "self_attn.in_proj_bias": (3 * E,),
                "self_attn.out_proj.bias": (E,),
                "linear1.bias": (F,),
                "linear2.bias": (E,),
                "norm1.bias": (E,),
                "norm2.bias": (E,),
            }
        )
    shapes = {f"layers.{i}.{k}": s for i in range(config["num_layers"]) for k, s in layer.items()}
    if config["final_norm"]:
        shapes["norm.weight"] = (E,)
        if bias:
            shapes["norm.bias"] = (E,)
    return shapes


def validate_state_dict(state: dict, config: dict) -> None:
    """Raise CheckpointError for missing/unexpected keys, wrong shapes or non-float tensors."""
    check_state(state, expected_shapes(config), f"{config['architecture']} config")


def attention_to_pytorch_names(state: dict, config: dict) -> tuple[dict, dict]:
    """A multihead_attention state dict in another layout, renamed and fused into PyTorch's.

    The layout comes from config.attention_keys or is detected; PyTorch's own names pass
    through. Such layouts say themselves whether they carry biases, so `bias` follows them.
    """
    key_map = config.get("attention_keys")
    keys = layouts.parse_key_map(key_map) if key_map is not None else layouts.detect(state)
    if keys is None:
        return state, config
    fields = ("embed_dim", "num_heads", "num_kv_heads", "kdim", "vdim")
    dims = layouts.Dims(**{name: config[name] for name in fields})
    state, has_bias = layouts.to_pytorch_names(state, keys, dims)
    return state, dict(config, bias=has_bias, attention_layout=keys.describe())


def model_from_state_dict(
    config: dict,
    state: dict[str, Tensor],
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> EngineModel:
    """Validate config and state dict, cast weights once, and build the fused model."""
    config = normalise_config(config)
    bare_layer = not any(k.startswith("layers.") for k in state)
    if config["architecture"] == "transformer_encoder" and config["num_layers"] == 1 and bare_layer:
        state = {f"layers.0.{k}": v for k, v in state.items()}
    if config["architecture"] == "multihead_attention":
        state, config = attention_to_pytorch_names(state, config)
    validate_state_dict(state, config)
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    weights = {k: v.detach().to(device=device, dtype=dtype) for k, v in state.items()}
    if config["architecture"] == "multihead_attention":
        return MultiheadAttentionModel(FusedAttention(weights, config), config, device, dtype)
    return TransformerEncoderModel(EncoderStack(weights, config), config, device, dtype)


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
) -> EngineModel:
    """Load a model directory (config.json + weights) into a fused EngineModel."""
    directory = Path(path)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} not found")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    if hf_bert.is_hf_config(config):
        return text_model_from_directory(directory, config, device, dtype)
    config = normalise_config(config)  # fail on config errors before reading weights
    return model_from_state_dict(config, _read_weights(directory), device, dtype)


def text_model_from_directory(
    directory: Path,
    hf_config: dict,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> TextEncoderModel:
    """A Hugging Face BERT-family directory as a TextEncoderModel (encoder + embeddings)."""
    config = hf_bert.engine_config(hf_config)  # fail on config errors before reading weights
    settings = read_text_settings(directory)
    encoder_state, embedding_state = hf_bert.engine_state(_read_weights(directory), config)
    validate_state_dict(encoder_state, normalise_config(config))
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    weights = {k: v.detach().to(device=device, dtype=dtype) for k, v in encoder_state.items()}
    # Embedding tables stay float32 for the lookup and LayerNorm, then cast once: a bf16 model
    # then gets the same first-layer input as an fp32 one, rounded once.
    emb = {k: v.detach().to(device=device, dtype=torch.float32) for k, v in embedding_state.items()}
    embeddings = TextEmbeddings(
        word=emb["word"],
        position=emb["position"],
        norm_weight=emb["norm_weight"],
        norm_bias=emb["norm_bias"],
        eps=config["layer_norm_eps"],
        token_type=emb.get("token_type"),
        position_offset=config["position_offset"],
        pad_token_id=config["pad_token_id"],
        positions_from_padding=config["model_type"] in ("roberta", "xlm-roberta"),
    )
    stack = EncoderStack(weights, config)
    return TextEncoderModel(stack, embeddings, config, settings, device, dtype)


def module_config(module: nn.Module) -> dict:
    """config.json contents for an nn.MultiheadAttention, TransformerEncoderLayer or Encoder."""
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
    if isinstance(module, nn.TransformerEncoder):
        layers = [module_config(layer) for layer in module.layers]
        if any(c != layers[0] for c in layers):
            raise ValueError("all layers of the TransformerEncoder must share one config")
        config = dict(layers[0], num_layers=len(layers), final_norm=module.norm is not None)
        norm = module.norm
        if norm is not None and (
            not isinstance(norm, nn.LayerNorm)
            or norm.eps != config["layer_norm_eps"]
            or (norm.bias is not None) != config["bias"]
        ):
            raise ValueError("final norm must be a LayerNorm with the layers' eps and bias")
        return config
    if isinstance(module, nn.TransformerEncoderLayer):
        act = getattr(module, "activation_relu_or_gelu", 0)
        approximate = getattr(module.activation, "approximate", "none")
        if act not in (1, 2) or approximate != "none":
            raise ValueError("only relu and exact gelu activations can be exported")
        if module.norm1.eps != module.norm2.eps:
            raise ValueError("norm1.eps and norm2.eps differ; config has one layer_norm_eps")
        return {
            "architecture": "transformer_encoder",
            "d_model": module.self_attn.embed_dim,
            "nhead": module.self_attn.num_heads,
            "dim_feedforward": module.linear1.out_features,
            "activation": "relu" if act == 1 else "gelu",
            "layer_norm_eps": module.norm1.eps,
            "norm_first": bool(module.norm_first),
            "bias": module.linear1.bias is not None,
            "num_layers": 1,
            "final_norm": False,
        }
    raise TypeError(f"cannot export {type(module).__name__}")


def module_state(module: nn.Module) -> dict[str, Tensor]:
    """The module's state dict in engine layout (a lone encoder layer gets `layers.0.`)."""
    prefix = "layers.0." if isinstance(module, nn.TransformerEncoderLayer) else ""
    return {
        f"{prefix}{k}": v.detach().cpu().contiguous().clone()
        for k, v in module.state_dict().items()
    }


def save_model(module: nn.Module, path: str | Path) -> None:
    """Write config.json + model.safetensors so load_model gives back the same function."""
    from safetensors.torch import save_file

    config, state = module_config(module), module_state(module)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
