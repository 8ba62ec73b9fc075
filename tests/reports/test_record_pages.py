"""Every table block of every record page equals its rendering from the JSON record behind it,
so that no page in reports/records drifts from its data."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from reports.tables import BLOCK, update

RECORDS = Path(__file__).resolve().parents[2] / "reports" / "records"
PAGES = sorted(p for p in RECORDS.rglob("*.md") if BLOCK.search(p.read_text()))


def test_pages_with_blocks_are_found():
    assert len(PAGES) >= 12, [str(p) for p in PAGES]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(RECORDS)))
def test_page_blocks_equal_their_rendering(page):
    stale = update(page, check=True)
    assert not stale, f"{page}: blocks stale ({', '.join(stale)}); run python -m reports tables {page}"


def test_a_changed_figure_is_found_stale(tmp_path):
    page = next(p for p in PAGES if p.parent == RECORDS)
    text = page.read_text()
    for m in BLOCK.finditer(text):
        src, dst = page.parent / m.group("path"), tmp_path / m.group("path")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copy(src, dst)
    md = tmp_path / page.name
    md.write_text(text)
    m = BLOCK.search(text)
    body = m.group("body")
    digit = next(i for i, ch in enumerate(body) if ch.isdigit() and i > body.index("\n\n"))
    changed = body[:digit] + str((int(body[digit]) + 1) % 10) + body[digit + 1:]
    md.write_text(text[:m.start("body")] + changed + text[m.end("body"):])
    assert update(md, check=True) == [m.group("path")]
    assert md.read_text() != text          # check writes nothing
    assert update(md) == [m.group("path")]
    assert md.read_text() == text          # the rewrite restores the rendering
