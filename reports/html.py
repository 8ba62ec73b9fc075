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
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.find("<svg"):]  # drop the XML prolog and doctype
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure class="fig">{svg}{cap}</figure>'


def table_html(df: pd.DataFrame, caption: str = "", float_format: str = "{:.4g}") -> str:
    def fmt(v):
        if isinstance(v, float):
            return float_format.format(v)
        return v

    body = df.map(fmt).to_html(index=False, escape=True, border=0, classes="data")
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
