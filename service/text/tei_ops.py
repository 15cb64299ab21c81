"""What text-embeddings-inference's calls share, over HTTP (service/http/routes/tei*.py) and gRPC
(service/grpc/tei_servicer.py): the served model a call uses, bounded and tokenized texts
(truncated or 413), prompts, and the answers' arithmetic (normalizing, ranking, label scores).
Nothing here knows the transport: errors are ServiceErrors with HTTP statuses (413 over a
limit, 424 for a call the model's kind does not answer), which gRPC maps to its own codes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from service.pipeline.errors import BadInput, PayloadTooLarge, WrongModelKind
from service.pipeline.waiting import Gone
from service.text.kinds import model_kind, scores
from service.text.kinds import offers as offers_kind
from service.text.tokenizer import Encoded, Text
from service.text.work import check_chars, tokenize, with_default_prompt

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry, ServiceState

Direction = Literal["Right", "Left"]  # TEI's truncation_direction values
ROUTES_OF = {  # which routes each kind of model offers
    "embedding": "/embed, /embed_all, /similarity, /v1/embeddings",
    "classifier": "/predict",
    "reranker": "/rerank, /predict",
    "sparse": "/embed_sparse",
}


def _a(kind: str) -> str:
    return f"a{'n' if kind[0] in 'aeiou' else ''} {kind}"


def _offers(entry: ModelEntry, offers: dict[str, str]) -> str:
    kind = model_kind(entry.model)
    lexical = kind != "sparse" and offers_kind(entry.model, "sparse")  # BGE-M3
    extra = f" and {offers['sparse']}" if lexical else ""
    return f"'{entry.name}' is {_a(kind)} model, which offers {offers[kind]}{extra}"


def text_entry(
    state: ServiceState,
    route: str,
    *kinds: str,
    model: str | None = None,
    offers: dict[str, str] = ROUTES_OF,
) -> ModelEntry:
    """The served model a TEI call uses: `model` when the call names one (a mount's path, gRPC's
    `model` metadata; 404 if not served),
    else (TEI's requests name none) the first served text model whose kind is one of `kinds`, or
    with no kinds the default model (the first text model when the default has no tokenizer).
    400 when the model (or every model) has no tokenizer; 424 (TEI's status) naming each
    candidate's kind and the routes it offers (`offers`: per kind) when none fits. (The
    statuses are HTTP's; gRPC maps them: service.grpc.status.)"""
    if model is not None:
        entry = state.find(model)
        if entry.tokenizer is None:
            raise BadInput(
                f"model '{model}' has no tokenizer.json: the text routes need a text model "
                "directory; use /v2 for tensors"
            )
        if kinds and not any(offers_kind(entry.model, k) for k in kinds):
            raise WrongModelKind(
                f"{route} needs {' or '.join(_a(k) for k in kinds)} model; {_offers(entry, offers)}"
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
        if any(offers_kind(entry.model, k) for k in kinds):
            return entry
    served = "; ".join(_offers(e, offers) for e in texts)
    raise WrongModelKind(f"{route} needs {' or '.join(_a(k) for k in kinds)} model; {served}")


def check_present(texts: list[Text], field: str = "inputs") -> None:
    """400 for an empty text (or a pair holding one): it has no result."""
    for i, text in enumerate(texts):
        if isinstance(text, str) and not text:
            raise BadInput(f"{field}[{i}] is an empty string; empty inputs have no result")
        if not isinstance(text, str) and not all(text):
            raise BadInput(f"{field}[{i}] holds an empty string; empty inputs have no result")


def check_decode(entry: ModelEntry, ids: list[list[int]], field: str = "ids") -> None:
    """400 unless each sequence holds 1 to the model's max length ids of its vocabulary."""
    tokenizer = entry.tokenizer
    assert tokenizer is not None  # text_entry() chose a text model
    vocab = entry.model.vocab_size
    for i, seq in enumerate(ids):
        if not seq or len(seq) > tokenizer.max_length or any(not 0 <= t < vocab for t in seq):
            raise BadInput(
                f"{field}[{i}] must hold 1 to {tokenizer.max_length} ids in [0, {vocab})"
            )


def info_fields(state: ServiceState, entry: ModelEntry) -> dict[str, Any]:
    """TEI's /info facts of a text model (but its model_type, whose form HTTP and gRPC differ
    in): the batch limits are the model's own (mha-serve.json, a load's config), not the
    server's flags."""
    from service import __version__

    tokenizer = entry.tokenizer
    assert tokenizer is not None  # text_entry chose a text model
    return {
        "model_id": entry.name,
        "model_dtype": str(entry.model.dtype).removeprefix("torch."),
        "max_input_length": tokenizer.max_length,
        "max_batch_tokens": entry.limits.max_tokens,
        "max_batch_requests": entry.batcher.max_batch_size,
        "max_client_batch_size": state.settings.max_client_batch_size,
        "auto_truncate": state.settings.auto_truncate,
        "max_concurrent_requests": entry.batcher.max_queue,
        "prompts": entry.prompts,
        "version": __version__,
    }


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
    check_present(texts, field)
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


def instruction(entry: ModelEntry, given: str | None) -> str | None:
    """A cross-encoder's prompt, as sentence-transformers' CrossEncoder.predict resolves it: the
    request's instruction (an empty one: none), else the model's default prompt, if it names
    one (config_sentence_transformers.json)."""
    if given is not None:
        return given or None
    return entry.default_prompt


def with_prompt(entry: ModelEntry, texts: list[str], prompt_name: str | None) -> list[str]:
    """Texts with the named sentence-transformers prompt of `entry` prepended (None: its
    default prompt, if it has one); 400 naming the available prompts for an unknown name."""
    if prompt_name is None:
        return with_default_prompt(entry, texts)
    if prompt_name not in entry.prompts:
        available = sorted(entry.prompts) or "none (config_sentence_transformers.json has none)"
        raise BadInput(f"unknown prompt_name {prompt_name!r}; this model's prompts: {available}")
    return [entry.prompts[prompt_name] + text for text in texts]


def normalized(vectors: list[np.ndarray]) -> list[np.ndarray]:
    """Each vector over its L2 norm (TEI's `normalize`)."""
    return [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]


def check_query(query: str) -> None:
    """A reranker's query must hold text (400); /rerank and /v1/rerank alike."""
    if not query:
        raise BadInput("'query' is an empty string; send the text to rank against")


def ranked(logits: list[np.ndarray], raw: bool) -> tuple[list[float], list[int]]:
    """A reranker's score per pair (sigmoid of its one logit; the logit when `raw`) and the
    pairs' indices best first, ties by index."""
    values = [float(scores(x, None, raw)[0]) for x in logits]
    return values, sorted(range(len(values)), key=lambda i: -values[i])  # stable


def predictions(entry: ModelEntry, logits: np.ndarray, how: str | None) -> list[dict]:
    """Every label with its score ({"label", "score"}, a Prediction), best first; how: None
    (the model's problem type), "none" (raw logits), "sigmoid" or "softmax"."""
    info = entry.model.info
    if how in ("sigmoid", "softmax"):
        values = scores(logits, "multi_label_classification" if how == "sigmoid" else None, False)
        if how == "softmax" and len(values) == 1:
            values = np.ones(1)  # softmax of one logit
    else:
        values = scores(logits, info.problem_type, raw=how == "none")
    order = np.argsort(-values, kind="stable")
    return [{"label": info.id2label[int(i)], "score": float(values[i])} for i in order]
