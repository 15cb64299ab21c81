"""The attention-weights debug endpoint over real HTTP: off by default, token guard, limits,
weights equal to nn.MultiheadAttention(need_weights=True), PNG heatmaps, head importance, and
the fast path still answering while debug requests run."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import mha_engine
from service.debug import heatmap
from tests.support import FP32_TOL, Server, binary_request, fp32_request, run_server

TOKEN = "s3cret-debug-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
E, H = 32, 4  # the MHA model under test
DEBUG_MAX_SEQ_LEN, DEBUG_MAX_BATCH = 24, 3


def attention_request(
    server: Server,
    model: str,
    tensors: dict[str, np.ndarray],
    *,
    headers: dict[str, str] | None = None,
    query: str = "",
    outputs: list[str] | None = None,
    **parameters: object,
) -> httpx.Response:
    """POST a binary-extension request for /attention; outputs come back binary."""
    inputs, chunks = [], []
    for name, array in tensors.items():
        datatype = "BOOL" if array.dtype == np.bool_ else "FP32"
        inputs.append(
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": datatype,
                "parameters": {"binary_data_size": array.nbytes},
            }
        )
        chunks.append(np.ascontiguousarray(array).tobytes())
    header: dict = {"inputs": inputs, "parameters": {**parameters, "binary_data_output": True}}
    if outputs is not None:
        header["outputs"] = [{"name": n, "parameters": {"binary_data": True}} for n in outputs]
    content, base = binary_request(header, *chunks)
    return httpx.post(
        f"{server.url}/v2/models/{model}/attention{query}",
        content=content,
        headers={**base, **(headers or {})},
        timeout=60,
    )


def outputs_of(response: httpx.Response) -> dict[str, np.ndarray]:
    """Every output of an OIP response (binary extension or JSON) as float32 arrays."""
    assert response.status_code == 200, response.text
    length = response.headers.get("Inference-Header-Content-Length")
    if length is None:
        header, raw = response.json(), b""
    else:
        header, raw = json.loads(response.content[: int(length)]), response.content[int(length) :]
    arrays, offset = {}, 0
    for out in header["outputs"]:
        assert out["datatype"] == "FP32"
        if "data" in out:
            arrays[out["name"]] = np.asarray(out["data"], np.float32).reshape(out["shape"])
        else:
            size = out["parameters"]["binary_data_size"]
            chunk = raw[offset : offset + size]
            arrays[out["name"]] = np.frombuffer(chunk, np.float32).reshape(out["shape"]).copy()
            offset += size
    return arrays


def png_size(content: bytes) -> tuple[int, int]:
    """(width, height) from the PNG signature + IHDR, then a full decode with PIL."""
    assert content[:8] == b"\x89PNG\r\n\x1a\n" and content[12:16] == b"IHDR"
    width, height = int.from_bytes(content[16:20], "big"), int.from_bytes(content[20:24], "big")
    with Image.open(io.BytesIO(content)) as image:
        image.load()
        assert image.size == (width, height)
    return width, height


def mask_pixels(content: bytes) -> int:
    """How many pixels have the heatmap's padded-key grey."""
    with Image.open(io.BytesIO(content)) as image:
        rgb = np.asarray(image.convert("RGB"))
    return int((rgb == np.array(heatmap.MASK_RGB, np.uint8)).all(axis=-1).sum())


# -- off by default ----------------------------------------------------------------------------
def test_disabled_by_default_is_404_like_a_missing_route(demo_server: Server) -> None:
    x = np.zeros((1, 4, 512), np.float32)
    missing = httpx.post(f"{demo_server.url}/v2/models/mha/no-such-route", content=b"{}")
    assert missing.status_code == 404
    for response in (
        attention_request(demo_server, "mha", {"input": x}, headers=AUTH),
        httpx.get(f"{demo_server.url}/v2/models/mha/heads"),
        httpx.get(f"{demo_server.url}/v2/models/mha/heads?format=png"),
    ):
        assert response.status_code == 404, response.text
        assert response.json() == missing.json()
    paths = httpx.get(f"{demo_server.url}/openapi.json").json()["paths"]
    assert not any(p.endswith(("/attention", "/heads")) for p in paths)


