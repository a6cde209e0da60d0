"""`specrun report` on a real job (local Ray, one per module, one worker) interrupted by Ctrl-C in its first prompt and
resumed: the timeline covers every token once after compaction dropped the chunks, the resume is marked where it
happened and nowhere else, the page renders in headless Chromium with no console error and draws every chart, the PNGs
are written; a missing plotting library is named with its pip command.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrun.cli import main
from specrun.decoding.engine import EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs.driver import EXIT_INTERRUPTED, RunOptions, run_job
from specrun.jobs.modelinfo import model_info
from specrun.jobs.submit import JobSettings, prepare_job
from specrun.report import ReportConfig, write_report
from specrun.report.charts import job_charts, prompt_charts
from specrun.report.data import gather, totals

ray = pytest.importorskip("ray")
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
MAX_TOKENS = 600  # long enough that the first prompt cannot finish before the Ctrl-C is acted on
PROMPTS = [{"id": "a", "prompt": "first"}, {"id": "b</script><i>2", "prompt": "second"}]


@pytest.fixture(scope="module")
def job(tiny_models, tmp_path_factory):
    """A job stopped by Ctrl-C once its first prompt has a chunk (the other not started), reported on, then resumed to
    the end."""
    from specrun.actors.pool import init_ray

    d = tmp_path_factory.mktemp("report")
    (d / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    job, _ = prepare_job(d / "prompts.jsonl", d / "job", model_info(tiny_models["llama_mha"]),
                         JobSettings(device="cpu", checkpoint_every=16),
                         SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, ignore_eos=True),
                         EngineConfig(drafters=("ngram", "recycling"), trie_budget=16))

    def interrupt_after_a_chunk():
        while not list((job.root / "progress").glob("*/chunk-*")):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    init_ray(None, num_cpus=max(2, os.cpu_count() or 1))
    try:
        threading.Thread(target=interrupt_after_a_chunk, daemon=True).start()
        # one prompt at a time, so that the second is still waiting when the first checkpoints
        assert run_job(job, RunOptions(actors=1, quiet=True, concurrency=1)).exit_code == EXIT_INTERRUPTED
        interrupted = gather(job)
        files = write_report(job, ReportConfig(d / "interrupted.html", png=False))
        assert [f.name for f in files] == ["interrupted.html"]
        assert run_job(job, RunOptions(actors=1, quiet=True)).exit_code == 0
    finally:
        ray.shutdown()
    return job, interrupted


def _links(page: str) -> list[str]:
    """src and href attributes of the page's own tags (script bodies are not parsed as tags)."""
    found = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.extend(f"{tag} {k}={v}" for k, v in attrs if k in ("src", "href") and not str(v).endswith(".png"))

    Tags().feed(page)
    return found


def _covers(rows, n: int) -> None:
    assert rows and rows[0]["start"] == 0 and rows[-1]["end"] == n
    assert all(a["end"] == b["start"] for a, b in zip(rows, rows[1:]))


def test_the_interrupted_job_reports_what_was_checkpointed(job):
    job, interrupted = job
    started, waiting = sorted(interrupted.prompts, key=lambda p: -p.tokens)
    assert started.state == waiting.state == "pending" and 0 < started.tokens < MAX_TOKENS
    _covers(started.rows, started.tokens)  # the stop's flush got a row: every checkpointed token is in the timeline
    assert {r["attempt"] for r in started.rows} == {1} and started.distinct is not None
    assert waiting.tokens == 0 and waiting.rows == [] and waiting.distinct is None


