"""Query/document pairs through the model's chat template, as sentence-transformers (5.4 on)
formats them for rerankers that read a prompt, such as Qwen3-Reranker.

A model whose sentence_bert_config.json gives its Transformer a "message" modality takes a pair as
messages: an optional `system` message (the instruction, sentence-transformers' prompt), then
`query` and `document`. Its chat template (chat_template.jinja, or tokenizer_config.json's
`chat_template`) renders them, in a sandboxed Jinja environment set up as transformers sets it;
the text is tokenized without added special tokens. An input past the max length is cut at its
end and, as sentence-transformers does, the template's closing tokens are written back over its
last tokens, since the model reads its score at the last token (the `document` is what loses
text). Text that spells a control token (`<|im_end|>`) is read as that token, as both
sentence-transformers and the model's reference code read it.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from mha_engine import CheckpointError

log = logging.getLogger(__name__)

TEMPLATE_FILE = "chat_template.jinja"
FILLERS = ("0", "1 2 3 4")  # two contents that tokenize differently: their renders share the tail
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")  # fmt: skip


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from None


def takes_messages(model_dir: Path) -> bool:
    """sentence-transformers formats this model's pairs as messages: its Transformer module
    (sentence_bert_config.json) lists a "message" modality."""
    path = model_dir / "sentence_bert_config.json"
    config = _json(path) if path.is_file() else None
    modalities = config.get("modality_config") if isinstance(config, dict) else None
    return isinstance(modalities, dict) and "message" in modalities


def _template(model_dir: Path) -> tuple[str, dict[str, str]]:
    """The chat template's source and the special tokens it may name (bos_token, ...)."""
    config_path = model_dir / "tokenizer_config.json"
    config = _json(config_path) if config_path.is_file() else {}
    config = config if isinstance(config, dict) else {}
    specials = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[key] = value
    if (model_dir / TEMPLATE_FILE).is_file():
        return (model_dir / TEMPLATE_FILE).read_text(), specials
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise CheckpointError(
            f"{model_dir}: sentence_bert_config.json formats pairs as chat messages, but there is "
            f"no chat template ({TEMPLATE_FILE}, or tokenizer_config.json's chat_template)"
        )
    return source, specials


@lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    """The template compiled in a sandbox (no attribute writes, no unsafe calls), with the
    options and helpers transformers gives chat templates."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise CheckpointError(
            "this reranker formats its pairs with a chat template, which needs the jinja2 "
            "package: pip install 'mha-serve[embeddings]'"
        ) from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise CheckpointError(f"the model's chat template does not compile: {exc}") from None


class ChatPairs:
    """Renders and tokenizes (query, document) pairs; `tokenizer` is a tokenizers.Tokenizer
    without truncation or padding (the cut is made here, then the tail restored)."""

    def __init__(self, source: str, specials: dict[str, str], tokenizer: Any, max_length: int):
        self.template = _compiled(source)
        self.specials = specials
        self.tokenizer = tokenizer
        self.max_length = max_length
        self._tails: dict[str | None, list[int]] = {}
        self.render("query", "document", None)  # a template that fails to render fails at load

    def render(self, query: str, document: str, system: str | None) -> str:
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "query", "content": query}, {"role": "document", "content": document}]
        return self.template.render(messages=messages, add_generation_prompt=False, **self.specials)

    def _ids(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def tail(self, system: str | None) -> list[int]:
        """The template's closing tokens: the longest token suffix two renders with different
        contents share (empty if they share all of one: no content to tell them apart)."""
        if system not in self._tails:
            first, second = self._ids([self.render(f, f, system) for f in FILLERS])
            count = 0
            for a, b in zip(reversed(first), reversed(second), strict=False):
                if a != b:
                    break
                count += 1
            tail = first[len(first) - count :] if 0 < count < min(len(first), len(second)) else []
            if len(self._tails) < 64:  # one per instruction seen; bounded
                self._tails[system] = tail
            return tail
        return self._tails[system]

    def encode(
        self, pairs: list[tuple[str, str]], system: str | None, direction: str = "Right"
    ) -> list[tuple[np.ndarray, bool]]:
        """Token ids (int64) of each rendered pair and whether it was cut to max_length (from
        the right, the template's tail then restored, or from the left)."""
        out = []
        for ids in self._ids([self.render(q, d, system) for q, d in pairs]):
            cut = len(ids) > self.max_length
            if direction == "Left":
                ids = ids[len(ids) - self.max_length :] if cut else ids
            elif len(ids) >= self.max_length:
                ids = ids[: self.max_length]
                tail = self.tail(system)[-self.max_length :]
                ids[len(ids) - len(tail) :] = tail
            out.append((np.asarray(ids, dtype=np.int64), cut))
        return out


def load_chat_pairs(model_dir: Path, tokenizer: Any, max_length: int) -> ChatPairs | None:
    """The model's pair formatter when sentence-transformers formats its pairs as messages;
    None for every other model (pairs go through the tokenizer's own pair template)."""
    if not takes_messages(model_dir):
        return None
    source, specials = _template(model_dir)
    try:
        chat = ChatPairs(source, specials, tokenizer, max_length)
    except CheckpointError:
        raise
    except Exception as exc:  # jinja2's errors while rendering the probe pair
        raise CheckpointError(
            f"{model_dir}: the chat template does not render a pair: {exc}"
        ) from exc
    log.info("%s: pairs are formatted with its chat template", model_dir)
    return chat
