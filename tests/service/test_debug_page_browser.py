"""The attention debug page (GET /debug) in a real browser: Debian's chromium, headless, driven
by Playwright for Python, against a real server on the MiniLM package and the demo model.

Set MHA_SAVE_SCREENSHOT=1 to copy the MiniLM screenshot to docs/debug-page.png (the README's).
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.service.test_embeddings import minilm_dir
from tests.support import ROOT, Server, run_server

CHROMIUM = Path(shutil.which("chromium") or "/usr/bin/chromium")
TOKEN = "page-debug-token"
API_KEY = "page-api-key"
NAME = "all-MiniLM-L6-v2"
SENTENCE = "The bank raised interest rates, so she moved her savings to the river bank."
LAYER, HEAD, OTHER_HEAD = 3, 7, 2


def _playwright():
    """The sync Playwright API with the system chromium; skips saying why when either is absent."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: pip install -e '.[test]'")
    return sync_playwright


@pytest.fixture(scope="module")
def browser() -> Iterator:
    sync_playwright = _playwright()
    with sync_playwright() as p:
        # the system browser: `playwright install` (a download) is never needed
        launched = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def minilm_debug_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = minilm_dir()
    args = ["--model-dir", str(path), "--model-name", NAME, "--debug-endpoint"]
    args += ["--debug-token", TOKEN, "--api-key", API_KEY, "--debug-max-concurrency", "1"]
    with run_server(tmp_path_factory.mktemp("page"), *args) as server:
        yield server


def _open_page(browser, url: str, errors: list[str]):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/debug")
    return page


def _connect(page, token: str, api_key: str = "") -> None:
    page.fill("#token", token)
    page.fill("#api-key", api_key)
    page.click("#connect")
    page.wait_for_selector("body[data-state=connected]", timeout=30_000)


def _run(page, layer: int, head: int) -> None:
    page.select_option("#layer", str(layer))
    page.select_option("#head", str(head))
    page.click("#run")
    page.wait_for_selector("body[data-state=ready]", timeout=60_000)


def _dom_weights(page, rows: int, cols: int) -> np.ndarray:
    """The heatmap's cells read back from the DOM as a (rows, cols) array of their weights."""
    cells = page.eval_on_selector_all(
        "#heatmap .cell", "els => els.map(e => [+e.dataset.q, +e.dataset.k, +e.dataset.w])"
    )
    grid = np.full((rows, cols), np.nan)
    for q, k, w in cells:
        grid[int(q), int(k)] = w
    return grid


def _not_blank(png: bytes) -> None:
    with Image.open(io.BytesIO(png)) as image:
        gray = np.asarray(image.convert("L"), dtype=np.float32)
        colours = len(image.convert("RGB").getcolors(maxcolors=1 << 20) or [])
    assert gray.std() > 20, f"screenshot looks blank (pixel std {gray.std():.1f})"
    assert colours > 200, f"screenshot has only {colours} colours"


def _api_weights(server: Server, layer: int) -> tuple[list[str], np.ndarray]:
    """What a script gets for the same sentence: tokens and (H, T, T) weights of `layer`."""
    body = {
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [SENTENCE]}],
        "parameters": {"layer": layer},
    }
    response = httpx.post(
        f"{server.url}/v2/models/{NAME}/attention",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}", "X-Debug-Token": TOKEN},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    weights = np.asarray(outputs["attention_weights"]["data"], np.float32)
    return outputs["tokens"]["data"], weights.reshape(outputs["attention_weights"]["shape"])[0]


