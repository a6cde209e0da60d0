"""The report's charts as plain data (Chart, Series), built once from report.data and drawn by two renderers: plotly for
the page (figures.py) and matplotlib for the PNGs (png.py), so both show the same numbers.

Job charts: one line per shown prompt plus the pooled job curve, resumes as markers; per prompt: the same curves with
each resume as a labelled vertical line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specrun.decoding.stats import PHASES
from specrun.report.data import TARGET, JobReport, PromptReport, pooled_rates, rates, totals

JOB = "all prompts"
POSITION = "generated tokens"
CURVES = (("speed", "tokens_per_s", "Tokens per second", "tok/s"),
          ("acceptance", "accepted", "Accepted tokens per step", "tokens / step"),
          ("width", "width", "Trie width chosen", "nodes (mean per chunk)"),
          ("draft", "draft_ms", "Drafting per drafted node", "ms"),
          ("memory", "rss_mb", "Worker memory (resident)", "MB"))


@dataclass(frozen=True)
class Series:
    name: str
    x: list
    y: list
    mode: str = "lines"  # lines | markers (resumes) | bars
    bold: bool = False  # the job-wide curve


@dataclass(frozen=True)
class Chart:
    key: str  # the div id and the PNG's name part
    title: str
    x_title: str
    y_title: str
    series: list[Series]
    barmode: str | None = None  # stack | group, for bar charts
    marks: list[tuple[float, str]] = field(default_factory=list)  # labelled vertical lines (resumes)


def job_charts(rep: JobReport, max_prompts: int) -> list[Chart]:
    shown = rep.prompts[:max_prompts]
    pooled = pooled_rates(rep.prompts)
    charts = []
    for key, metric, title, unit in CURVES:
        series, resumed = [], []
        for p in shown:
            r = rates(p.rows)
            if p.rows:
                series.append(Series(p.id, *_xy(r, metric)))
            resumed += [(r["x"][i], r[metric][i]) for i in p.resumes if r[metric][i] is not None]
        if resumed:
            series.append(Series("resume", *map(list, zip(*resumed)), mode="markers"))
        series.append(Series(JOB, *_xy(pooled, metric), bold=True))
        charts.append(Chart(key, title, POSITION, unit, series))
    return [*charts, _wall_clock(shown), *_breakdowns(rep, shown)]


def prompt_charts(p: PromptReport) -> list[Chart]:
    r = rates(p.rows)
    marks = [(p.rows[i]["start"], f"resume (attempt {p.rows[i]['attempt']})") for i in p.resumes]
    return [Chart(key, title, POSITION, unit, [Series(p.id, *_xy(r, metric))], marks=marks)
            for key, metric, title, unit in CURVES]


def _xy(r: dict, metric: str) -> tuple[list, list]:
    """Points with a value (a row of no steps or seconds has none)."""
    pts = [(x, y) for x, y in zip(r["x"], r[metric]) if y is not None]
    return [x for x, _ in pts], [y for _, y in pts]


def _wall_clock(shown: list[PromptReport]) -> Chart:
    """Checkpointed tokens against minutes since the first row: an interruption is a flat stretch, then a resume."""
    starts = [r["ended_at"] - r["seconds"] for p in shown for r in p.rows]
    t0 = min(starts, default=0.0)
    series, resumed = [], []
    for p in shown:
        x, y = [], []
        begins = {0, *p.resumes}
        for i, r in enumerate(p.rows):
            if i in begins:  # where the attempt began
                x.append((r["ended_at"] - r["seconds"] - t0) / 60)
                y.append(r["start"])
                if i:
                    resumed.append((x[-1], y[-1]))
            x.append((r["ended_at"] - t0) / 60)
            y.append(r["end"])
        if x:
            series.append(Series(p.id, x, y))
    if resumed:
        series.append(Series("resume", *map(list, zip(*resumed)), mode="markers"))
    return Chart("timeline", "Checkpointed tokens over time", "minutes (flat: not running)", "tokens", series)


def _breakdowns(rep: JobReport, shown: list[PromptReport]) -> list[Chart]:
    """Time per phase and tokens per source as % (job first, then each shown prompt), and Distinct-1..4."""
    names = [JOB, *(p.id for p in shown)]
    sums = [totals([r for p in rep.prompts for r in p.rows]), *(totals(p.rows) for p in shown)]
    phases = [*PHASES, "other"]
    for t in sums:
        t["phase"]["other"] = max(0.0, t["seconds"] - sum(t["phase"].values()))
    sources = sorted({s for t in sums for s in t["sources"]}, key=lambda s: (s != TARGET, s))
    with_d = [p for p in rep.prompts if p.distinct]
    distinct = [[sum(p.distinct[n] for p in with_d) / len(with_d)] if with_d else [None] for n in range(4)]
    for n in range(4):
        distinct[n] += [p.distinct[n] if p.distinct else None for p in shown]
    return [
        Chart("phases", "Time per phase", "", "% of generation seconds",
              [Series(ph, names, [_pct(t["phase"].get(ph, 0.0), t["seconds"]) for t in sums], "bars")
               for ph in phases], barmode="stack"),
        Chart("drafters", "Tokens per drafter", "target: chosen by the verify forward itself", "% of tokens",
              [Series(s, names, [_pct(t["sources"].get(s, 0), t["tokens"]) for t in sums], "bars") for s in sources],
              barmode="stack"),
        Chart("distinct", "Distinct-1..4", "all prompts: the mean of the prompts'", "distinct / all n-grams",
              [Series(f"Distinct-{n + 1}", names, distinct[n], "bars") for n in range(4)], barmode="group"),
    ]


def _pct(a: float, b: float) -> float:
    return 100.0 * a / b if b else 0.0
