"""Text on the attention debug endpoint, and the /debug page's routes, in-process (ASGI).

The token-labelled weights of the MiniLM package equal transformers' BertModel
(attn_implementation="eager", output_attentions=True) per layer and head at fp32 tolerance;
tokenization and truncation are the embeddings path's; bad text gets a 400 naming the problem;
/debug exists only with --debug-endpoint, is static, and its data route needs the debug token.
"""

from __future__ import annotations

import asyncio
import io
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from service.app import create_app
from service.debug import heatmap
from service.debug.attention_weights import WEIGHTS_NAME
from service.runtime.settings import Settings
from tests.service.test_embeddings import minilm_dir
from tests.support import FP32_TOL

TOKEN = "text-debug-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NAME = "minilm"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention, tokenizers & déjà-vu: unbelievably well-behaved!",
    "x",
]
LONG_TEXT = " ".join(["antidisestablishmentarianism is long"] * 60)  # > 256 tokens


class InProcess:
    """The app with its lifespan (model, batcher thread) on a background event loop; requests
    go through httpx.ASGITransport, no socket."""

    def __init__(self, settings: Settings) -> None:
        self.app = create_app(settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.stop: asyncio.Event | None = None
        self.lifespan: asyncio.Future | None = None

    def _call(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _run_lifespan(self, started: asyncio.Event) -> None:
        self.stop = asyncio.Event()
        async with self.app.router.lifespan_context(self.app):
            while not self.app.state.service.ready:
                await asyncio.sleep(0.02)
            started.set()
            await self.stop.wait()

    async def _start(self) -> None:
        started = asyncio.Event()
        self.lifespan = asyncio.ensure_future(self._run_lifespan(started))
        waiter = asyncio.ensure_future(started.wait())
        await asyncio.wait({waiter, self.lifespan}, return_when=asyncio.FIRST_COMPLETED)
        if self.lifespan.done():
            self.lifespan.result()  # raise the start-up error

    async def _stop(self) -> None:
        self.stop.set()
        await self.lifespan

    def __enter__(self) -> InProcess:
        self.thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        async def send() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.request(method, path, **kwargs)

        return self._call(send())

    def attention(self, text: Any, headers: dict | None = None, query: str = "", **body: Any):
        """POST a text request: one BYTES input 'text' of shape [1] unless `body` says more."""
        request = {
            "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}],
            **body,
        }
        return self.request(
            "POST",
            f"/v2/models/{NAME}/attention{query}",
            json=request,
            headers=AUTH if headers is None else headers,
        )


def settings(**values: Any) -> Settings:
    return Settings(model_name=NAME, debug_endpoint=True, **values)


@pytest.fixture(scope="module")
def minilm() -> Iterator[InProcess]:
    with InProcess(settings(model_dir=minilm_dir(), debug_token=TOKEN)) as app:
        yield app


@pytest.fixture(scope="module")
def reference():
    """transformers' BertModel (eager attention, so the weights are its softmax) and tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub
    transformers = pytest.importorskip("transformers")
    path = str(minilm_dir())
    model = transformers.BertModel.from_pretrained(
        path, add_pooling_layer=False, attn_implementation="eager"
    ).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path)


def outputs(response: httpx.Response) -> dict[str, dict]:
    assert response.status_code == 200, response.text
    return {o["name"]: o for o in response.json()["outputs"]}


def tensor(output: dict) -> torch.Tensor:
    return torch.tensor(output["data"], dtype=torch.float32).reshape(output["shape"])


@pytest.mark.parametrize("text", SENTENCES)
def test_weights_equal_transformers_per_layer_and_head(minilm, reference, text: str) -> None:
    model, tokenizer = reference
    batch = tokenizer(text, return_tensors="pt", return_special_tokens_mask=True)
    special = batch.pop("special_tokens_mask")[0].bool().tolist()
    with torch.no_grad():
        expected = model(**batch, output_attentions=True)
    ids = batch["input_ids"][0].tolist()
    count = len(ids)

    got = outputs(minilm.attention(text))
    assert list(got) == ["tokens", "token_ids", "special_tokens_mask", WEIGHTS_NAME, "output"]
    assert got["tokens"] == {
        "name": "tokens",
        "datatype": "BYTES",
        "shape": [1, count],
        "data": tokenizer.convert_ids_to_tokens(ids),
    }
    assert got["token_ids"]["data"] == ids and got["token_ids"]["datatype"] == "INT64"
    assert got["special_tokens_mask"]["data"] == special
    weights = tensor(got["attention_weights"])  # (L, 1, H, T, T): every layer by default
    assert weights.shape == (6, 1, 12, count, count)
    for layer, reference_layer in enumerate(expected.attentions):  # each (1, H, T, T)
        for head in range(12):
            torch.testing.assert_close(
                weights[layer, :, head], reference_layer[:, head], **FP32_TOL
            )
    torch.testing.assert_close(tensor(got["output"]), expected.last_hidden_state, **FP32_TOL)

    one = outputs(minilm.attention(text, parameters={"layer": -2}))  # one layer: (1, H, T, T)
    assert one["tokens"]["data"] == got["tokens"]["data"]
    torch.testing.assert_close(tensor(one["attention_weights"]), expected.attentions[4], **FP32_TOL)


def test_tokenized_and_truncated_as_embeddings(minilm, reference) -> None:
    _, tokenizer = reference
    response = minilm.attention(LONG_TEXT, parameters={"layer": 0}, outputs=[{"name": "tokens"}])
    assert response.status_code == 200, response.text
    body = response.json()
    assert [o["name"] for o in body["outputs"]] == ["tokens"]
    assert body["parameters"] == {"truncated": True, "layers": [0]}
    tokens = body["outputs"][0]["data"]
    expected = tokenizer(LONG_TEXT, truncation=True, max_length=256)["input_ids"]
    assert tokens == tokenizer.convert_ids_to_tokens(expected) and len(tokens) == 256
    assert tokens[-1] == "[SEP]"  # cut like sentence-transformers: special tokens kept
    embedded = minilm.request("POST", "/v1/embeddings", json={"model": NAME, "input": LONG_TEXT})
    assert embedded.json()["usage"]["prompt_tokens"] == 256
    assert embedded.headers["X-Truncated-Inputs"] == "0"
    short = minilm.attention(SENTENCES[0], outputs=[{"name": "tokens"}]).json()
    assert short["parameters"]["truncated"] is False


def _red_pixels(png: bytes) -> int:
    """Pixels in matplotlib's tab:red, the colour of special-token labels."""
    with Image.open(io.BytesIO(png)) as image:
        rgb = np.asarray(image.convert("RGB")).astype(int)
    return int((np.abs(rgb - np.array([214, 39, 40])).sum(axis=-1) < 60).sum())


def test_png_labels_both_axes_with_tokens(minilm, reference) -> None:
    _, tokenizer = reference
    text = " ".join(["word"] * 62)  # 64 tokens with [CLS] and [SEP]
    assert len(tokenizer(text)["input_ids"]) == 64
    mean = {"layer": 1, "average_attn_weights": True}  # one panel: quick to draw
    response = minilm.attention(text, query="?format=png", parameters=mean)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/png"
    assert response.headers["X-Heatmap-Grid"] == "1x1"
    panel = heatmap.panel_px(64, labelled=True)
    assert panel >= heatmap.LABEL_PX + 64 * heatmap.TOKEN_PX  # 12 px per token label
    with Image.open(io.BytesIO(response.content)) as image:
        assert image.size == heatmap.image_size(1, 1, panel)
    # [CLS] and [SEP] on both axes are drawn red; the same weights unlabelled have no red.
    assert _red_pixels(response.content) > 4 * 20
    heads = minilm.attention(SENTENCES[0], query="?format=png", parameters={"layer": 1})
    assert heads.headers["X-Heatmap-Grid"] == "3x4"  # 12 heads of one layer
    assert _red_pixels(heads.content) > 12 * 4 * 20
    too_big = minilm.attention(text, query="?format=png")  # 6 x 12 panels of 64 tokens
    assert too_big.status_code == 400
    width, height = heatmap.image_size(6, 12, panel)
    assert (width, height) == (12 * 870 + 90, 6 * 870 + 60) and width * height > 25e6
    assert f"would be {width}x{height} pixels" in too_big.json()["error"]
    assert "ask for one layer ('layer')" in too_big.json()["error"]
    unlabelled = minilm.attention(
        " ".join(["word"] * 63), query="?format=png", parameters=mean
    )  # 65 tokens: position ticks, same panel as a tensor request
    with Image.open(io.BytesIO(unlabelled.content)) as image:
        assert image.size == heatmap.image_size(1, 1)
    assert _red_pixels(unlabelled.content) == 0
    tensor_png = minilm.request(
        "POST",
        f"/v2/models/{NAME}/attention?format=png",
        json={
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, 3, 384],
                    "datatype": "FP32",
                    "data": [0.5] * (3 * 384),
                }
            ],
            "parameters": {"layer": 1, "average_attn_weights": True},
        },
        headers=AUTH,
    )
    assert tensor_png.status_code == 200 and _red_pixels(tensor_png.content) == 0


