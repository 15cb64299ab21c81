"""Every page of the built site in a real browser (Debian's chromium, headless, Playwright):
it asks for nothing outside the site, search included. Skips, saying why, without chromium."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.docker import serve_directory

TABS = 6


@pytest.fixture(scope="module")
def site_url(site: Path) -> Iterator[str]:
    """The built site over HTTP on loopback (the search index loads through fetch)."""
    with serve_directory(site) as url:
        yield url.rstrip("/")


def test_pages_fetch_nothing_from_outside(site: Path, site_url: str, browser) -> None:
    outside: list[str] = []
    failed: list[str] = []
    context = browser.new_context()
    context.on("request", lambda r: None if _local(r.url, site_url) else outside.append(r.url))
    context.on("requestfailed", lambda r: failed.append(r.url))
    pages = sorted(site.rglob("*.html"))
    for start in range(0, len(pages), TABS):  # a few tabs at once: their idle waits overlap
        tabs = []
        for html in pages[start : start + TABS]:
            tab = context.new_page()
            tab.goto(f"{site_url}/{html.relative_to(site).as_posix()}", wait_until="load")
            tabs.append(tab)
        for tab in tabs:
            tab.wait_for_load_state("networkidle")
            tab.close()
    # search: its worker and index are loaded on first use
    page = context.new_page()
    page.goto(f"{site_url}/index.html", wait_until="networkidle")
    page.keyboard.press("/")  # Material's search shortcut
    page.keyboard.type("batching")
    page.wait_for_selector(".md-search-result__item", timeout=30_000)
    with contextlib.suppress(Exception):
        page.wait_for_load_state("networkidle")
    context.close()
    assert not outside, f"the site asked for outside resources: {sorted(set(outside))}"
    assert not failed, f"requests that failed: {sorted(set(failed))}"


def _local(url: str, site_url: str) -> bool:
    return url.startswith((site_url, "data:", "blob:", "about:"))
