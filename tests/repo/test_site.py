"""The docs site (mkdocs.yml): it builds with warnings as errors, and every page opens in
Debian's chromium with no console error, no failed load, no broken internal link, every
image loaded, and no request leaving this machine."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlparse

import pytest

from tests.browser import Browser, needs_browser

ROOT = Path(__file__).resolve().parents[2]

mkdocs = pytest.importorskip("mkdocs", reason="the docs site needs the dev extras (mkdocs)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built once, as CI builds it: ``mkdocs build --strict``; and the seconds it
    took."""
    out = tmp_path_factory.mktemp("site")
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out, time.monotonic() - t0


class _Anchors(HTMLParser):
    """The ids of a page and the links it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(found["id"] or "")
        if tag == "a" and found.get("href"):
            self.links.append(found["href"] or "")


def parse(path: Path) -> _Anchors:
    page = _Anchors()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def pages(site_dir: Path) -> list[Path]:
    return sorted(p for p in site_dir.rglob("*.html") if p.name != "404.html")


def test_the_site_builds_strictly_with_every_page(site):
    site_dir, seconds = site
    built = {p.relative_to(site_dir).as_posix() for p in pages(site_dir)}
    docs = {p.with_suffix(".html").name for p in (ROOT / "docs").glob("*.md")}
    assert docs <= built  # every page of docs/ is on the site
    assert {"index.html", "changelog.html", "contributing.html", "api/heads.html"} <= built
    index = (site_dir / "index.html").read_text(encoding="utf-8")
    assert "Two commands" in index  # the README is the home page
    api = (site_dir / "api" / "heads.html").read_text(encoding="utf-8")
    assert "per_token_loss" in api and "The next-token loss at each position" in api
    for page in (site_dir / "api").glob("*.html"):  # Sphinx roles are not left as text
        assert ":func:" not in page.read_text(encoding="utf-8"), page.name
    assert seconds < 120  # the target is a minute; this bounds a runaway build


def test_every_internal_link_reaches_a_page_and_an_anchor(site):
    site_dir, _ = site
    parsed = {p: parse(p) for p in pages(site_dir)}
    broken = []
    for path, page in parsed.items():
        for href in page.links:
            if urlparse(href).scheme or href.startswith("//"):
                continue  # external: the test below checks none is ever fetched
            target, anchor = urldefrag(urljoin(path.as_uri(), href))
            file = Path(unquote(urlparse(target).path))
            if file.is_dir():
                file = file / "index.html"
            if not file.exists():
                broken.append(f"{path.name}: {href}")
            elif anchor and file.suffix == ".html":
                ids = parsed[file].ids if file in parsed else parse(file).ids
                if anchor not in ids:
                    broken.append(f"{path.name}: {href} (no anchor)")
    assert broken == []


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.e2e
@needs_browser
def test_every_page_opens_in_chromium_offline(site):
    site_dir, _ = site
    handler = functools.partial(_Quiet, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        with Browser() as b:
            for path in pages(site_dir):
                url = base + path.relative_to(site_dir).as_posix()
                b.goto(url)
                images = b.eval(
                    "[...document.images].filter((i) => !(i.complete && i.naturalWidth > 0))"
                    ".map((i) => i.src)"
                )
                assert images == [], f"{url}: images not loaded: {images}"
                assert b.errors() == [], f"{url}: {b.errors()}"
            b.goto(base + "index.html")  # the search runs offline: its index is local
            b.eval(
                "(() => { const i = document.querySelector("
                "'input[data-md-component=search-query]'); i.focus(); i.value = 'induction'; "
                "i.dispatchEvent(new Event('input')); })()"
            )
            b.wait("document.querySelectorAll('.md-search-result__item').length > 0")
            assert b.errors() == []
            outside = [
                u for u in b.requests if not u.startswith(base) and not u.startswith("data:")
            ]
            assert outside == []
    finally:
        server.shutdown()