BAD_TEXT = [
    ("empty", {"data": [""]}, {}, "empty string"),
    ("not a string", {"data": [3]}, {}, "a list of one string"),
    ("two texts", {"shape": [2], "data": ["a", "b"]}, {}, "shape [1]"),
    ("no shape", {"shape": []}, {}, "shape [1]"),
    ("too many characters", {"data": ["a" * (64 * 256 + 1)]}, {}, "at most 16384"),
    ("layer out of range", {}, {"parameters": {"layer": 6}}, "parameter 'layer'"),
    ("causal", {}, {"parameters": {"is_causal": True}}, "is_causal"),
    ("binary answer", {}, {"parameters": {"binary_data_output": True}}, "binary_data_output"),
    ("unknown output", {}, {"outputs": [{"name": "logits"}]}, "logits"),
    ("unknown field", {}, {"text": "hello"}, "unknown field(s) ['text']"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "text_input", "body", "words"), BAD_TEXT, ids=[c[0] for c in BAD_TEXT]
)
def test_bad_text_is_a_400_naming_it(minilm, case, text_input, body, words) -> None:
    item = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hello"], **text_input}
    response = minilm.request(
        "POST", f"/v2/models/{NAME}/attention", json={"inputs": [item], **body}, headers=AUTH
    )
    assert response.status_code == 400, (case, response.text)
    assert words in response.json()["error"], (case, response.text)


