"""What text-embeddings-inference's HTTP routes share: the model a path names, a route's
metrics and trace around the model it uses, and bodies read and validated. What gRPC shares
with them is in service/text/tei_ops.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from service.http.body import read_object
from service.http.deps import traced
from service.http.routes.common import observed
from service.pipeline.errors import BadInput, ServiceError
from service.text.tei_ops import text_entry

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry, ServiceState

M = TypeVar("M", bound=BaseModel)


def routed_model(request: Request) -> str | None:
    """The model a per-model mount names (/models/{model_name}/...), or None on the root
    routes."""
    return request.path_params.get("model_name")


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
