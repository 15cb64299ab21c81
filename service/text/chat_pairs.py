"""Query/document pairs through the model's chat template, as sentence-transformers (5.4 on)
formats them for rerankers that read a prompt, such as Qwen3-Reranker.

A reranker whose Transformer module has a "message" modality (st_config.message_modality) takes a
pair as messages: an optional `system` message (the instruction: sentence-transformers' prompt),
then `query` and `document`. Its chat template (chat_template.jinja, or tokenizer_config.json's
`chat_template`) renders them in a sandboxed Jinja environment set up as transformers sets it
(its globals and filters, `tools` and `documents` None); the text is tokenized without added
special tokens. An input past the max length is cut at its end and, as sentence-transformers
does, the template's closing tokens are written back over its last tokens, since the model
reads its score at the last token (the `document` is what loses text). Text that spells a
control token (`<|im_end|>`) is read as that token, as sentence-transformers and the model's
reference code read it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from mha_engine import CheckpointError
from service.pipeline.errors import BadInput
from service.text.st_config import MessageModality, message_modality

log = logging.getLogger(__name__)

TEMPLATE_FILE = "chat_template.jinja"
FILLERS = ("0", "1 2 3 4")  # two contents that tokenize differently: their renders share the tail
TAILS_KEPT = 64  # closing-token runs cached, one per instruction (keyed by its hash)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")  # fmt: skip


def _template(model_dir: Path) -> tuple[str, dict[str, str]]:
    """The chat template's source and the special tokens it may name (bos_token, ...)."""
    config_path = model_dir / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_path} is not readable JSON: {exc}") from None
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
            f"{model_dir}: sentence_bert_config.json formats inputs as chat messages, but there "
            f"is no chat template ({TEMPLATE_FILE}, or tokenizer_config.json's chat_template)"
        )
    return source, specials


class _TemplateDict:
    """`dict` inside templates, without the attribute access that could reach Python's
    internals (transformers gives templates the same)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    """The template compiled in jinja2's immutable sandbox with the options, filters and
    globals transformers gives chat templates."""
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

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace(), refusing names that start with an underscore."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} refused")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=_TemplateDict(),
        namespace=Namespace,
    )
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise CheckpointError(f"the model's chat template does not compile: {exc}") from None


class ChatPairs:
    """Renders and tokenizes (query, document) pairs; `tokenizer` is a tokenizers.Tokenizer
    without truncation or padding (the cut is made here, then the tail restored)."""

    def __init__(
        self,
        source: str,
        specials: dict[str, str],
        modality: MessageModality,
        tokenizer: Any,
        max_length: int,
    ) -> None:
        self.template = _compiled(source)
        self.specials = specials
        self.structured = modality.structured
        self.tokenizer = tokenizer
        self.max_length = max_length
        self._tails: OrderedDict[bytes, list[int]] = OrderedDict()
        self.render("query", "document", None)  # a template that fails to render fails at load

    def _content(self, text: str) -> str | list[dict[str, str]]:
        return [{"type": "text", "text": text}] if self.structured else text

    def render(self, query: str, document: str, system: str | None) -> str:
        messages = [{"role": "system", "content": self._content(system)}] if system else []
        messages += [
            {"role": "query", "content": self._content(query)},
            {"role": "document", "content": self._content(document)},
        ]
        return self.template.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=False,
            **self.specials,
        )  # fmt: skip

    def _ids(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def tail(self, system: str | None) -> list[int]:
        """The template's closing tokens: the longest token suffix two renders with different
        contents share (none if one render is all shared: no content tells them apart)."""
        key = hashlib.blake2b(repr(system).encode(), digest_size=16).digest()
        if key in self._tails:
            return self._tails[key]
        first, second = self._ids([self.render(f, f, system) for f in FILLERS])
        count = 0
        for a, b in zip(reversed(first), reversed(second), strict=False):
            if a != b:
                break
            count += 1
        tail = first[len(first) - count :] if 0 < count < min(len(first), len(second)) else []
        self._tails[key] = tail
        while len(self._tails) > TAILS_KEPT:
            self._tails.popitem(last=False)
        return tail

    def encode(
        self, pairs: list[tuple[str, str]], system: str | None, direction: str = "Right"
    ) -> list[tuple[np.ndarray, bool]]:
        """Token ids (int64) of each rendered pair and whether it was cut to max_length (from
        the right, the template's tail then restored, or from the left); BadInput when the
        template refuses the messages (raise_exception, a sandbox violation)."""
        import jinja2

        try:
            rendered = [self.render(q, d, system) for q, d in pairs]
            tail = self.tail(system)[-self.max_length :]
        except jinja2.exceptions.TemplateError as exc:
            what = "the instruction" if system else "the pair"
            raise BadInput(f"the model's chat template refuses {what}: {exc}") from None
        out = []
        for ids in self._ids(rendered):
            cut = len(ids) > self.max_length
            if direction == "Left":
                ids = ids[len(ids) - self.max_length :] if cut else ids
            elif len(ids) >= self.max_length:
                ids = ids[: self.max_length]
                ids[len(ids) - len(tail) :] = tail
            out.append((np.asarray(ids, dtype=np.int64), cut))
        return out


def load_chat_pairs(model_dir: Path, tokenizer_path: Path, max_length: int) -> ChatPairs | None:
    """The pair formatter of a reranker or classifier whose sentence-transformers files format
    its inputs as chat messages; None when they do not (pairs go through the tokenizer's own
    pair template)."""
    modality = message_modality(model_dir)
    if modality is None:
        return None
    from tokenizers import Tokenizer

    whole = Tokenizer.from_file(str(tokenizer_path))  # the rendered text is cut by ChatPairs
    whole.no_padding()
    whole.no_truncation()
    source, specials = _template(model_dir)
    try:
        chat = ChatPairs(source, specials, modality, whole, max_length)
    except CheckpointError:
        raise
    except Exception as exc:  # jinja2's errors while rendering the probe pair
        raise CheckpointError(
            f"{model_dir}: the chat template does not render a pair: {exc}"
        ) from exc
    log.info("%s: pairs are formatted with its chat template", model_dir)
    return chat
