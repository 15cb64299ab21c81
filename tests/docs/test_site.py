"""The documentation site builds with `mkdocs build --strict` and loads nothing from outside."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import ROOT

# Tags that make a browser fetch something (stylesheets, scripts, images, frames, media, fonts).
ASSET = re.compile(
    r"<(?:script|link|img|iframe|source|video|audio|embed|object)\b[^>]*?"
    r"\b(?:src|href|data|srcset|poster)\s*=\s*[\"']?\s*(?:https?:)?//",
    re.I,
)
CSS_URL = re.compile(r"url\(\s*[\"']?\s*(?:https?:)?//", re.I)
IMPORT = re.compile(r"@import\s+[\"']?(?:url\()?\s*[\"']?(?:https?:)?//", re.I)


def test_every_page_in_the_nav_is_built(site: Path) -> None:
    pages = sorted(p.relative_to(ROOT / "docs") for p in (ROOT / "docs").rglob("*.md"))
    for page in pages:
        assert (site / page.with_suffix(".html")).is_file(), f"{page} was not built"
    assert len(pages) >= 20


def test_nothing_is_fetched_from_outside(site: Path) -> None:
    """No page or stylesheet points a browser at another host: no web fonts, no CDN."""
    offenders = []
    for path in site.rglob("*"):
        if path.suffix not in (".html", ".css"):
            continue
        text = path.read_text(errors="replace")
        for pattern in (ASSET, CSS_URL, IMPORT):
            offenders += [f"{path.relative_to(site)}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not offenders, "external assets:\n" + "\n".join(offenders)


def test_no_page_needs_a_script_from_a_cdn(site: Path) -> None:
    """Material loads mermaid from a CDN when a page has a mermaid diagram: keep none."""
    for page in site.rglob("*.html"):
        assert 'class="mermaid"' not in page.read_text(), f"{page.name} needs mermaid from a CDN"


def test_the_api_pages_come_from_the_docstrings(site: Path) -> None:
    """mkdocstrings rendered every public name of the engine (`mha_engine.__all__`), with its
    docstring."""
    import mha_engine

    html = (site / "library.html").read_text()
    missing = [name for name in mha_engine.__all__ if f'id="mha_engine.{name}"' not in html]
    assert not missing, f"public names missing from docs/library.md's API reference: {missing}"
    first_line = mha_engine.load_model.__doc__.strip().splitlines()[0]
    assert first_line.split()[0] in html


def test_the_detectors_catch_external_assets() -> None:
    assert ASSET.search('<link rel="stylesheet" href="https://fonts.googleapis.com/css">')
    assert ASSET.search("<script src='//cdn.example/x.js'></script>")
    assert CSS_URL.search("src: url(https://fonts.gstatic.com/a.woff2)")
    assert not ASSET.search('<a href="https://locust.io">Locust</a>')
    assert not ASSET.search('<link rel="stylesheet" href="assets/main.css">')


def test_readme_links_resolve() -> None:
    """README.md is a map into docs/: every relative link in it names a file that exists."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert len(local) >= 15
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_paths_named_in_the_docs_exist() -> None:
    """A file or folder of this repository named in README.md or a page (`service/oip/codecs.py`)
    exists: the docs follow the code when modules move."""
    folders = "service|mha_engine|tests|tools|benchmarks|loadtest|deploy"
    named = re.compile(rf"`((?:{folders})/[\w./-]*)`")
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for path in named.findall(page.read_text()):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_root_benchmarks_and_reliability_are_pointers() -> None:
    """The figures live in the site; the root files only point there (append to docs/*.md)."""
    for root, page in (
        ("BENCHMARKS.md", "docs/benchmarks.md"),
        ("RELIABILITY.md", "docs/reliability.md"),
    ):
        text = (ROOT / root).read_text()
        assert f"]({page})" in text
        assert len(text) < 1024, f"{root} holds figures: move them to the end of {page}"


def test_readme_request_path_is_the_architecture_pages() -> None:
    """README shows Architecture's request-path diagram, the same one (no second version)."""
    diagram = re.compile(r"^```\nclient ──HTTP.*?^```\n", re.S | re.M)
    readme = diagram.search((ROOT / "README.md").read_text())
    page = diagram.search((ROOT / "docs" / "architecture.md").read_text())
    assert readme and page and readme.group(0) == page.group(0)
