"""The debug page on a served nn.TransformerDecoder in headless chromium: it sends tgt and memory
(PyTorch's names) with tgt_is_causal, and switches between the self- and cross-attention heatmaps
of the weights it fetched."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

import mha_engine
from tests.service.test_debug_page_browser import _connect, _dom_weights, _open_page, _run
from tests.service.test_debug_page_browser import browser as browser  # the fixture
from tests.support import Server, run_server

TOKEN = "decoder-page-token"
D, H, T = 16, 4, 6  # the page's memory is T + 4 positions long


@pytest.fixture(scope="module")
def decoder_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    torch.manual_seed(5)
    layer = nn.TransformerDecoderLayer(D, H, 32, batch_first=True)
    root = tmp_path_factory.mktemp("decoder-page")
    mha_engine.save_model(nn.TransformerDecoder(layer, 2).eval(), root / "dec")
    args = ["--model-dir", str(root / "dec"), "--debug-endpoint", "--debug-token", TOKEN]
    with run_server(root, *args) as server:
        yield server


def test_page_shows_self_and_cross_attention(browser, decoder_server) -> None:
    errors: list[str] = []
    page = _open_page(browser, decoder_server.url, errors)
    # the page connects by itself; the server wants a token, so that first fetch is a 401
    # (a locator wait, not wait_for_function: the page's CSP bars eval, which that polls with)
    page.locator("#status", has_text="401").wait_for()
    errors.clear()  # the browser logs the refused fetch itself
    _connect(page, TOKEN)
    assert "transformer_decoder" in page.text_content("#model-line")
    assert page.is_visible("#kind") and page.locator("#layer option").count() == 2
    page.fill("#random-length", str(T))
    _run(page, 1, 2)
    heatmap = page.locator("#heatmap")
    assert heatmap.get_attribute("data-kind") == "self"
    own = _dom_weights(page, T, T)
    np.testing.assert_allclose(own.sum(axis=1), 1.0, atol=1e-4)
    assert np.all(np.triu(own, 1) == 0)  # tgt_is_causal: no query sees a later position
    page.select_option("#kind", "cross")
    assert heatmap.get_attribute("data-kind") == "cross"
    assert page.locator("#heatmap .cell").count() == T * (T + 4)
    cross = _dom_weights(page, T, T + 4)
    np.testing.assert_allclose(cross.sum(axis=1), 1.0, atol=1e-4)
    assert np.count_nonzero(np.triu(cross, 1)) > 0  # cross-attention is not causal
    assert "cross-attention" in page.text_content("#heatmap-title")
    assert page.locator("#heads-grid canvas").count() == H
    page.select_option("#kind", "self")
    np.testing.assert_array_equal(_dom_weights(page, T, T), own)
    assert errors == []
    page.close()
