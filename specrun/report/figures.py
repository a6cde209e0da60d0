"""Charts (charts.py) as plotly figures and as PNG images (matplotlib, no browser needed): the page's interactive
plots and the files beside it.
"""

from __future__ import annotations

import io
import math

from specrun.jobs.printable import printable
from specrun.report.charts import Chart

PNG_SIZE = (10, 4.8)  # inches, at 100 dpi


def plotly_figure(chart: Chart):
    import plotly.graph_objects as go

    fig = go.Figure()
    for s in chart.series:
        if s.mode == "bars":
            fig.add_trace(go.Bar(name=s.name, x=s.x, y=s.y))
        elif s.mode == "markers":
            fig.add_trace(go.Scatter(name=s.name, x=s.x, y=s.y, mode="markers",
                                     marker={"symbol": "x", "size": 11, "color": "black"}))
        else:
            fig.add_trace(go.Scatter(name=s.name, x=s.x, y=s.y, mode="lines+markers",
                                     line={"width": 4 if s.bold else 1.5}, marker={"size": 4}))
    for x, label in chart.marks:
        fig.add_vline(x=x, line_dash="dash", line_color="firebrick", annotation_text=label,
                      annotation_position="top left")
    fig.update_layout(title=chart.title, xaxis_title=chart.x_title, yaxis_title=chart.y_title,
                      barmode=chart.barmode, template="plotly_white", height=380,
                      margin={"l": 60, "r": 20, "t": 50, "b": 50}, legend={"font": {"size": 10}})
    return fig


def png_bytes(chart: Chart) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=PNG_SIZE, dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    bars = [s for s in chart.series if s.mode == "bars"]
    if bars:
        _bars(ax, bars, chart.barmode)
    for s in chart.series:
        if s.mode == "markers":
            ax.scatter(s.x, s.y, marker="x", s=60, color="black", label=_text(s.name), zorder=3)
        elif s.mode == "lines":
            ax.plot(s.x, s.y, marker=".", lw=3.5 if s.bold else 1.2, label=_text(s.name), zorder=2 if s.bold else 1)
    for x, label in chart.marks:
        ax.axvline(x, ls="--", color="firebrick")
        ax.annotate(label, (x, 1), xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points",
                    color="firebrick", fontsize=8)
    ax.set_title(chart.title, fontsize=11)
    ax.set_xlabel(chart.x_title)
    ax.set_ylabel(chart.y_title)
    ax.grid(alpha=0.3)
    if chart.series:
        ax.legend(fontsize=7, ncol=1 + len(chart.series) // 12, loc="best")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def _text(name) -> str:
    """A prompt id as matplotlib draws it literally: control characters escaped, `$` not starting mathtext (an id
    such as `$\\frac{` made savefig raise)."""
    return printable(name).replace("$", r"\$")


def _bars(ax, bars, barmode: str | None) -> None:
    """Categories on x (every bar series shares them), stacked or side by side."""
    labels = bars[0].x
    at = range(len(labels))
    width = 0.8 / (len(bars) if barmode == "group" else 1)
    bottom = [0.0] * len(labels)
    for k, s in enumerate(bars):
        y = [math.nan if v is None else v for v in s.y]
        if barmode == "group":
            ax.bar([i - 0.4 + (k + 0.5) * width for i in at], y, width, label=_text(s.name))
        else:
            ax.bar(list(at), y, width, bottom=bottom, label=_text(s.name))
            bottom = [b + (0.0 if math.isnan(v) else v) for b, v in zip(bottom, y)]
    ax.set_xticks(list(at), [_text(str(x)[:24]) for x in labels], rotation=30 if len(labels) > 4 else 0, ha="right"
                  if len(labels) > 4 else "center", fontsize=8)
