"""Reports open in a real browser: headless Chromium loads the HTML, every figure
(inline <svg> in <figure class="fig">) is laid out with a non-zero size, and the
console shows no error. Observed over the DevTools protocol (see headless_chromium)."""
from __future__ import annotations

import re
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from headless_chromium import find_chromium, inspect_report
from integration_env import require
from reports.html import Section, write_report


@pytest.fixture(scope="module")
def chromium() -> str:
    binary = find_chromium()
    require(binary is not None, "no chromium: apt-get install chromium (Debian) to run the browser tests")
    return binary


def figures_in_source(html: str) -> int:
    return len(re.findall(r'<figure class="fig">', html))


def assert_renders(chromium: str, report: Path, profile_dir: Path) -> list[dict]:
    figures, errors = inspect_report(chromium, report, profile_dir)
    assert not errors, "console errors:\n" + "\n".join(f"[{m.source}] {m.text}" for m in errors)
    assert len(figures) == figures_in_source(report.read_text()), "the browser lost figures"
    for i, fig in enumerate(figures):
        assert fig["svg"], f"figure {i}: no SVG element rendered"
        assert fig["width"] > 0 and fig["height"] > 0, f"figure {i}: rendered with size {fig}"
        assert fig["children"] > 0, f"figure {i}: empty SVG"
    return figures


def test_report_framework_renders(chromium, tmp_path):
    """A report made with reports.html (matplotlib SVG figures and a table)."""
    sections = []
    for title in ("alpha-beta fit", "busbw"):
        fig, ax = plt.subplots(figsize=(5, 3))
        sizes = [2 ** k for k in range(10, 21)]
        ax.loglog(sizes, [1e-5 + n / 1e10 for n in sizes], marker="o", label="allreduce")
        ax.set_xlabel("bytes")
        ax.legend()
        sections.append(Section(title).text("measured against the model").figure(fig, caption=title)
                        .table(pd.DataFrame({"bytes": sizes[:3], "time_s": [1e-5, 2e-5, 3e-5]})))
    report = write_report(tmp_path / "report.html", "fixture", sections)
    figures = assert_renders(chromium, report, tmp_path / "chromium")
    assert len(figures) == 2


def test_harness_sees_broken_figures_and_console_errors(chromium, tmp_path):
    """The check can fail: a script error, a console.error, a missing resource
    and an SVG without size are all reported."""
    page = tmp_path / "broken.html"
    page.write_text("""<!DOCTYPE html><html><head><meta charset="utf-8"></head><body>
<figure class="fig"><svg xmlns="http://www.w3.org/2000/svg" width="0" height="0"><path d="M0 0L1 1"/></svg></figure>
<figure class="fig"><svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 10 10" width="100">
<rect width="5" height="5"/></svg></figure>
<img src="missing.png">
<script>console.error("bad figure data"); undefinedFunction();</script>
</body></html>""")
    figures, errors = inspect_report(chromium, page, tmp_path / "chromium")
    assert [f["width"] for f in figures] == [0, 100]
    texts = " | ".join(m.text for m in errors)
    assert "bad figure data" in texts
    assert "undefinedFunction" in texts
    assert "ERR_FILE_NOT_FOUND" in texts
    with pytest.raises(AssertionError):
        assert_renders(chromium, page, tmp_path / "chromium2")


@pytest.mark.slow
def test_calibration_report_renders(chromium, calibration, tmp_path):
    """The report that `python -m reports` wrote for a real 4-rank calibration."""
    figures = assert_renders(chromium, calibration.report, tmp_path / "chromium")
    assert len(figures) >= 1