# -- an MHA model, with token and tight debug limits -------------------------------------------
@pytest.fixture(scope="module")
def mha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, nn.Module]]:
    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, H, batch_first=True).eval()
    model_dir = tmp_path_factory.mktemp("debug") / "attn"
    mha_engine.save_model(module, model_dir)
    args = [
        "--model-dir", str(model_dir),
        "--debug-endpoint",
        "--debug-token", TOKEN,
        "--debug-max-seq-len", str(DEBUG_MAX_SEQ_LEN),
        "--debug-max-batch-size", str(DEBUG_MAX_BATCH),
        "--debug-max-concurrency", "1",
        "--max-seq-len", "64",
    ]  # fmt: skip
    with run_server(model_dir.parent, *args) as server:
        yield server, module


def test_token_guard(mha) -> None:
    server, _ = mha
    x = np.random.default_rng(0).standard_normal((1, 5, E)).astype(np.float32)
    cases = [
        ({}, 401),
        ({"Authorization": "Basic " + TOKEN}, 401),
        ({"Authorization": "Bearer"}, 401),
        ({"Authorization": "Bearer wrong-token"}, 403),
        ({"Authorization": f"Bearer {TOKEN}x"}, 403),
        (AUTH, 200),
    ]
    for headers, status in cases:
        response = attention_request(server, "attn", {"input": x}, headers=headers)
        assert response.status_code == status, (headers, response.text)
        heads = httpx.get(f"{server.url}/v2/models/attn/heads", headers=headers)
        assert heads.status_code == status, (headers, heads.text)
        if status == 401:
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            assert "Authorization: Bearer" in response.json()["error"]
        if status == 403:
            assert response.json() == {"error": "wrong debug token"}
    assert server.metric("mha_requests_total", endpoint="attention", status="401") == 3
    assert server.metric("mha_requests_total", endpoint="attention", status="403") == 2
    assert server.metric("mha_request_failures_total", endpoint="heads", reason="forbidden") == 2
    assert server.metric("mha_request_duration_seconds_count", endpoint="attention") >= 6


def _dead_rows(mask: np.ndarray | None, causal: bool, batch: int, tgt: int, src: int):
    """(B, T) True where every key of the query row is masked."""
    hidden = np.zeros((batch, tgt, src), bool)
    if mask is not None:
        hidden |= mask[:, None, :]
    if causal:
        hidden |= np.triu(np.ones((tgt, src), bool), 1)[None]
    return hidden.all(axis=-1)


CASES = {
    "self": dict(mask=None, causal=False, cross=False),
    "padding": dict(mask="right", causal=False, cross=False),
    "causal": dict(mask=None, causal=True, cross=False),
    # left padding + causal: the first query rows see only padded keys (PyTorch gives NaN)
    "causal+left-padding": dict(mask="left", causal=True, cross=False),
    "cross+padding": dict(mask="right", causal=False, cross=True),
}


