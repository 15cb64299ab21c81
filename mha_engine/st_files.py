"""sentence-transformers' files around a text model's weights: modules.json and what its modules
configure (pooling, Dense layers after it, normalisation, SPLADE), sentence_bert_config.json's
max length; read at load (`read_text_settings`) and written by save_model
(`write_text_settings`). Modules the engine does not run are refused: skipping one would give
other vectors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

from .errors import CheckpointError
from .text_config import DenseConfig, TextEncoderConfig

ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
ST_DENSE = "sentence_transformers.models.Dense"
# a Dense module's activation_function -> the engine's name (DenseConfig.activation)
ST_DENSE_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
}
DENSE_KEYS = {"in_features", "out_features", "bias", "activation_function"}
DENSE_IO_KEYS = ("module_input_name", "module_output_name")  # must be the sentence vector
# sentence-transformers' SparseEncoder (SPLADE): the MLM transformer and its pooling
ST_MLM_TRANSFORMER = "sentence_transformers.sparse_encoder.models.MLMTransformer"
ST_SPLADE_POOLING = "sentence_transformers.sparse_encoder.models.SpladePooling"
# 1_Pooling/config.json's pooling_mode_<name> -> the engine's pooling mode
ST_POOLING_MODES = {"mean_tokens": "mean", "cls_token": "cls", "lasttoken": "last_token"}


@dataclass(frozen=True)
class TextSettings:
    """How token states become a sentence vector, and the longest input (in tokens)."""

    pooling: str = "mean"
    normalize: bool = False
    max_seq_len: int | None = None  # None: as many as the position table holds
    sparse: bool = False  # SPLADE (MLM head, max of log(1 + relu)): mha_engine.sparse
    dense: tuple[DenseConfig, ...] = ()  # Dense modules after pooling, in order
    dense_dirs: tuple[Path, ...] = ()  # where each Dense module's weights are


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc


def read_text_settings(directory: Path) -> TextSettings:
    """Pooling, Dense modules, normalisation and max length from sentence-transformers files,
    if present.

    A plain Hugging Face directory gets sentence-transformers' defaults for a bare model:
    mean pooling, no normalisation. Modules the engine does not run (WordWeights, LayerNorm,
    ...) are refused, since skipping them would give different vectors.
    """
    pooling, norm, max_len, sparse = "mean", False, None, False
    modules_path = directory / "modules.json"
    pooling_dir = None
    dense: list[tuple[DenseConfig, Path]] = []
    if modules_path.is_file():
        modules = _json(modules_path)
        if not isinstance(modules, list):
            raise CheckpointError(f"{modules_path} must hold a list of modules")
        for module in modules:
            kind = module.get("type") if isinstance(module, dict) else None
            if kind == ST_POOLING:
                pooling_dir = _module_dir(directory, module)
            elif kind == ST_DENSE:
                if pooling_dir is None or norm:
                    raise CheckpointError(
                        f"{modules_path} lists a Dense module before Pooling or after "
                        "Normalize; the engine runs Dense modules between the two"
                    )
                where = _module_dir(directory, module)
                dense.append((_dense_config(where), where))
            elif kind == ST_NORMALIZE:
                norm = True
            elif kind == ST_SPLADE_POOLING:
                sparse = True
                _check_splade(_module_dir(directory, module))
            elif kind not in (ST_TRANSFORMER, ST_MLM_TRANSFORMER):
                raise CheckpointError(
                    f"{modules_path} lists module {kind!r}; the engine runs only Transformer, "
                    "Pooling, Dense and Normalize, or a sparse encoder's MLMTransformer and "
                    "SpladePooling"
                )
    if pooling_dir is not None and (pooling_dir / "config.json").is_file():
        config = _json(pooling_dir / "config.json")
        modes = [
            k.removeprefix("pooling_mode_")
            for k, v in (config.items() if isinstance(config, dict) else [])
            if k.startswith("pooling_mode_") and v is True
        ]
        if len(modes) != 1 or modes[0] not in ST_POOLING_MODES:
            raise CheckpointError(
                f"{pooling_dir / 'config.json'} asks for pooling {modes}; supported: "
                f"exactly one of {list(ST_POOLING_MODES)}"
            )
        pooling = ST_POOLING_MODES[modes[0]]
    st_config = directory / "sentence_bert_config.json"
    if st_config.is_file():
        value = _json(st_config)
        length = value.get("max_seq_length") if isinstance(value, dict) else None
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            max_len = length
    if dense and sparse:
        raise CheckpointError(f"{modules_path}: a sparse encoder takes no Dense module")
    configs, dirs = tuple(c for c, _ in dense), tuple(d for _, d in dense)
    return TextSettings(pooling, norm, max_len, sparse, configs, dirs)


def _module_dir(directory: Path, module: dict) -> Path:
    """A module's folder (its `path` in modules.json), named inside the model's folder: a
    relative path that does not climb out (a folder there may be a symlink, as in a Hugging Face
    cache; where it points is the directory owner's choice, not the file's)."""
    path = str(module.get("path", ""))
    if os.path.isabs(path) or os.path.normpath(path).split(os.sep)[0] == os.pardir:
        raise CheckpointError(
            f"{directory / 'modules.json'} points a module outside the model directory: {path!r}"
        )
    return directory / path


def _dense_config(module_dir: Path) -> DenseConfig:
    """A Dense module's config.json: sizes, bias, an activation the engine runs."""
    path = module_dir / "config.json"
    config = _json(path) if path.is_file() else None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a Dense module's config (an object)")
    for key in DENSE_IO_KEYS:
        if config.get(key, "sentence_embedding") != "sentence_embedding":
            raise CheckpointError(
                f"{path} sets {key} {config[key]!r}; the engine runs Dense modules on the "
                "sentence vector ('sentence_embedding') only"
            )
    unknown = sorted(set(config) - DENSE_KEYS - set(DENSE_IO_KEYS))
    if unknown:
        raise CheckpointError(f"{path} has fields the engine does not run: {unknown}")
    name = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if name not in ST_DENSE_ACTIVATIONS:
        raise CheckpointError(
            f"{path} asks for activation_function {name!r}; supported: {list(ST_DENSE_ACTIVATIONS)}"
        )
    try:
        return DenseConfig(
            in_features=config.get("in_features"),
            out_features=config.get("out_features"),
            bias=config.get("bias", True),
            activation=ST_DENSE_ACTIVATIONS[name],
        )
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def _check_splade(pooling_dir: Path) -> None:
    """SpladePooling's config: the max of relu's log1p is what the engine runs."""
    path = pooling_dir / "config.json"
    config = _json(path) if path.is_file() else {}
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold an object")
    wanted = {"pooling_strategy": "max", "activation_function": "relu"}
    for key, value in wanted.items():
        if config.get(key, value) != value:
            raise CheckpointError(
                f"{path} asks for {key} {config[key]!r}; the engine runs SPLADE's {value!r}"
            )


