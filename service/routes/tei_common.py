"""What text-embeddings-inference's routes share: the tokenizer, the model-kind check, and
texts (or pairs) -> bounded, tokenized, truncated-or-413 token ids, inside the deadline."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

from fastapi import Request

from service.deps import get_state
from service.errors import BadInput, DeadlineExceeded, PayloadTooLarge, WrongModelKind
from service.routes.text_work import check_chars, tokenize
from service.text import Encoded, Text, TextTokenizer, model_kind

if TYPE_CHECKING:
    from service.state import ServiceState

MAX_CLIENT_BATCH = 32  # TEI's default --max-client-batch-size
Direction = Literal["Right", "Left"]  # TEI's truncation_direction values
ROUTES_OF = {  # which routes each kind of model offers
    "embedding": "/embed, /embed_all, /similarity, /v1/embeddings",
    "classifier": "/predict",
    "reranker": "/rerank, /predict",
}


def text_tokenizer(request: Request) -> TextTokenizer:
    """The served model's tokenizer; 400 when the model is not a text model with one."""
    state = get_state(request)
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise BadInput(
            f"model '{state.model_name}' has no tokenizer.json: the text routes need a text "
            "model directory; use /v2 for tensors"
        )
    return tokenizer


def require_kind(state: ServiceState, route: str, *kinds: str) -> None:
    """424 (TEI's status) naming the model's kind and the routes it does offer."""
    kind = model_kind(state.model)
    if kind not in kinds:
        raise WrongModelKind(
            f"{route} needs {' or '.join(f'a {k}' for k in kinds)} model; '{state.model_name}' "
            f"is a{'n' if kind[0] in 'aeiou' else ''} {kind} model, which offers {ROUTES_OF[kind]}"
        )


def check_batch(count: int, field: str = "inputs") -> None:
    if count == 0:
        raise BadInput(f"'{field}' is an empty list; send at least one item")
    if count > MAX_CLIENT_BATCH:
        raise PayloadTooLarge(
            f"'{field}' has {count} items; at most {MAX_CLIENT_BATCH} per request "
            "(TEI's --max-client-batch-size)"
        )


async def encode_texts(
    request: Request,
    state: ServiceState,
    texts: list[Text],
    truncate: bool,
    direction: Direction,
    deadline: float,
    field: str = "inputs",
) -> list[Encoded]:
    """Characters bounded (413), then tokenized off the loop holding queue slots (429);
    an input over the model's max length is 413 unless `truncate` (then cut at `direction`)."""
    tokenizer = text_tokenizer(request)
    for i, text in enumerate(texts):
        if isinstance(text, str) and not text:
            raise BadInput(f"{field}[{i}] is an empty string; empty inputs have no result")
        if not isinstance(text, str) and not all(text):
            raise BadInput(f"{field}[{i}] holds an empty string; empty inputs have no result")
    check_chars(texts, get_state(request).char_limits)
    with state.batcher.reserve(len(texts)):
        encode = (lambda part: tokenizer.encode(part, direction)) if direction != "Right" else None
        encoded = await tokenize(state, request, tokenizer, texts, deadline, encode)
    cut = [i for i, e in enumerate(encoded) if e.truncated]
    if cut and not truncate:
        raise PayloadTooLarge(
            f"Input validation error: {field}[{cut[0]}] is longer than the model's "
            f"{tokenizer.max_length} tokens; send less text or set 'truncate': true"
        )
    if time.monotonic() >= deadline:
        raise DeadlineExceeded("tokenizing used up the request's deadline (--request-timeout-s)")
    return encoded
