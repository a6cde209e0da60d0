"""The report as one HTML page that needs nothing from the network: plotly.js inlined once in <head>, each chart a
plotly div, tables of the numbers, links to the PNGs; every value from the job is HTML-escaped.
"""

from __future__ import annotations

import html
import time

from specrun.decoding.stats import PHASES
from specrun.report.charts import Chart
from specrun.report.data import JobReport, PromptReport, totals

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ccc; } h3 { margin-top: 1.4em; }
table { border-collapse: collapse; margin: .5em 0; font-size: .9em; }
td, th { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: .8em; }
.note { color: #666; font-size: .9em; }
"""


def render_page(rep: JobReport, job_charts: list[Chart], prompt_charts: dict[str, list[Chart]],
                pngs: list[str]) -> str:
    from plotly.offline import get_plotlyjs

    shown = [p for p in rep.prompts if p.id in prompt_charts]
    made = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rep.made_at))
    tot = rep.status
    parts = [
        f"<h1>specrun report: {_e(rep.job)}</h1>",
        f"<p class='note'>model {_e(rep.model)}; made {made}; {tot['done']}/{tot['total']} prompts done, "
        f"{tot['running']} running, {tot['pending']} pending, {tot['failed']} failed. Positions are generated tokens; "
        f"each point is a checkpoint chunk (the first of an attempt includes its prefill).</p>",
        _prompt_table(rep.prompts),
        "<h2>Whole job</h2>",
        _charts(job_charts, "job"),
    ]
    if pngs:
        parts.append("<p class='note'>PNG: " + ", ".join(f"<a href='{_e(n)}'>{_e(n)}</a>" for n in pngs) + "</p>")
    if len(shown) < len(rep.prompts):
        parts.append(f"<p class='note'>{len(rep.prompts) - len(shown)} more prompt(s) count in the job-wide curves "
                     f"and totals only (--prompts N shows more).</p>")
    for i, p in enumerate(shown):
        parts += [f"<h3>{_e(p.id)}</h3>", _detail_table(p), _charts(prompt_charts[p.id], f"p{i}")]
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>specrun report: {_e(rep.job)}"
            f"</title><style>{CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
            + "\n".join(parts) + "</body></html>\n")


def _charts(charts: list[Chart], prefix: str) -> str:
    from specrun.report.figures import plotly_figure

    divs = [plotly_figure(c).to_html(full_html=False, include_plotlyjs=False, div_id=f"{prefix}-{c.key}",
                                     config={"displaylogo": False, "responsive": True}) for c in charts]
    return "<div class='charts'>" + "".join(f"<div>{d}</div>" for d in divs) + "</div>"


def _prompt_table(prompts: list[PromptReport]) -> str:
    head = ("id", "state", "tokens", "attempts", "resumes", "seconds", "tok/s", "acc/step", "finish",
            "Distinct-1", "Distinct-2", "Distinct-3", "Distinct-4")
    rows = []
    for p in prompts:
        t = totals(p.rows)
        d = p.distinct or [None] * 4
        rows.append([p.id, p.state, f"{p.tokens:,}/{p.max_tokens:,}", len({r["attempt"] for r in p.rows}),
                     len(p.resumes), _num(t["seconds"], 1), _num(_div(t["tokens"], t["seconds"]), 1),
                     _num(_div(t["tokens"], t["steps"]), 2), p.finish_reason or "", *(_num(x, 3) for x in d)])
    return _table(head, rows)


def _detail_table(p: PromptReport) -> str:
    t = totals(p.rows)
    covered = t["tokens"]
    lines = []
    if covered < p.tokens:
        lines.append(f"<p class='note'>the timeline covers {covered:,} of {p.tokens:,} tokens (no rows were recorded "
                     f"for the rest: written before timelines existed, a write that failed, or past the last "
                     f"checkpoint of a running prompt).</p>")
    other = max(0.0, t["seconds"] - sum(t["phase"].values()))
    phase = _table(("phase", *PHASES, "other"), [["seconds", *(_num(t["phase"].get(k, 0.0), 2) for k in PHASES),
                                                  _num(other, 2)]])
    srcs = sorted(t["sources"])
    drafted = _table(("tokens by", *srcs), [["tokens", *(f"{t['sources'][s]:,}" for s in srcs)]]) if srcs else ""
    widths = sorted(t["widths"])
    width = _table(("trie width", *map(str, widths)), [["steps", *(f"{t['widths'][w]:,}" for w in widths)]]) \
        if widths else ""
    return "".join(lines) + phase + drafted + width


def _table(head, rows) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _div(a, b):
    return a / b if b else None


def _num(x, digits: int) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _e(x) -> str:
    return html.escape(str(x), quote=True)
