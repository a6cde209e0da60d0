"""`specrun report`: a job's timelines (storage/timeline.py) as one offline HTML page (plotly) and PNGs (matplotlib).

Read-only on the job (the page may go into its folder, never over its files); the plotting libraries are the optional
extra specrun[report], imported only when a report is made (ReportError names the pip command when they are missing).
The page and each PNG are written atomically.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from specrun.errors import SpecrunError
from specrun.jobs.jobdir import JobDir
from specrun.storage.atomic import atomic_write_bytes, output_target

NEEDS = ("plotly", "matplotlib")
INSTALL = "pip install 'specrun[report]'"


class ReportError(SpecrunError):
    """What the user must do to get a report (message says what and how)."""


@dataclass(frozen=True)
class ReportConfig:
    output: Path  # the HTML page; PNGs go beside it as <stem>-<chart>.png
    max_prompts: int = 20  # prompts (input order) with their own section and line in the job charts
    png: bool = True

    def __post_init__(self):
        if self.max_prompts < 0:
            raise ValueError(f"max_prompts={self.max_prompts} must be >= 0")
        if self.output.is_dir():
            raise ValueError(f"report output {self.output} is a directory; give a file name such as report.html")


def require() -> None:
    for name in NEEDS:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ReportError(f"specrun report needs {' and '.join(NEEDS)} ({name} cannot be imported: {e}); "
                              f"install them with: {INSTALL}") from None


def check_output(job: JobDir, output: Path) -> Path:
    """The page's file as written (a symlink followed), or ValueError: a device or pipe (a rename would destroy it,
    and its PNGs have no folder), or in the job's folder anything but an .html page beside its files (the default
    JOB/report.html): over the job's own files (manifest, prompts, lock, records) the job could not be read again."""
    real, regular = output_target(output)
    if not regular:
        raise ValueError(f"report output {output} is not a regular file (a device or pipe?): give a file name such "
                         f"as report.html")
    if isinstance(job.root, Path):
        root = job.root.resolve()
        if real.is_relative_to(root) and (real.parent != root or real.suffix.lower() not in (".html", ".htm")):
            raise ValueError(f"report output {output} would go among the job's own files in {job.root}: write it "
                             f"elsewhere, or as {job.root / 'report.html'}")
    return real


def write_report(job: JobDir, config: ReportConfig) -> list[Path]:
    """Write the page (and the job charts as PNGs); returns the files written, the page first."""
    output = check_output(job, config.output)
    require()
    from specrun.report.charts import job_charts, prompt_charts
    from specrun.report.data import gather
    from specrun.report.figures import png_bytes
    from specrun.report.page import render_page

    rep = gather(job)
    charts = job_charts(rep, config.max_prompts)
    pngs = []
    if config.png:
        for c in charts:
            pngs.append(atomic_write_bytes(output.with_name(f"{output.stem}-{c.key}.png"), png_bytes(c)))
    per_prompt = {p.id: prompt_charts(p) for p in rep.prompts[:config.max_prompts]}
    page = render_page(rep, charts, per_prompt, [p.name for p in pngs])
    return [atomic_write_bytes(output, page.encode("utf-8")), *pngs]