@pytest.mark.parametrize("average", [False, True], ids=["per-head", "averaged"])
@pytest.mark.parametrize("case", list(CASES))
def test_weights_equal_pytorch(mha, case: str, average: bool) -> None:
    server, module = mha
    spec = CASES[case]
    rng = np.random.default_rng(len(case))
    batch, tgt = 3, 9
    src = 13 if spec["cross"] else tgt
    q = rng.standard_normal((batch, tgt, E)).astype(np.float32)
    k = rng.standard_normal((batch, src, E)).astype(np.float32) if spec["cross"] else q
    v = rng.standard_normal((batch, src, E)).astype(np.float32) if spec["cross"] else q
    mask = None
    if spec["mask"] == "right":
        mask = np.zeros((batch, src), bool)
        mask[0, src - 4 :] = True
        mask[2, src - 1 :] = True
    elif spec["mask"] == "left":
        mask = np.zeros((batch, src), bool)
        mask[1, :3] = True
    tensors = {"input": q}
    if spec["cross"]:
        tensors |= {"key": k, "value": v}
    if mask is not None:
        tensors["key_padding_mask"] = mask
    response = attention_request(
        server,
        "attn",
        tensors,
        headers=AUTH,
        is_causal=spec["causal"],
        average_attn_weights=average,
    )
    got = outputs_of(response)
    assert set(got) == {"output", "attention_weights"}
    assert got["output"].shape == (batch, tgt, E)
    assert got["attention_weights"].shape == ((batch,) if average else (batch, H)) + (tgt, src)

    kpm = None if mask is None else torch.from_numpy(mask)
    attn_mask = None
    if spec["causal"]:
        attn_mask = nn.Transformer.generate_square_subsequent_mask(tgt)
        if kpm is not None:  # same mask type for both, as PyTorch asks
            kpm = torch.zeros(kpm.shape).masked_fill(kpm, float("-inf"))
    with torch.no_grad():
        expected_out, expected_w = module(
            *(torch.from_numpy(a) for a in (q, k, v)),
            key_padding_mask=kpm,
            attn_mask=attn_mask,
            need_weights=True,
            average_attn_weights=average,
        )
    dead = _dead_rows(mask, spec["causal"], batch, tgt, src)  # (B, T)
    assert dead.any() == (case == "causal+left-padding")
    live = torch.from_numpy(~dead)
    weights = torch.from_numpy(got["attention_weights"])
    if not average:
        weights, expected_w = weights.transpose(1, 2), expected_w.transpose(1, 2)  # (B, T, H, S)
    torch.testing.assert_close(weights[live], expected_w[live], **FP32_TOL)
    assert not weights.isnan().any() and (weights[~live] == 0).all()
    output = torch.from_numpy(got["output"])
    torch.testing.assert_close(output[live], expected_out[live], **FP32_TOL)
    if mask is not None:  # padded keys get exactly zero weight
        hidden = torch.from_numpy(mask)  # (B, S)
        hidden = hidden[:, None, :] if average else hidden[:, None, None, :]
        assert weights.masked_select(hidden.expand_as(weights)).eq(0).all()


