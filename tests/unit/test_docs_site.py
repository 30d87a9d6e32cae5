"""The built docs site opens from disk: every internal link and image is a file.

The site is built as `make docs` builds it (`mkdocs build --strict`) into a scratch
folder; every `href` and `src` of every page that points inside the site must name a file
there (`use_directory_urls: false`: a link to a folder opens a directory listing from
disk), and no page shows the rendering slips that strict mode lets through (a backslash
before a pipe, a numbered list run into a paragraph).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("href", "src") and value:
                self.links.append(value)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)},
    )
    assert built.returncode == 0, built.stderr[-3000:]
    return out


def internal(link: str) -> bool:
    parts = urlsplit(link)
    return not (parts.scheme or parts.netloc or link.startswith(("#", "mailto:", "data:")))


def test_every_internal_link_is_a_file(site: Path) -> None:
    # 404.html is for a web server (absolute links); opened from disk it is never shown
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")
    assert len(pages) > 15
    broken = []
    for page in pages:
        parser = Links()
        parser.feed(page.read_text(encoding="utf-8"))
        for link in parser.links:
            if not internal(link):
                continue
            target = (page.parent / unquote(urlsplit(link).path)).resolve()
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {link}")
    assert broken == []


def test_pages_render_without_escapes_or_run_on_lists(site: Path) -> None:
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        assert "\\|" not in text, page
        prose = re.sub(r"<(pre|code)\b.*?</\1>", "", text, flags=re.S)
        for paragraph in re.findall(r"<p>(.*?)</p>", prose, flags=re.S):
            assert not re.search(r"\n\s*\d+\. \S", paragraph), (page, paragraph[:200])


def test_home_page_shows_the_diagram_and_the_paper(site: Path) -> None:
    home = (site / "index.html").read_text(encoding="utf-8")
    assert 'src="img/architecture.svg"' in home
    assert "https://arxiv.org/abs/2605.24202" in home
