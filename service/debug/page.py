"""The attention debug page's files (service/debug/static, package data) and its model facts.

The page is static HTML, CSS and JavaScript with no secrets in it, so a browser may load it by
plain navigation; its scripts send the debug token the user pastes as `Authorization: Bearer`
on every fetch() of /debug/info, /attention and /heads, which check it like any client's.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response

from service.debug.attention_weights import weight_layers
from service.oip.decoder_inputs import DECODER_ARCHITECTURES, input_names
from service.pipeline.errors import ModelNotFound

if TYPE_CHECKING:
    from service.runtime.state import ServiceState

INDEX = "index.html"
MEDIA_TYPES = {
    INDEX: "text/html; charset=utf-8",
    "debug.css": "text/css; charset=utf-8",
    "debug.js": "text/javascript; charset=utf-8",
}
# Only our own files run and only our own origin is fetched: no inline script, no CDN.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def load_assets() -> dict[str, bytes]:
    """Every page file, read once at start-up (a missing one is a packaging error)."""
    folder = resources.files("service.debug") / "static"
    return {name: (folder / name).read_bytes() for name in MEDIA_TYPES}


def asset_response(assets: dict[str, bytes], name: str) -> Response:
    """One page file with its media type and the page's security headers; 404 for others."""
    if name not in assets:
        raise ModelNotFound(f"the debug page has no file {name!r}")
    return Response(assets[name], media_type=MEDIA_TYPES[name], headers=HEADERS)


def model_info(state: ServiceState, tokenizer: Any, max_len: int, flag: str) -> dict[str, Any]:
    """What the page needs: the model's name and shape, its input kind and the debug limits."""
    model, settings = state.model, state.settings
    text = tokenizer is not None
    return {
        "model_name": state.model_name,
        "architecture": model.architecture,
        "num_layers": model.num_layers,
        "num_heads": model.num_heads,
        "embed_dim": model.embed_dim,
        "kdim": model.kdim,
        "vdim": model.vdim,
        "needs_key_value": state.limits.needs_key_value,
        # decoders: the layer picker indexes decoder layers; inputs under PyTorch's names
        "weight_layers": weight_layers(model),
        "decoder_inputs": list(input_names(model.architecture)[0])
        if model.architecture in DECODER_ARCHITECTURES
        else None,
        "input": "text" if text else "tensor",
        "max_tokens": min(max_len, tokenizer.max_length) if text else max_len,
        "max_tokens_flag": flag,
        "max_concurrency": settings.debug_max_concurrency,
    }
