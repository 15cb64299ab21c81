"""sentence-transformers' files around a text model's weights: modules.json and what its modules
configure (pooling, Dense layers after it, normalisation, SPLADE), the max length; read at load
(`read_text_settings`) and written by save_model (`write_text_settings`). Modules the engine
does not run are refused: skipping one would give other vectors.

Both spellings of the files are read: releases up to 5.3 (`sentence_transformers.models.Pooling`,
`pooling_mode_mean_tokens: true`, `max_seq_length` in sentence_bert_config.json) and 5.4 on
(`sentence_transformers.sentence_transformer.modules.pooling.Pooling`, `pooling_mode: "mean"`,
the max length as the tokenizer's `model_max_length`). save_model writes the first, which every
release and TEI read.
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
DENSE_KEYS = {"in_features", "out_features", "bias", "activation_function", "use_residual"}
DENSE_IO_KEYS = ("module_input_name", "module_output_name")  # must be the sentence vector
# 1_Pooling/config.json's pooling_mode_<name> -> the engine's pooling mode
ST_POOLING_MODES = {"mean_tokens": "mean", "cls_token": "cls", "lasttoken": "last_token"}
# sentence-transformers 5.4+: "pooling_mode": <name>
ST_POOLING_NAMES = {"mean": "mean", "cls": "cls", "lasttoken": "last_token"}
# the class names modules.json may give (any release's module path before them)
TRANSFORMERS = ("Transformer", "MLMTransformer")
UNSET_MAX_LENGTH = 10**12  # tokenizer_config.json's model_max_length when no limit was saved


@dataclass(frozen=True)
class LogitScore:
    """sentence-transformers' LogitScore module (a CrossEncoder over a causal LM): the score is
    the logit of `true_token_id` minus that of `false_token_id` (or the first alone)."""

    true_token_id: int
    false_token_id: int | None = None


@dataclass(frozen=True)
class TextSettings:
    """How token states become a sentence vector, and the longest input (in tokens)."""

    pooling: str = "mean"
    normalize: bool = False
    max_seq_len: int | None = None  # None: as many as the position table holds
    sparse: bool = False  # SPLADE (MLM head, max of log(1 + relu)): mha_engine.sparse
    dense: tuple[DenseConfig, ...] = ()  # Dense modules after pooling, in order
    dense_dirs: tuple[Path, ...] = ()  # where each Dense module's weights are
    logit_score: LogitScore | None = None  # a reranker scored by two LM-head logits


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc


def read_text_settings(directory: Path, dense_path: str | None = None) -> TextSettings:
    """Pooling, Dense modules, normalisation and max length from sentence-transformers files,
    if present. dense_path: a folder of the directory holding the Dense module to run instead of
    the one modules.json lists (TEI's --dense-path: stella's 2_Dense_<dims> alternatives).

    A plain Hugging Face directory gets sentence-transformers' defaults for a bare model:
    mean pooling, no normalisation. Modules the engine does not run (WordWeights, LayerNorm,
    ...) are refused, since skipping them would give different vectors.
    """
    pooling, norm, sparse, logit_score = "mean", False, False, None
    modules_path = directory / "modules.json"
    pooling_dir = None
    dense: list[tuple[DenseConfig, Path]] = []
    if modules_path.is_file():
        modules = _json(modules_path)
        if not isinstance(modules, list):
            raise CheckpointError(f"{modules_path} must hold a list of modules")
        for module in modules:
            kind = module_class(module.get("type") if isinstance(module, dict) else None)
            if kind == "Pooling":
                pooling_dir = _module_dir(directory, module)
            elif kind == "Dense":
                if pooling_dir is None or norm:
                    raise CheckpointError(
                        f"{modules_path} lists a Dense module before Pooling or after "
                        "Normalize; the engine runs Dense modules between the two"
                    )
                where = _module_dir(directory, module)
                dense.append((_dense_config(where), where))
            elif kind == "Normalize":
                norm = True
            elif kind == "SpladePooling":
                sparse = True
                _check_splade(_module_dir(directory, module))
            elif kind == "LogitScore":
                logit_score = _logit_score(_module_dir(directory, module) / "config.json")
            elif kind not in TRANSFORMERS:
                raise CheckpointError(
                    f"{modules_path} lists module {module.get('type')!r}; the engine runs only "
                    "Transformer, Pooling, Dense and Normalize, or a sparse encoder's "
                    "MLMTransformer and SpladePooling"
                )
    if pooling_dir is not None and (pooling_dir / "config.json").is_file():
        pooling = _pooling(pooling_dir / "config.json", directory)
    max_len = _max_length(directory)
    if dense and sparse:
        raise CheckpointError(f"{modules_path}: a sparse encoder takes no Dense module")
    if logit_score is not None and (dense or sparse or norm or pooling_dir is not None):
        raise CheckpointError(
            f"{modules_path}: LogitScore scores a causal LM's logits; it takes no Pooling, "
            "Dense, Normalize or SPLADE module"
        )
    if dense_path is not None:
        if len(dense) != 1:
            raise CheckpointError(
                f"dense_path {dense_path!r} replaces the one Dense module modules.json lists; "
                f"{directory} lists {len(dense)}"
            )
        parts = os.path.normpath(dense_path).split(os.sep)
        if not dense_path or os.path.isabs(dense_path) or parts[0] in (os.curdir, os.pardir):
            raise CheckpointError(
                f"dense_path {dense_path!r} must name a folder inside {directory}"
            )
        where = directory / dense_path
        if not (where / "config.json").is_file():
            raise CheckpointError(f"dense_path {dense_path!r}: no Dense module at {where}")
        dense = [(_dense_config(where), where)]
    configs, dirs = tuple(c for c, _ in dense), tuple(d for _, d in dense)
    return TextSettings(pooling, norm, max_len, sparse, configs, dirs, logit_score)


def module_class(kind: object) -> str | None:
    """The class name of a modules.json `type` of sentence-transformers' own modules, in any
    release's spelling (`sentence_transformers.models.Pooling`, v5.4's
    `sentence_transformers.sentence_transformer.modules.pooling.Pooling`, ...); None for others."""
    if not isinstance(kind, str) or not kind.startswith("sentence_transformers."):
        return None
    return kind.rsplit(".", 1)[1]


def _pooling(path: Path, directory: Path) -> str:
    """The engine's pooling mode of a Pooling module's config.json, either spelling: legacy
    `pooling_mode_<name>: true` flags or 5.4's `pooling_mode: <name>`. Prompt tokens excluded
    from pooling (`include_prompt: false`, INSTRUCTOR-style) change mean and CLS vectors, which
    the engine does not do: refused when the model has a prompt to apply, unless the pooling is
    the last token (never a prompt's)."""
    config = _json(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold an object")
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        mode = mode[0] if isinstance(mode, list) and len(mode) == 1 else mode
        pooling = ST_POOLING_NAMES.get(mode) if isinstance(mode, str) else None
        if pooling is None:
            raise CheckpointError(
                f"{path} asks for pooling_mode {mode!r}; supported: one of {list(ST_POOLING_NAMES)}"
            )
    else:
        modes = [
            k.removeprefix("pooling_mode_")
            for k, v in config.items()
            if k.startswith("pooling_mode_") and v is True
        ]
        if len(modes) != 1 or modes[0] not in ST_POOLING_MODES:
            raise CheckpointError(
                f"{path} asks for pooling {modes}; supported: exactly one of "
                f"{list(ST_POOLING_MODES)}"
            )
        pooling = ST_POOLING_MODES[modes[0]]
    prompts = _prompts(directory)
    if config.get("include_prompt", True) is not True and pooling != "last_token" and prompts:
        raise CheckpointError(
            f"{path} excludes prompt tokens from {pooling} pooling (include_prompt false) and "
            f"the model has prompts {prompts}; the engine pools every token"
        )
    return pooling


def _prompts(directory: Path) -> list[str]:
    """The names of the non-empty prompts in config_sentence_transformers.json."""
    path = directory / "config_sentence_transformers.json"
    config = _json(path) if path.is_file() else None
    prompts = config.get("prompts") if isinstance(config, dict) else None
    return sorted(k for k, v in prompts.items() if v) if isinstance(prompts, dict) else []


def _max_length(directory: Path) -> int | None:
    """The longest input sentence-transformers gives the model: sentence_bert_config.json's
    max_seq_length (up to 5.3), else the tokenizer's model_max_length (where 5.4 on keep it,
    and older releases read it when the first is absent); None: the position table's length."""
    for name, key in (
        ("sentence_bert_config.json", "max_seq_length"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        path = directory / name
        value = _json(path) if path.is_file() else None
        length = value.get(key) if isinstance(value, dict) else None
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            return length if length < UNSET_MAX_LENGTH else None
    return None


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
    if config.get("use_residual", False) is not False:
        raise CheckpointError(f"{path} adds a residual (use_residual); the engine does not")
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


def _logit_score(path: Path) -> LogitScore:
    """A LogitScore module's config.json: its token ids, read from the LM head's logits."""
    config = _json(path) if path.is_file() else None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a LogitScore module's config (an object)")
    unknown = sorted(set(config) - {"true_token_id", "false_token_id", "module_input_name"})
    if unknown:
        raise CheckpointError(f"{path} has fields the engine does not run: {unknown}")
    if config.get("module_input_name", "causal_logits") != "causal_logits":
        raise CheckpointError(f"{path}: LogitScore must read the causal LM's logits")
    true, false = config.get("true_token_id"), config.get("false_token_id")
    for name, value in (("true_token_id", true), ("false_token_id", false)):
        if value is None and name == "false_token_id":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{path}: {name} must be a token id, got {value!r}")
    return LogitScore(true, false)


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