def test_unbatched_json_and_requested_outputs(mha) -> None:
    server, module = mha
    x = np.random.default_rng(1).standard_normal((6, E)).astype(np.float32)
    body = {
        "inputs": [{"name": "input", "shape": [6, E], "datatype": "FP32", "data": x.tolist()}],
        "outputs": [{"name": "attention_weights"}],
    }
    url = f"{server.url}/v2/models/attn/versions/1/attention"
    got = outputs_of(httpx.post(url, json=body, headers=AUTH))
    assert list(got) == ["attention_weights"] and got["attention_weights"].shape == (H, 6, 6)
    with torch.no_grad():
        xt = torch.from_numpy(x)
        _, expected = module(xt, xt, xt, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(torch.from_numpy(got["attention_weights"]), expected, **FP32_TOL)


def test_heads_report_matches_out_proj(mha) -> None:
    server, module = mha
    response = httpx.get(f"{server.url}/v2/models/attn/heads", headers=AUTH)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["architecture"] == "multihead_attention" and len(body["layers"]) == 1
    layer = body["layers"][0]
    # Head h's block of W^Oᵀ is rows h·d_v..(h+1)·d_v, i.e. those columns of out_proj.weight.
    w_o = module.out_proj.weight.detach().numpy()  # (E, E)
    blocks = [w_o[:, h * (E // H) : (h + 1) * (E // H)].ravel() for h in range(H)]
    norms = np.array([np.linalg.norm(b) for b in blocks])
    unit = np.stack(blocks) / norms[:, None]
    np.testing.assert_allclose(layer["head_norm"], norms, rtol=1e-5)
    np.testing.assert_allclose(layer["head_share"], norms / norms.sum(), rtol=1e-5)
    np.testing.assert_allclose(layer["correlation"], unit @ unit.T, atol=1e-5)
    png = httpx.get(f"{server.url}/v2/models/attn/heads?format=png", headers=AUTH)
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    width, height = png_size(png.content)
    assert width > 300 and height > 200
    assert server.metric("mha_requests_total", endpoint="heads", status="200") >= 2


def test_png_heatmap_grid_and_masked_keys(mha) -> None:
    server, _ = mha
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 16, E)).astype(np.float32)
    mask = np.zeros((2, 16), bool)
    mask[0, 10:] = True  # the first sequence (the one drawn) has 6 padded keys
    panel_area = (heatmap.PANEL_PX - 80) ** 2  # the plot box inside one grid cell, roughly

    padded = attention_request(
        server, "attn", {"input": x, "key_padding_mask": mask}, headers=AUTH, query="?format=png"
    )
    assert padded.status_code == 200, padded.text
    assert padded.headers["content-type"] == "image/png"
    assert padded.headers["X-Heatmap-Grid"] == "1x4"  # one layer, 4 heads in a row
    assert png_size(padded.content) == heatmap.image_size(1, 4) == (4 * 240 + 90, 240 + 60)
    # 6 of 16 key columns are grey in each of the 4 panels.
    assert mask_pixels(padded.content) > 0.8 * 4 * panel_area * 6 / 16

    plain = attention_request(server, "attn", {"input": x}, headers={**AUTH, "Accept": "image/png"})
    assert plain.headers["content-type"] == "image/png"
    assert mask_pixels(plain.content) < 0.01 * panel_area

    averaged = attention_request(
        server, "attn", {"input": x}, headers=AUTH, query="?format=png", average_attn_weights=True
    )
    assert averaged.headers["X-Heatmap-Grid"] == "1x1"
    assert png_size(averaged.content) == heatmap.image_size(1, 1)


def _limit_cases() -> list[tuple[str, dict, dict, str]]:
    x = np.zeros((1, 4, E), np.float32)
    return [
        ("too long", {"input": np.zeros((1, DEBUG_MAX_SEQ_LEN + 1, E), np.float32)}, {},
         "--debug-max-seq-len"),
        ("key too long", {"input": x, "key": np.zeros((1, 30, E), np.float32),
                          "value": np.zeros((1, 30, E), np.float32)}, {}, "--debug-max-seq-len"),
        ("too many sequences", {"input": np.zeros((DEBUG_MAX_BATCH + 1, 4, E), np.float32)}, {},
         "--debug-max-batch-size"),
        ("layer out of range", {"input": x}, {"layer": 1}, "parameter 'layer'"),
        ("layer not int", {"input": x}, {"layer": "0"}, "parameter 'layer'"),
        ("average not bool", {"input": x}, {"average_attn_weights": 1}, "average_attn_weights"),
        ("causal cross", {"input": x, "key": np.zeros((1, 5, E), np.float32),
                          "value": np.zeros((1, 5, E), np.float32)}, {"is_causal": True},
         "is_causal"),
    ]  # fmt: skip


def test_limits_and_bad_requests_are_named(mha) -> None:
    server, _ = mha
    for name, tensors, parameters, words in _limit_cases():
        response = attention_request(server, "attn", tensors, headers=AUTH, **parameters)
        assert response.status_code == 400, (name, response.text)
        assert words in response.json()["error"], (name, response.json())
    x = np.zeros((1, 4, E), np.float32)
    for query, words in (("?format=svg", "format"), ("", "unknown output")):
        outputs = ["weights"] if not query else None
        response = attention_request(
            server, "attn", {"input": x}, headers=AUTH, query=query, outputs=outputs
        )
        assert response.status_code == 400 and words in response.json()["error"]
    other = attention_request(server, "nope", {"input": x}, headers=AUTH)
    assert other.status_code == 404 and "unknown model" in other.json()["error"]
    # The server's own --max-seq-len (64) still applies on /infer; the debug limit is smaller.
    content, headers = fp32_request(np.zeros((1, 40, E), np.float32))
    infer = httpx.post(f"{server.url}/v2/models/attn/infer", content=content, headers=headers)
    assert infer.status_code == 200, infer.text
    assert server.metric("mha_batches_total", outcome="error") == 0


def test_concurrency_limit(mha) -> None:
    """With --debug-max-concurrency 1, a request still uploading holds the only slot."""
    server, _ = mha
    x = np.random.default_rng(3).standard_normal((1, 5, E)).astype(np.float32)
    content, headers = fp32_request(x)
    release, sent = threading.Event(), threading.Event()

    def slow_body() -> Iterator[bytes]:
        yield content[:10]
        sent.set()  # headers and the first bytes are on the wire
        release.wait(30)
        yield content[10:]

    slow: dict[str, httpx.Response] = {}

    def send_slow() -> None:
        slow["response"] = httpx.post(
            f"{server.url}/v2/models/attn/attention",
            content=slow_body(),
            headers={**headers, **AUTH},
            timeout=60,
        )

    thread = threading.Thread(target=send_slow)
    thread.start()
    try:
        assert sent.wait(10)
        refused = None
        deadline = time.monotonic() + 20
        while refused is None and time.monotonic() < deadline:
            response = attention_request(server, "attn", {"input": x}, headers=AUTH)
            if response.status_code == 429:
                refused = response
            else:  # the slow request has not reached the handler yet
                assert response.status_code == 200, response.text
                time.sleep(0.05)
        assert refused is not None, "a second debug request was never refused"
        assert "--debug-max-concurrency" in refused.json()["error"]
        assert refused.headers["Retry-After"] == "1"
        heads = httpx.get(f"{server.url}/v2/models/attn/heads", headers=AUTH)
        assert heads.status_code == 429
        # The fast path has its own limits: /infer is unaffected.
        infer = httpx.post(f"{server.url}/v2/models/attn/infer", content=content, headers=headers)
        assert infer.status_code == 200
    finally:
        release.set()
        thread.join(60)
    assert outputs_of(slow["response"])["output"].shape == (1, 5, E)
    assert attention_request(server, "attn", {"input": x}, headers=AUTH).status_code == 200
    assert (
        server.metric("mha_request_failures_total", endpoint="attention", reason="overloaded") >= 1
    )


# -- a two-layer encoder, enabled by environment variable, no token ----------------------------
@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, nn.Module]]:
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True)
    module = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    model_dir = tmp_path_factory.mktemp("debug") / "enc"
    mha_engine.save_model(module, model_dir)
    env = {"MHA_DEBUG_ENDPOINT": "1", "MHA_DEBUG_MAX_SEQ_LEN": "128"}
    with run_server(model_dir.parent, "--model-dir", str(model_dir), env=env) as server:
        yield server, module