def test_the_resumed_job_covers_every_token_once_and_marks_each_resume(job):
    job, _ = job
    assert not list((job.root / "progress").glob("*/chunk-*"))  # finished prompts dropped their chunks
    assert [f.name.split(".")[0] for f in (job.root / "timeline").iterdir()] == ["merged"]  # and own timelines
    outputs = {r["id"]: r for r in job.records.read_outputs().to_pylist()}
    rep = gather(job)
    for p in rep.prompts:
        out = outputs[p.id]
        _covers(p.rows, out["n_tokens"])
        assert p.state == "done" and p.distinct == [out[f"distinct_{n}"] for n in range(1, 5)]
        resumed_at = out["resumed_tokens"]
        assert [p.rows[i]["start"] for i in p.resumes] == ([resumed_at] if resumed_at else [])
        last = [r for r in p.rows if r["attempt"] == p.rows[-1]["attempt"]]
        stats = json.loads(out["stats"])
        assert totals(last)["steps"] == out["steps"] == stats["steps"]  # the run that finished, split exactly
        assert totals(last)["widths"] == {int(w): n for w, n in stats["widths"].items()}
        marks = [c.marks for c in prompt_charts(p)]
        assert marks == [[(resumed_at, "resume (attempt 2)")] if resumed_at else []] * 5
    assert sorted(len(p.resumes) for p in rep.prompts) == [0, 1]
    charts = {c.key: c for c in job_charts(rep, max_prompts=20)}
    assert set(charts) == {"speed", "acceptance", "width", "draft", "memory", "timeline", "phases", "drafters",
                           "distinct"}
    for key in ("draft", "memory"):  # every row has its drafting cost and the worker's memory, the pooled curve too
        for series in charts[key].series:
            if series.name != "resume":
                assert series.y and all(y > 0 for y in series.y), (key, series)
    assert len(charts["memory"].series[0].y) == len(rep.prompts[0].rows)
    for key in ("speed", "acceptance", "width", "timeline"):
        names = [s.name for s in charts[key].series]
        assert names[:2] == [p["id"] for p in PROMPTS] and "resume" in names
        resume = next(s for s in charts[key].series if s.name == "resume")
        assert len(resume.x) == 1
    for key in ("phases", "drafters"):  # shares of the job and of each prompt add up to 100 %
        for i in range(1 + len(PROMPTS)):
            assert sum(s.y[i] for s in charts[key].series) == pytest.approx(100.0)


def test_cli_writes_an_offline_page_and_the_pngs(job, tmp_path):
    job, _ = job
    res = CliRunner().invoke(main, ["report", str(job.root), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "r.html").read_text("utf-8")
    assert not _links(page)  # plotly.js is inlined: the page names no script, style or image to fetch
    assert "resume (attempt 2)" in page and "b&lt;/script&gt;&lt;i&gt;2" in page and PROMPTS[1]["id"] not in page
    for key in ("speed", "acceptance", "width", "draft", "memory", "timeline", "phases", "drafters", "distinct"):
        assert (tmp_path / f"r-{key}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert CliRunner().invoke(main, ["report", str(job.root), "--no-png", "--prompts", "1"]).exit_code == 0
    assert "1 more prompt(s)" in (job.root / "report.html").read_text("utf-8")  # the default place: JOB/report.html
    assert not list(job.root.glob("report-*.png"))


def test_a_missing_plotting_library_is_named_with_its_pip_command(job, tmp_path, monkeypatch):
    job, _ = job
    monkeypatch.setitem(sys.modules, "plotly", None)
    res = CliRunner().invoke(main, ["report", str(job.root), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 1 and "pip install 'specrun[report]'" in res.output and "plotly" in res.output
    assert not (tmp_path / "r.html").exists()


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Chromium is not installed (CI installs Debian's)")
def test_the_page_renders_in_headless_chromium_with_every_chart_drawn(job, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    job, _ = job
    page = tmp_path / "report.html"
    write_report(job, ReportConfig(page, png=False))
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,3000"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        driver.get(page.as_uri())
        plots = driver.find_elements(By.CSS_SELECTOR, "div.js-plotly-plot")
        assert len(plots) == 9 + 5 * len(PROMPTS)  # the job's charts, then five per prompt
        for plot in plots:  # drawn: an SVG with a data trace holding a drawn line, marker or bar
            assert plot.find_elements(By.CSS_SELECTOR, "svg.main-svg g.trace path")
        marks = driver.find_elements(By.XPATH, "//*[name()='text' and contains(., 'resume (attempt 2)')]")
        assert len(marks) == 5  # the resumed prompt's five charts
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        assert not errors, errors
        fetched = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert fetched == []  # nothing loaded beside the page itself
        assert driver.save_screenshot(str(tmp_path / "report.png")) and (tmp_path / "report.png").stat().st_size
    finally:
        driver.quit()


@pytest.mark.parametrize("mode", ["lines", "markers", "bars"])
def test_prompt_ids_are_drawn_literally_in_the_pngs(mode):
    """An id is data: `$...$` is not matplotlib mathtext (`$\\frac{$` made savefig raise), ESC is not sent raw."""
    pytest.importorskip("matplotlib")
    from specrun.report.charts import Chart, Series
    from specrun.report.figures import png_bytes

    ids = ["$\\frac{$", "a\x1b[2Jb", "[/bold]"]
    series = [Series(i, ["x", "y"] if mode == "bars" else [1, 2], [1.0, 2.0], mode=mode) for i in ids]
    assert png_bytes(Chart("k", "t", "x", "y", series, barmode="group" if mode == "bars" else None)).startswith(b"\x89PNG")
