"""What a text model's sentence-transformers files tell the service beyond the engine's numbers:
its prompts (config_sentence_transformers.json), whether its vectors may be cut short
(Matryoshka), and how its Transformer takes pairs (sentence_bert_config.json: a "message"
modality formats them with the chat template, chat_pairs.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha_engine import CheckpointError

log = logging.getLogger(__name__)

ST_CONFIG = "config_sentence_transformers.json"
MESSAGE_FORMATS = ("flat", "structured")  # a message's content: a string, or text blocks


def _json(path: Path) -> Any:
    """A JSON file's value, or None (logged) when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("%s is not JSON; ignoring it", path)
        return None


def matryoshka(model_dir: Path | None) -> bool:
    """Whether the model was trained so its vectors may be cut short (`dimensions`):
    sentence-transformers' config_sentence_transformers.json sets `truncate_dim`, or the model
    card's front matter (README.md) names the "matryoshka" tag or MatryoshkaLoss."""
    if model_dir is None:
        return False
    config = Path(model_dir) / ST_CONFIG
    value = _json(config) if config.is_file() else None
    if isinstance(value, dict) and value.get("truncate_dim") is not None:
        return True
    card = Path(model_dir) / "README.md"
    if not card.is_file():
        return False
    parts = card.read_text(errors="replace").split("---", 2)
    front = parts[1].lower() if len(parts) == 3 and not parts[0].strip() else ""
    return "matryoshka" in front


def read_prompts(model_dir: Path | None) -> tuple[dict[str, str], str | None]:
    """sentence-transformers' prompts ({name: text prepended to inputs}) and default prompt
    name from config_sentence_transformers.json; ({}, None) when it has none."""
    path = None if model_dir is None else Path(model_dir) / ST_CONFIG
    config = _json(path) if path is not None and path.is_file() else None
    prompts = config.get("prompts") if isinstance(config, dict) else None
    if not isinstance(prompts, dict):
        return {}, None
    prompts = {str(k): v for k, v in prompts.items() if isinstance(v, str)}
    default = config.get("default_prompt_name")
    return prompts, default if default in prompts else None


@dataclass(frozen=True)
class MessageModality:
    """sentence-transformers 5.4+ formats this model's inputs as chat messages."""

    structured: bool  # content as [{"type": "text", "text": ...}] rather than a string


def message_modality(model_dir: Path) -> MessageModality | None:
    """The Transformer module's "message" modality (sentence_bert_config.json), if it has one;
    CheckpointError for settings the service does not apply (an unnamed or unknown content
    format, processing kwargs that would change the render or the cut)."""
    path = model_dir / "sentence_bert_config.json"
    config = _json(path) if path.is_file() else None
    modalities = config.get("modality_config") if isinstance(config, dict) else None
    message = modalities.get("message") if isinstance(modalities, dict) else None
    if not isinstance(message, dict):
        return None
    form = message.get("format")
    if form not in MESSAGE_FORMATS:
        raise CheckpointError(
            f"{path}: the message modality's format {form!r} is not one of {MESSAGE_FORMATS}"
        )
    kwargs = config.get("processing_kwargs") or {}
    applied = {"chat_template": {"restore_suffix": True}}  # sentence-transformers' default
    if any(v and (k not in applied or v != applied[k]) for k, v in kwargs.items()):
        raise CheckpointError(
            f"{path} sets processing_kwargs {kwargs!r}; the service renders chat messages with "
            "sentence-transformers' defaults only"
        )
    return MessageModality(form == "structured")
