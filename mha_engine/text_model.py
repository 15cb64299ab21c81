"""Text encoder models: a transformer_encoder that also takes token ids and gives sentence vectors.

The hidden-state API ([B, T, D] + padding mask, forward_varlen) is TransformerEncoderModel's,
unchanged; `encode` / `encode_varlen` put the embeddings layer in front and `embed_varlen` adds
pooling and normalisation behind, as sentence-transformers configures them for the directory.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .config import TextEncoderConfig
from .devices import upload
from .errors import CheckpointError
from .models import TransformerEncoderModel
from .text import TextEmbeddings, normalize, pool_packed, pool_padded
from .varlen import cumulative, lengths

ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
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


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc


def read_text_settings(directory: Path) -> TextSettings:
    """Pooling, normalisation and max length from sentence-transformers files, if present.

    A plain Hugging Face directory gets sentence-transformers' defaults for a bare model:
    mean pooling, no normalisation. Modules the engine does not run (Dense, ...) are refused,
    since skipping them would give different vectors.
    """
    pooling, norm, max_len, sparse = "mean", False, None, False
    modules_path = directory / "modules.json"
    pooling_dir = None
    if modules_path.is_file():
        modules = _json(modules_path)
        if not isinstance(modules, list):
            raise CheckpointError(f"{modules_path} must hold a list of modules")
        for module in modules:
            kind = module.get("type") if isinstance(module, dict) else None
            if kind == ST_POOLING:
                pooling_dir = directory / str(module.get("path", ""))
            elif kind == ST_NORMALIZE:
                norm = True
            elif kind == ST_SPLADE_POOLING:
                sparse = True
                _check_splade(directory / str(module.get("path", "")))
            elif kind not in (ST_TRANSFORMER, ST_MLM_TRANSFORMER):
                raise CheckpointError(
                    f"{modules_path} lists module {kind!r}; the engine runs only Transformer, "
                    "Pooling and Normalize, or a sparse encoder's MLMTransformer and "
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
    return TextSettings(pooling, norm, max_len, sparse)


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


def write_text_settings(directory: Path, config: TextEncoderConfig) -> None:
    """sentence-transformers' files for the config's pooling, normalisation and max length."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": ST_TRANSFORMER},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST_POOLING},
    ]
    if config.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST_NORMALIZE})
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


