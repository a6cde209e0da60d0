"""What a run shows: plain progress lines (unchanged), quiet, and rich bars drawn on a terminal console (one for the
job, one per running prompt with tokens/max, tok/s, accepted/step and ETA), from snapshots and from a real run."""

from __future__ import annotations

import io
import json
import re

from rich.console import Console

from specrun.jobs.progress import PlainView, QuietView, Snapshot, make_view
from specrun.jobs.rich_view import RichView

SNAP = Snapshot(total_prompts=3, done_prompts=1, tokens=25, total_tokens=30, running={
    "a[x]": {"tokens": 5, "max_tokens": 10, "tokens_per_s": 2.0, "mean_accepted": 1.5}})
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _terminal() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(force_terminal=True, file=buf, width=160, color_system=None), buf


def _last_frame(buf: io.StringIO) -> list[str]:
    """The lines rich drew last (each redraw starts by erasing the previous one with ESC[2K)."""
    frame = buf.getvalue().rsplit("\x1b[2K", 1)[-1]
    return [" ".join(line.split()) for line in _ANSI.sub("", frame).splitlines() if line.strip()]


def test_plain_progress_lines_and_quiet(capsys):
    d = PlainView(every_s=0.0)
    d.update(SNAP)
    d.log("hello")
    out = capsys.readouterr().out
    assert "prompts 1/3 done, 1 running; tokens 25/30; 2 tok/s" in out and "hello" in out
    q = QuietView()
    q.update(SNAP)
    q.log("hidden")
    q.warn("a warning")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "a warning\n"
    assert type(make_view(quiet=True)) is QuietView  # not isinstance: PlainView is a QuietView too
    assert type(make_view(quiet=False)) is PlainView  # pytest's stdout is not a terminal


def test_rich_bars_show_the_job_and_each_running_prompt():
    console, buf = _terminal()
    view = RichView(console)
    view.update(SNAP)
    view.warn("odd [id] kept as written")
    view.close()
    lines = _last_frame(buf)
    assert re.fullmatch(r"job: 1/3 prompts done ━+ 25/30 tokens 2\.0 tok/s ETA 0m02s", lines[0])
    assert re.fullmatch(r"a\[x\] ━+ 5/10 2\.0 tok/s 1\.50 acc/step ETA 0m02s", lines[1])
    assert len(lines) == 2
    assert "odd [id] kept as written" in _ANSI.sub("", buf.getvalue())


def test_rich_bars_follow_prompts_that_finish_and_start():
    console, buf = _terminal()
    view = RichView(console)
    view.update(SNAP)
    view.update(Snapshot(3, 2, 1_203, 1_230, {
        "b": {"tokens": 1_000, "max_tokens": 1_010, "tokens_per_s": 4.0, "mean_accepted": 2.25},
        "c": {"tokens": 0, "max_tokens": 10, "tokens_per_s": 0.0, "mean_accepted": 0.0}}))
    view.close()
    lines = _last_frame(buf)
    assert lines[0].startswith("job: 2/3 prompts done") and lines[0].endswith("1,203/1,230 tokens 4.0 tok/s ETA 0m06s")
    assert [line.split()[0] for line in lines[1:]] == ["b", "c"]  # a finished: its bar is gone
    assert lines[1].endswith("1,000/1,010 4.0 tok/s 2.25 acc/step ETA 0m02s")
    assert lines[2].endswith("0/10 0.0 tok/s 0.00 acc/step ETA -")


def test_a_view_never_used_draws_nothing():
    console, buf = _terminal()
    RichView(console).close()
    assert buf.getvalue() == ""


def test_a_run_draws_its_final_counts_on_a_rich_view(tmp_path, tiny_models, local_ray):
    from specrun.decoding.engine import EngineConfig
    from specrun.decoding.verify.params import SamplingParams
    from specrun.jobs.driver import RunOptions, run_job
    from specrun.jobs.modelinfo import model_info
    from specrun.jobs.submit import JobSettings, prepare_job

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "one", "prompt": "abc"}) + "\n"
                    + json.dumps({"id": "two", "prompt": "xyz", "max_tokens": 7}) + "\n")
    job, _ = prepare_job(path, tmp_path / "job", model_info(tiny_models["llama_mha"]), JobSettings(),
                         SamplingParams(max_tokens=12, ignore_eos=True), EngineConfig())
    console, buf = _terminal()
    assert run_job(job, RunOptions(actors=1), RichView(console)).exit_code == 0
    lines = _last_frame(buf)
    assert lines[0].startswith("job: 2/2 prompts done") and "19/19 tokens" in lines[0]
    assert len(lines) == 1  # no prompt is running any more
    text = _ANSI.sub("", buf.getvalue())
    assert "2 prompts to run on 1 worker(s)" in text and "2 prompt(s) finished, 0 failed" in text
