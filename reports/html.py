"""Self-contained HTML reports: Jinja2 templates, figures embedded as inline SVG
so that one file opens offline in any browser.

A report is a list of ``Section``; each stage of the flow has a module in
``reports/sections`` that turns its results into sections (registered by result
kind in ``reports.sections.REGISTRY``).
"""
from __future__ import annotations

import datetime as _dt
import html
import io
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend chosen first)
import pandas as pd  # noqa: E402

from calibrate.outputs import write_atomic  # noqa: E402


@dataclass
class Section:
    title: str
    blocks: list[str] = field(default_factory=list)  # trusted HTML fragments, in order

    def text(self, paragraph: str) -> "Section":
        self.blocks.append(f"<p>{html.escape(paragraph)}</p>")
        return self

    def heading(self, title: str) -> "Section":
        self.blocks.append(f"<h3>{html.escape(title)}</h3>")
        return self

    def figure(self, fig, caption: str = "") -> "Section":
        self.blocks.append(figure_html(fig, caption))
        return self

    def table(self, df: pd.DataFrame, caption: str = "", float_format: str = "{:.4g}") -> "Section":
        self.blocks.append(table_html(df, caption, float_format))
        return self


def figure_html(fig, caption: str = "") -> str:
    """A matplotlib figure as an inline SVG inside <figure>; the figure is closed."""
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none"}):  # text as text (searchable, selectable), not paths
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.find("<svg"):]  # drop the XML prolog and doctype
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure class="fig">{svg}{cap}</figure>'


# a size at or above this is the open end of a range (profiles write 2**62 for "no upper bound")
OPEN_END_BYTES = 2 ** 62


def size_text(nbytes: float) -> str:
    """Bytes for people: 512 B, 1.5 KiB, 64 MiB, 2 GiB; the open end as "no limit"."""
    if nbytes >= OPEN_END_BYTES:
        return "no limit"
    for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.0f} B"


def time_text(seconds: float) -> str:
    """Seconds for people: 850 ns, 12.5 us, 3.2 ms, 1.25 s."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns" if seconds else "0 s"


def _is_bytes(column: str) -> bool:
    c = column.lower()
    return c == "bytes" or c.endswith("_bytes") or c.endswith(" bytes") or c in ("size", "min_bytes", "max_bytes")


def _is_seconds(column: str) -> bool:
    c = column.lower()
    return c.endswith("_s") and not c.endswith("_bps")


def cell_text(v, column: str = "", float_format: str = "{:.4g}"):
    """One table cell for people: sizes in KiB/MiB/GiB (bytes columns), times with units (``*_s``
    columns), yes/no for booleans, "-" for missing and not-finite numbers, lists and objects spelled
    out; other numbers by ``float_format``."""
    import math

    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float) and not math.isfinite(v):
        return "-"
    if isinstance(v, (int, float)) and _is_bytes(column):
        return size_text(float(v))
    if isinstance(v, (int, float)) and _is_seconds(column):
        return time_text(float(v))
    if isinstance(v, float):
        if abs(v) >= OPEN_END_BYTES:
            return "no limit"
        return float_format.format(v)
    if isinstance(v, dict):
        return ", ".join(f"{k}: {cell_text(x, str(k), float_format)}" for k, x in v.items()) or "-"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(cell_text(x, column, float_format)) for x in v) or "-"
    return v


def table_html(df: pd.DataFrame, caption: str = "", float_format: str = "{:.4g}") -> str:
    shown = df.copy()
    for column in shown.columns:
        shown[column] = [cell_text(v.item() if hasattr(v, "item") else v, str(column), float_format)
                         for v in df[column]]
    body = shown.astype(str).to_html(index=False, escape=True, border=0, classes="data")
    cap = f"<p class='caption'>{html.escape(caption)}</p>" if caption else ""
    return f"{cap}<div class='tablewrap'>{body}</div>"


_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("reports", "templates"),
    autoescape=jinja2.select_autoescape(["html", "j2"]),
)


def render(title: str, sections: list[Section], sources: list[str] | None = None) -> str:
    template = _ENV.get_template("report.html.j2")
    return template.render(
        title=title,
        sections=sections,
        sources=sources or [],
        generated=_dt.datetime.now().isoformat(timespec="seconds"),
    )


def write_report(path: str | Path, title: str, sections: list[Section], sources: list[str] | None = None) -> Path:
    path = Path(path)
    write_atomic(path, render(title, sections, sources), "report")
    return path
