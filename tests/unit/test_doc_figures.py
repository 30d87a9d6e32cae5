"""The Matrix and Diagnostics pages show pictures of real runs, each with its command and
date (scripts/make_doc_figures.py), and the committed images stay small."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts import make_doc_figures as figures

ROOT = Path(__file__).resolve().parents[2]

MAX_TOTAL_BYTES = 1_500_000
PAGES = {
    "matrix.md": ["img/matrix/fig2.png", "img/matrix/fig3.png", "img/matrix/fig4.png",
                  "img/matrix/fig5.png", "img/matrix/fig6.png"],
    "diagnostics.md": ["img/diagnostics/watch.png", "img/diagnostics/reward_accuracy.png",
                       "img/diagnostics/role_dynamics.png"],
}  # fmt: skip


def _block(page: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    start, end = text.index(figures.BEGIN), text.index(figures.END)
    return text[start:end]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_shows_its_real_run_pictures_with_command_and_date(page: str) -> None:
    block = _block(page)
    shown = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", block)
    assert set(PAGES[page]) <= set(shown), f"{page}: run python scripts/make_doc_figures.py"
    for src in shown:
        assert (ROOT / "docs" / src).is_file(), f"{page}: {src} is missing"
    assert "python scripts/make_doc_figures.py" in block
    assert re.search(r"\b20\d\d-\d\d-\d\d \d\d:\d\d UTC", block), f"{page}: no date"
    assert "torch " in block and "cores" in block, f"{page}: no host"


def test_matrix_page_has_table_1_of_the_run() -> None:
    block = _block("matrix.md")
    assert re.search(r"^\|.*SA-RL.*\|$", block, re.M), "Table 1's header"


def test_committed_images_stay_small() -> None:
    pngs = [p for d in ("matrix", "diagnostics") for p in (ROOT / "docs" / "img" / d).glob("*")]
    assert pngs
    assert sum(p.stat().st_size for p in pngs) < MAX_TOTAL_BYTES


def test_replace_block_rewrites_only_between_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(f"# T\n\nbefore\n\n{figures.BEGIN}\nold\n{figures.END}\n\nafter\n")
    figures.replace_block(page, "\nnew ![a](img/a.png)\n")
    assert page.read_text() == (
        f"# T\n\nbefore\n\n{figures.BEGIN}\nnew ![a](img/a.png)\n{figures.END}\n\nafter\n"
    )