class TextEncoderModel(TransformerEncoderModel):
    """A BERT-family encoder: transformer_encoder tensor API plus token ids in, vectors out.

    Submodules: `embeddings` (`embeddings_class`: TextEmbeddings, float32) and `encoder`
    (`stack_class`: EncoderStack); ModernBertModel swaps in its own two.
    """

    embeddings_class: type[nn.Module] = TextEmbeddings  # ModernBERT's for its models

    def __init__(self, config: TextEncoderConfig) -> None:
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)

    model_type = property(lambda self: self.config.model_type)
    max_seq_len = property(lambda self: self.config.max_seq_len)
    pooling = property(lambda self: self.config.pooling)
    normalize = property(lambda self: self.config.normalize)
    vocab_size = property(lambda self: self.config.vocab_size)

    def _check_ids(self, ids: Tensor, what: str) -> Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{what} must be int64 or int32, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"{what} holds ids outside [0, {self.vocab_size})")
        return _to_model(ids, self.device)

    def _check_types(self, types: Tensor, ids: Tensor) -> Tensor:
        table = self.config.type_vocab_size
        if types.shape != ids.shape:
            raise ValueError(f"token_type_ids {tuple(types.shape)} != ids {tuple(ids.shape)}")
        if table and types.numel() and (int(types.min()) < 0 or int(types.max()) >= table):
            raise ValueError(f"token_type_ids hold types outside [0, {table})")
        return _to_model(types, self.device)

    @torch.inference_mode()
    def encode(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Last hidden state (B, T, D) of a padded (B, T) batch, like Hugging Face's BertModel.

        attention_mask is 1 for real tokens, 0 for padding (padded rows are computed too).
        """
        ids = self._check_ids(input_ids, "input_ids")  # (B, T)
        if ids.shape[-1] > self.max_seq_len:
            raise ValueError(f"sequence length {ids.shape[-1]} > max_seq_len {self.max_seq_len}")
        types = None if token_type_ids is None else token_type_ids.to(self.device).long()
        positions = self.embeddings.padded_positions(ids)  # (B, T)
        x = self.embeddings(ids, positions, types).to(self.dtype)  # (B, T, D)
        kpm = None if attention_mask is None else attention_mask.to(self.device) == 0  # (B, T)
        return self._run(x, None, kpm, False, keep_weights=False)[0]

    @torch.inference_mode()
    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """The embeddings layer's output (B, T, D) for unpadded (B, T) ids (token type 0): the
        hidden states that `__call__`, `attention_weights` and the tensor API take."""
        ids = self._check_ids(input_ids, "input_ids")  # (B, T)
        if ids.shape[-1] > self.max_seq_len:
            raise ValueError(f"sequence length {ids.shape[-1]} > max_seq_len {self.max_seq_len}")
        positions = self.embeddings.padded_positions(ids)  # (B, T)
        return self.embeddings(ids, positions).to(self.dtype)  # (B, T, D)

    @torch.inference_mode()
    def encode_packed(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        bucket_padding: float = 0.0,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Token states (N, D) of packed unpadded id sequences (N,) split at cu_seqlens (B+1,);
        token_type_ids (N,) mark a pair's second segment (None: all 0)."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be packed (tokens,), got {tuple(input_ids.shape)}")
        lens = lengths(cu_seqlens, input_ids.shape[0])
        if not lens or min(lens) < 1:
            raise ValueError("every sequence needs at least one token")
        if max(lens) > self.max_seq_len:
            raise ValueError(f"sequence length {max(lens)} > max_seq_len {self.max_seq_len}")
        ids = self._check_ids(input_ids, "input_ids")  # (N,)
        types = None if token_type_ids is None else self._check_types(token_type_ids, ids)
        x = self.embeddings.forward_packed(ids, lens, types).to(self.dtype)  # (N, D)
        return self._encode(x, lens, None, False, bucket_padding)  # (N, D)

    @torch.inference_mode()
    def embed_packed(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        pooling: str | None = None,
        normalize: bool | None = None,
    ) -> Tensor:
        """Sentence vectors (B, D) in float32: encode, pool, normalise (defaults: the model's)."""
        out = self.encode_packed(input_ids, cu_seqlens)  # (N, D)
        pooled = pool_packed(out, lengths(cu_seqlens, out.shape[0]), pooling or self.pooling)
        return _normalize_if(pooled, self.normalize if normalize is None else normalize)

    def encode_varlen(self, input_ids: list[Tensor]) -> list[Tensor]:
        """Token states (T_i, D) of unpadded id sequences (T_i,): a thin encode_packed wrapper."""
        lens = [int(t.shape[0]) for t in input_ids]
        return list(self.encode_packed(_cat_ids(input_ids), cumulative(lens)).split(lens))

    def embed_varlen(
        self, input_ids: list[Tensor], pooling: str | None = None, normalize: bool | None = None
    ) -> Tensor:
        """Sentence vectors (B, D) of unpadded id sequences: a thin embed_packed wrapper."""
        lens = [int(t.shape[0]) for t in input_ids]
        return self.embed_packed(_cat_ids(input_ids), cumulative(lens), pooling, normalize)

    @torch.inference_mode()
    def embed(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Sentence vectors (B, D) in float32 from a padded batch (padded positions excluded)."""
        hidden = self.encode(input_ids, attention_mask)  # (B, T, D)
        return _normalize_if(pool_padded(hidden, attention_mask, self.pooling), self.normalize)


def _cat_ids(input_ids: list[Tensor]) -> Tensor:
    if not input_ids:
        raise ValueError("every sequence needs at least one token")
    return torch.cat(input_ids)


def _normalize_if(x: Tensor, flag: bool) -> Tensor:
    return normalize(x) if flag else x


def _to_model(ids: Tensor, device: torch.device) -> Tensor:
    """Checked ids as int64 on the model's device; host ids go up without blocking."""
    ids = ids.to(torch.long)
    return upload(ids, device) if ids.device.type == "cpu" else ids.to(device)
