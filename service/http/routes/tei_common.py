"""What text-embeddings-inference's routes share: the served model a route uses, and
texts (or pairs) -> bounded, tokenized, truncated-or-413 token ids, inside the deadline."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from service.http.body import read_object
from service.http.deps import traced
from service.http.routes.common import observed
from service.pipeline.errors import (
    BadInput,
    PayloadTooLarge,
    ServiceError,
    WrongModelKind,
)
from service.pipeline.waiting import Gone
from service.text.tokenizer import Encoded, Text, model_kind
from service.text.work import check_chars, tokenize

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry, ServiceState

M = TypeVar("M", bound=BaseModel)

Direction = Literal["Right", "Left"]  # TEI's truncation_direction values
ROUTES_OF = {  # which routes each kind of model offers
    "embedding": "/embed, /embed_all, /similarity, /v1/embeddings",
    "classifier": "/predict",
    "reranker": "/rerank, /predict",
    "sparse": "/embed_sparse",
}


def _a(kind: str) -> str:
    return f"a{'n' if kind[0] in 'aeiou' else ''} {kind}"


def routed_model(request: Request) -> str | None:
    """The model a per-model mount names (/models/{model_name}/...), or None on the root
    routes."""
    return request.path_params.get("model_name")


def _offers(entry: ModelEntry) -> str:
    kind = model_kind(entry.model)
    return f"'{entry.name}' is {_a(kind)} model, which offers {ROUTES_OF[kind]}"


def text_entry(
    state: ServiceState, route: str, *kinds: str, model: str | None = None
) -> ModelEntry:
    """The served model a TEI route uses: `model` when the path names one (404 if not served),
    else (TEI's requests name none) the first served text model whose kind is one of `kinds`, or
    with no kinds the default model (the first text model when the default has no tokenizer).
    400 when the model (or every model) has no tokenizer; 424 (TEI's status) naming each
    candidate's kind and the routes it offers when none fits."""
    if model is not None:
        entry = state.find(model)
        if entry.tokenizer is None:
            raise BadInput(
                f"model '{model}' has no tokenizer.json: the text routes need a text model "
                "directory; use /v2 for tensors"
            )
        if kinds and model_kind(entry.model) not in kinds:
            raise WrongModelKind(
                f"{route} needs {' or '.join(_a(k) for k in kinds)} model; {_offers(entry)}"
            )
        return entry
    texts = [entry for entry in state.models.values() if entry.tokenizer is not None]
    if not texts:
        raise BadInput(
            f"model '{state.model_name}' has no tokenizer.json: the text routes need a text "
            "model directory; use /v2 for tensors"
        )
    if not kinds:
        return state.default if state.default.tokenizer is not None else texts[0]
    for entry in texts:
        if model_kind(entry.model) in kinds:
            return entry
    served = "; ".join(_offers(e) for e in texts)
    raise WrongModelKind(f"{route} needs {' or '.join(_a(k) for k in kinds)} model; {served}")


@contextmanager
def text_route(
    request: Request, state: ServiceState, endpoint: str, route: str, *kinds: str
) -> Iterator[ModelEntry]:
    """text_entry() (for the model the path names, if any) inside the request metrics: counted
    under the chosen model's labels (a request no model can serve is counted under the default
    model's); traced when tracing picks it, but for /tokenize and /decode (no inference)."""
    try:
        entry = text_entry(state, route, *kinds, model=routed_model(request))
    except ServiceError:
        with observed(state, endpoint):
            raise
    with (
        observed(state, endpoint, model=entry.name, version=entry.version),
        traced(state, request.scope, entry, endpoint) if kinds else nullcontext(),
    ):
        yield entry


def check_batch(state: ServiceState, count: int, field: str = "inputs") -> None:
    """At least one item, at most --max-client-batch-size (413)."""
    if count == 0:
        raise BadInput(f"'{field}' is an empty list; send at least one item")
    limit = state.settings.max_client_batch_size
    if count > limit:
        raise PayloadTooLarge(
            f"'{field}' has {count} items; at most {limit} per request "
            "(--max-client-batch-size, as TEI's)"
        )


async def encode_texts(
    gone: Gone,
    state: ServiceState,
    entry: ModelEntry,
    texts: list[Text],
    truncate: bool | None,
    direction: Direction,
    deadline: float,
    field: str = "inputs",
    prompt: str | None = None,
    doc_tokens: int | None = None,
) -> list[Encoded]:
    """Characters bounded (413), then tokenized off the loop holding queue slots (429);
    an input over the model's max length is 413 unless `truncate` (then cut at `direction`;
    None, a request that does not say: --auto-truncate decides, as in TEI). `prompt`: a
    reranker's instruction (TextTokenizer.encode), counted in every input's characters;
    `doc_tokens`: each pair's document first cut to that many tokens (Cohere's
    max_tokens_per_doc)."""
    asked = truncate is not None  # the request said; else --auto-truncate decides
    if truncate is None:
        truncate = state.settings.auto_truncate
    tokenizer = entry.tokenizer
    assert tokenizer is not None  # text_entry() chose a text model
    for i, text in enumerate(texts):
        if isinstance(text, str) and not text:
            raise BadInput(f"{field}[{i}] is an empty string; empty inputs have no result")
        if not isinstance(text, str) and not all(text):
            raise BadInput(f"{field}[{i}] holds an empty string; empty inputs have no result")
    if tokenizer.chat is not None and any(isinstance(text, str) for text in texts):
        raise BadInput(
            f"'{field}' holds a single text; this reranker formats (query, document) pairs "
            "with its chat template, so send pairs"
        )
    check_chars(texts, entry.char_limits, field, prompt)
    async with entry.batcher.reserve(len(texts)):
        encode = None  # tokenizer.encode's defaults
        if direction != "Right" or prompt or doc_tokens:
            encode = lambda part: tokenizer.encode(part, direction, prompt, doc_tokens)  # noqa: E731
        encoded = await tokenize(state, entry, gone, texts, deadline, encode)
    cut = [i for i, e in enumerate(encoded) if e.truncated]
    if cut and not truncate:
        how = (
            "or set 'truncate': true"
            if asked
            else ("or set 'truncate': true (the server runs with --no-auto-truncate)")
        )
        raise PayloadTooLarge(
            f"Input validation error: {field}[{cut[0]}] is longer than the model's "
            f"{tokenizer.max_length} tokens; send less text {how}"
        )
    return encoded  # run_parts answers 504 if tokenizing used the deadline up


def validate(model: type[M], data: Any) -> M:
    """`data` as `model`, strictly (booleans are not numbers, "yes" is no boolean); 400
    naming each problem."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in ('body', *e['loc']))}: {e['msg']}" for e in exc.errors()
        )
        raise BadInput(f"invalid request: {problems}") from None


async def parse_body(request: Request, state: ServiceState, model: type[M]) -> M:
    """A TEI route's body: read bounded (--max-body-bytes), parsed by the one JSON parser,
    validated as `model`."""
    return validate(model, await read_object(request, state.settings.max_body_bytes))


def instruction(entry: ModelEntry, given: str | None) -> str | None:
    """A cross-encoder's prompt, as sentence-transformers' CrossEncoder.predict resolves it: the
    request's instruction (an empty one: none), else the model's default prompt, if it names
    one (config_sentence_transformers.json)."""
    if given is not None:
        return given or None
    return entry.default_prompt