def _encoder_reference(module: nn.TransformerEncoder, x: np.ndarray, mask: np.ndarray):
    """Output and per-layer weights (L, B, H, T, S), running PyTorch's layers one by one."""
    h, kpm, weights = torch.from_numpy(x), torch.from_numpy(mask), []
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # padded rows computed like ours, not zeroed
    try:
        with torch.no_grad():
            for layer in module.layers:
                _, w = layer.self_attn(
                    h, h, h, key_padding_mask=kpm, need_weights=True, average_attn_weights=False
                )
                weights.append(w)
                h = layer(h, src_key_padding_mask=kpm)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    return h, torch.stack(weights)


def test_encoder_layers_equal_pytorch(encoder) -> None:
    server, module = encoder
    assert "debug endpoint is on without --debug-token" in server.log()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 11, E)).astype(np.float32)
    mask = np.zeros((2, 11), bool)
    mask[1, 7:] = True
    expected_out, expected_w = _encoder_reference(module, x, mask)  # (L, B, H, T, S)
    tensors = {"input": x, "key_padding_mask": mask}

    every = outputs_of(attention_request(server, "enc", tensors))  # default: all layers
    assert every["attention_weights"].shape == (2, 2, H, 11, 11)
    torch.testing.assert_close(torch.from_numpy(every["attention_weights"]), expected_w, **FP32_TOL)
    torch.testing.assert_close(torch.from_numpy(every["output"]), expected_out, **FP32_TOL)
    for layer in (1, -1):
        one = outputs_of(attention_request(server, "enc", tensors, layer=layer))
        got = torch.from_numpy(one["attention_weights"])
        torch.testing.assert_close(got, expected_w[1], **FP32_TOL)  # (B, H, T, S)
    mean = outputs_of(attention_request(server, "enc", tensors, average_attn_weights=True))
    assert mean["attention_weights"].shape == (2, 2, 11, 11)  # (L, B, T, S)
    torch.testing.assert_close(
        torch.from_numpy(mean["attention_weights"]), expected_w.mean(dim=2), **FP32_TOL
    )
    heads = httpx.get(f"{server.url}/v2/models/enc/heads").json()["layers"]
    assert [layer["layer"] for layer in heads] == [0, 1]