def test_page_shows_a_sentence_with_token_labels(browser, minilm_debug_server, tmp_path) -> None:
    server = minilm_debug_server
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(minilm_dir()))
    tokens = reference.convert_ids_to_tokens(reference(SENTENCE)["input_ids"])
    count = len(tokens)
    errors: list[str] = []
    page = _open_page(browser, server.url, errors)

    # The page itself loads without credentials and tries to connect without any: the data
    # routes answer 401, so (only then) the credential form appears.
    page.wait_for_selector("#connect-panel", state="visible")
    assert page.text_content("#status").startswith("Could not connect: 401: missing")
    assert "needs credentials" in page.text_content("#model-line")
    # A missing API key and then a wrong debug token are refused, and the page says so.
    page.fill("#token", TOKEN)
    page.click("#connect")
    page.wait_for_selector("#status.error")  # (no wait_for_function: the page's CSP bars eval)
    assert page.text_content("#status").startswith("Could not connect: 401: missing")
    page.fill("#token", "not-the-token")
    page.fill("#api-key", API_KEY)
    page.click("#connect")
    page.wait_for_selector("#status:text('403')")
    assert page.text_content("#status") == "Could not connect: 403: wrong debug token"
    assert page.is_hidden("#controls")
    errors.clear()  # the browser logs the refused fetches itself

    _connect(page, TOKEN, API_KEY)
    assert NAME in page.text_content("#model-line")
    assert page.is_visible("#text") and page.is_hidden("#random-length")
    page.fill("#text", SENTENCE)
    _run(page, LAYER, HEAD)

    heatmap = page.locator("#heatmap")
    assert heatmap.get_attribute("data-layer") == str(LAYER)
    assert heatmap.get_attribute("data-head") == str(HEAD)
    assert page.locator("#heatmap .cell").count() == count * count
    assert page.locator("#heatmap .row-label").all_text_contents() == tokens
    assert page.locator("#heatmap .col-label").all_text_contents() == tokens
    assert page.locator("#heatmap .row-label.special").all_text_contents() == ["[CLS]", "[SEP]"]
    assert page.locator("#heatmap .col-label.special").all_text_contents() == ["[CLS]", "[SEP]"]

    api_tokens, api_weights = _api_weights(server, LAYER)
    assert api_tokens == tokens
    shown = _dom_weights(page, count, count)
    np.testing.assert_allclose(shown, api_weights[HEAD], rtol=1e-5, atol=1e-7)  # 6 digits shown
    np.testing.assert_allclose(shown.sum(axis=1), 1.0, atol=1e-4)

    page.hover("#heatmap .cell[data-q='2'][data-k='5']")
    tip = page.locator("#tooltip")
    assert tip.is_visible()
    text = tip.text_content()
    assert f"query 2: {tokens[2]}" in text and f"key   5: {tokens[5]}" in text
    assert f"weight {api_weights[HEAD, 2, 5]:.4f}" in text

    assert page.locator("#heads-grid canvas").count() == 12
    assert page.locator("#heads-grid figure.selected").get_attribute("data-head") == str(HEAD)
    bars = page.locator("#importance rect.bar")
    assert bars.count() == 12
    assert page.locator("#importance rect.bar.selected").get_attribute("data-head") == str(HEAD)

    screenshot = page.screenshot(full_page=True)
    (tmp_path / "debug-page.png").write_bytes(screenshot)
    _not_blank(screenshot)
    if os.environ.get("MHA_SAVE_SCREENSHOT"):
        (ROOT / "docs" / "debug-page.png").write_bytes(screenshot)

    # A small multiple picks its head for the big heatmap, from the weights already fetched.
    page.click(f"#heads-grid figure[data-head='{OTHER_HEAD}']")
    assert heatmap.get_attribute("data-head") == str(OTHER_HEAD)
    shown = _dom_weights(page, count, count)
    np.testing.assert_allclose(shown, api_weights[OTHER_HEAD], rtol=1e-5, atol=1e-7)

    # Another layer: the page fetches it by itself and keeps the head.
    page.select_option("#layer", "5")
    page.wait_for_selector("#heatmap[data-layer='5']", timeout=60_000)
    assert heatmap.get_attribute("data-head") == str(OTHER_HEAD)
    _, layer_5 = _api_weights(server, 5)
    shown = _dom_weights(page, count, count)
    np.testing.assert_allclose(shown, layer_5[OTHER_HEAD], rtol=1e-5, atol=1e-7)
    assert "layer 5" in page.text_content("#importance-title")
    assert errors == []
    page.close()
    # The page's requests went through the debug routes (and their metrics).
    assert server.metric("mha_requests_total", endpoint="attention", status="200") >= 2
    assert server.metric("mha_requests_total", endpoint="heads", status="200") >= 1
    assert server.metric("mha_requests_total", endpoint="debug_info", status="403") == 1


@pytest.fixture(scope="module")
def demo_debug_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--debug-endpoint", "--debug-max-seq-len", "32"]
    with run_server(tmp_path_factory.mktemp("page-demo"), *args) as server:
        yield server


def test_page_random_input_for_a_tensor_model(browser, demo_debug_server) -> None:
    errors: list[str] = []
    page = _open_page(browser, demo_debug_server.url, errors)
    # No --debug-token or --api-key on this server: connected on load, no credential form.
    page.wait_for_selector("body[data-state=connected]", timeout=30_000)
    assert page.is_hidden("#connect-panel")
    assert page.is_visible("#random-length") and page.is_hidden("#text")
    assert page.text_content("#length-limit") == "(at most 32, --debug-max-seq-len)"
    page.fill("#random-length", "10")
    _run(page, 0, 5)
    assert page.locator("#heatmap .cell").count() == 100
    labels = [str(i) for i in range(10)]
    assert page.locator("#heatmap .row-label").all_text_contents() == labels
    assert page.locator("#heatmap .special").count() == 0
    assert page.locator("#heads-grid canvas").count() == 8

    page.fill("#random-length", "33")  # over --debug-max-seq-len: the server's 400 is shown
    page.click("#run")
    page.wait_for_selector("body[data-state=error]")
    assert "--debug-max-seq-len" in page.text_content("#status")
    assert [e for e in errors if "400" not in e] == []
    page.close()