def write_text_settings(
    directory: Path, config: TextEncoderConfig, dense_state: dict[str, Tensor] | None = None
) -> None:
    """sentence-transformers' files for the config's pooling, Dense modules (their weights from
    `dense_state`: TextEncoderModel.dense's state dict), normalisation and max length."""
    parts = [("", ST_TRANSFORMER), ("1_Pooling", ST_POOLING)]
    activations = {v: k for k, v in ST_DENSE_ACTIVATIONS.items()}
    for i, d in enumerate(config.dense):
        where = f"{len(parts)}_Dense"
        parts.append((where, ST_DENSE))
        (directory / where).mkdir(exist_ok=True)
        fields = {"in_features": d.in_features, "out_features": d.out_features, "bias": d.bias,
                  "activation_function": activations[d.activation]}  # fmt: skip
        (directory / where / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
        state = {k.removeprefix(f"{i}."): v for k, v in (dense_state or {}).items()
                 if k.startswith(f"{i}.")}  # fmt: skip
        save_file(state, str(directory / where / "model.safetensors"), metadata={"format": "pt"})
    if config.normalize:
        parts.append((f"{len(parts)}_Normalize", ST_NORMALIZE))
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": kind}
        for i, (path, kind) in enumerate(parts)
    ]
    (directory / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    pooling = {
        "word_embedding_dimension": config.d_model,
        "pooling_mode_cls_token": config.pooling == "cls",
        "pooling_mode_mean_tokens": config.pooling == "mean",
        "pooling_mode_lasttoken": config.pooling == "last_token",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    settings = {"max_seq_length": config.max_seq_len, "do_lower_case": False}
    (directory / "sentence_bert_config.json").write_text(json.dumps(settings, indent=2) + "\n")