def test_extra_input_with_text_is_refused(minilm) -> None:
    inputs = [
        {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hello"]},
        {"name": "input", "shape": [1, 384], "datatype": "FP32", "data": [0.0] * 384},
    ]
    response = minilm.request(
        "POST", f"/v2/models/{NAME}/attention", json={"inputs": inputs}, headers=AUTH
    )
    assert response.status_code == 400
    assert "exactly one input, 'text'" in response.json()["error"]


def test_too_many_tokens_names_the_debug_limit() -> None:
    with InProcess(settings(model_dir=minilm_dir(), debug_max_seq_len=8)) as app:
        ok = app.attention("a b c d e f", headers={})  # 8 tokens with [CLS] and [SEP]
        assert ok.status_code == 200, ok.text
        response = app.attention("a b c d e f g", headers={})
        assert response.status_code == 400
        error = response.json()["error"]
        assert "9 tokens" in error and "at most 8 (--debug-max-seq-len)" in error
        info = app.request("GET", "/debug/info").json()
        assert info["max_tokens"] == 8 and info["max_tokens_flag"] == "--debug-max-seq-len"


def test_token_guard_on_text_and_page_routes(minilm) -> None:
    for headers, status in (({}, 401), ({"Authorization": "Bearer nope"}, 403), (AUTH, 200)):
        assert minilm.attention("hi", headers=headers).status_code == status
        assert minilm.request("GET", "/debug/info", headers=headers).status_code == status
    info = minilm.request("GET", "/debug/info", headers=AUTH).json()
    assert info == {
        "model_name": NAME,
        "architecture": "transformer_encoder",
        "num_layers": 6,
        "num_heads": 12,
        "embed_dim": 384,
        "kdim": 384,
        "vdim": 384,
        "needs_key_value": False,
        "input": "text",
        "max_tokens": 256,  # the tokenizer's truncation (under --debug-max-seq-len 512)
        "max_tokens_flag": "--debug-max-seq-len",
        "max_concurrency": 2,
    }
    # The page itself is static and secret-free: a browser loads it by navigation, no header.
    page = minilm.request("GET", "/debug")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert TOKEN not in page.text and NAME not in page.text
    script = minilm.request("GET", "/debug/assets/debug.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert "Authorization" in script.text  # the token goes in a header, set by the script
    assert minilm.request("GET", "/debug/assets/debug.css").status_code == 200
    for path in ("/debug/assets/../app.py", "/debug/assets/secrets.txt", "/debug/other"):
        assert minilm.request("GET", path).status_code == 404, path


def test_page_with_an_api_key() -> None:
    config = settings(api_key="api-key", debug_token=TOKEN)
    with InProcess(config) as app:
        assert app.request("GET", "/debug").status_code == 200  # static: no key needed
        assert app.request("GET", "/debug/assets/debug.js").status_code == 200
        assert app.request("GET", "/debug/info").status_code == 401  # data: the key ...
        key = {"Authorization": "Bearer api-key"}
        assert app.request("GET", "/debug/info", headers=AUTH).status_code == 403
        assert app.request("GET", "/debug/info", headers=key).status_code == 401  # ... + token
        both = {**key, "X-Debug-Token": TOKEN}
        assert app.request("GET", "/debug/info", headers=both).status_code == 200
        assert app.request("GET", "/v2/models/minilm").status_code == 401  # the rest: the key


def test_debug_off_means_no_page() -> None:
    with InProcess(Settings(model_name=NAME)) as app:
        missing = app.request("GET", "/no-such-route")
        for path in ("/debug", "/debug/info", "/debug/assets/debug.js"):
            response = app.request("GET", path)
            assert response.status_code == 404, path
            assert response.json() == missing.json()


def test_tensor_model_page_control_and_request() -> None:
    with InProcess(settings(debug_max_seq_len=32)) as app:  # the demo encoder layer
        page = app.request("GET", "/debug").text
        assert 'id="random-length"' in page and 'id="text"' in page  # the script shows one
        info = app.request("GET", "/debug/info").json()
        assert info["input"] == "tensor" and info["model_name"] == NAME
        assert (info["embed_dim"], info["num_heads"], info["max_tokens"]) == (512, 8, 32)
        # What the page sends for "random input of length T": one [1, T, E] tensor, one layer.
        x = np.random.default_rng(0).standard_normal((1, 10, 512)).astype(np.float32)
        body = {
            "inputs": [{"name": "input", "shape": [1, 10, 512], "datatype": "FP32",
                        "data": x.ravel().tolist()}],
            "parameters": {"layer": 0},
            "outputs": [{"name": "attention_weights"}],
        }  # fmt: skip
        got = app.request("POST", f"/v2/models/{NAME}/attention", json=body).json()
        assert got["outputs"][0]["shape"] == [1, 8, 10, 10]
        # Text to a model without a tokenizer: 400 saying what it needs.
        response = app.attention("hello", headers={})
        assert response.status_code == 400
        assert "tokenizer.json" in response.json()["error"]


def test_page_requests_share_the_debug_concurrency_limit(minilm) -> None:
    """/debug/info and text requests take a slot of --debug-max-concurrency like any debug call."""
    gate = minilm.app.state.debug_gate

    async def while_full() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=minilm.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            with gate.slot(), gate.slot():  # both slots (the limit is 2) taken
                return [
                    await client.get("/debug/info", headers=AUTH),
                    await client.post(
                        f"/v2/models/{NAME}/attention",
                        json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                          "data": ["hi"]}]},
                        headers=AUTH,
                    ),
                    await client.get("/debug"),  # the static page is not a debug computation
                ]  # fmt: skip

    info, text, page = minilm._call(while_full())
    for response in (info, text):
        assert response.status_code == 429 and response.headers["Retry-After"] == "1"
        assert "--debug-max-concurrency" in response.json()["error"]
    assert page.status_code == 200
    assert minilm.request("GET", "/debug/info", headers=AUTH).status_code == 200  # freed