def test_encoder_png_has_a_row_per_layer(encoder) -> None:
    server, _ = encoder
    x = np.random.default_rng(5).standard_normal((1, 12, E)).astype(np.float32)
    mask = np.zeros((1, 12), bool)
    mask[0, 9:] = True
    response = attention_request(
        server, "enc", {"input": x, "key_padding_mask": mask}, query="?format=png", is_causal=True
    )
    assert response.status_code == 200, response.text
    assert response.headers["X-Heatmap-Grid"] == "2x4"  # 2 layers x 4 heads
    assert png_size(response.content) == heatmap.image_size(2, 4) == (4 * 240 + 90, 2 * 240 + 60)
    single = attention_request(server, "enc", {"input": x}, query="?format=png", layer=0)
    assert single.headers["X-Heatmap-Grid"] == "1x4"


def test_fast_path_keeps_working_while_debug_requests_run(encoder) -> None:
    """Inference requests are answered while debug requests keep the engine busy: the debug
    client keeps sending until three inference requests have started and ended during its run
    (bounded: 200 debug requests, 60 s), so the check does not depend on how fast either is."""
    server, module = encoder
    rng = np.random.default_rng(6)
    big = rng.standard_normal((2, 128, E)).astype(np.float32)
    small = rng.standard_normal((1, 20, E)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(small))
    debug_statuses: list[int] = []
    enough, sending = threading.Event(), threading.Event()

    def debug_load() -> None:
        with httpx.Client(timeout=60) as client:
            content, headers = fp32_request(big)
            while not enough.is_set() and len(debug_statuses) < 200:
                sending.set()  # overlap counts only once a debug request is on its way
                response = client.post(
                    f"{server.url}/v2/models/enc/attention", content=content, headers=headers
                )
                debug_statuses.append(response.status_code)

    thread = threading.Thread(target=debug_load)
    thread.start()
    during, answers = 0, []
    content, headers = fp32_request(small)
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=60) as client:
        while thread.is_alive() and during < 3 and time.monotonic() < deadline:
            alive = sending.is_set() and thread.is_alive()
            answers.append(
                client.post(f"{server.url}/v2/models/enc/infer", content=content, headers=headers)
            )
            during += alive and thread.is_alive()
    enough.set()
    thread.join(60)
    assert during >= 3, f"{during} inference requests overlapped {len(debug_statuses)} debug ones"
    assert debug_statuses and set(debug_statuses) == {200}
    for response in answers:
        got = outputs_of(response)["output"]
        torch.testing.assert_close(torch.from_numpy(got), expected, **FP32_TOL)
    attention_ok = server.metric("mha_requests_total", endpoint="attention", status="200")
    assert attention_ok >= len(debug_statuses)
    assert server.metric("mha_batches_total", outcome="error") == 0
