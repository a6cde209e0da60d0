"""`specrun status --watch`: the table again every interval until no prompt is left to run (exit 0, or 1 with failed
prompts), Ctrl-C leaves (130); plain tables off a terminal, one table redrawn in place (rich Live) on one."""

from __future__ import annotations

import io
import re

import pytest
from click.testing import CliRunner
from rich.console import Console

from specrun.cli import main
from specrun.decoding.engine import EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs import watch as watch_mod
from specrun.jobs.modelinfo import model_info
from specrun.jobs.submit import JobSettings, prepare_job
from specrun.storage.records import output_row


@pytest.fixture
def job(tmp_path, tiny_models):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n')
    job, _ = prepare_job(p, tmp_path / "job", model_info(tiny_models["llama_mha"]), JobSettings(),
                         SamplingParams(max_tokens=10), EngineConfig())
    _finish(job, "a")
    return job


def _finish(job, pid: str) -> None:
    job.records.write_output(output_row(pid, [7, 8, 9], "xyz", "length", {"steps": 2}, prompt_tokens=3,
                                        resumed_tokens=0, attempts=1))


def _totals(out: str) -> list[str]:
    return re.findall(r"^\d+/\d+ done, .*$", out, flags=re.MULTILINE)


def test_watch_shows_the_table_until_the_job_is_done(job, monkeypatch):
    waits = []

    def sleep(s):  # the job advances while the watcher waits
        waits.append(s)
        if len(waits) == 2:
            _finish(job, "b")

    monkeypatch.setattr(watch_mod, "sleep", sleep)
    r = CliRunner().invoke(main, ["status", str(job.root), "--watch", "--interval", "0.5"])
    assert r.exit_code == 0, r.output
    assert waits == [0.5, 0.5]
    totals = _totals(r.output)
    assert [t.split(";")[0] for t in totals] == ["1/2 done, 0 running, 1 pending, 0 failed"] * 2 + [
        "2/2 done, 0 running, 0 pending, 0 failed"]
    assert r.output.count("no driver running") == 3


def test_watch_ends_with_status_1_when_prompts_failed_and_no_driver_runs(job, monkeypatch):
    job.records.mark_failed("b", "ValueError: boom", 3)
    monkeypatch.setattr(watch_mod, "sleep", lambda s: pytest.fail("a finished job is not watched again"))
    r = CliRunner().invoke(main, ["status", str(job.root), "--watch"])
    assert r.exit_code == 1, r.output
    assert [t.split(";")[0] for t in _totals(r.output)] == ["1/2 done, 0 running, 0 pending, 1 failed"]
    assert "boom" in r.output


def test_ctrl_c_leaves_the_watch(job, monkeypatch):
    def sleep(s):
        raise KeyboardInterrupt

    monkeypatch.setattr(watch_mod, "sleep", sleep)
    r = CliRunner().invoke(main, ["status", str(job.root), "--watch"])
    assert r.exit_code == 130 and len(_totals(r.output)) == 1


def test_watch_and_json_are_refused_together(job):
    r = CliRunner().invoke(main, ["status", str(job.root), "--watch", "--json"])
    assert r.exit_code != 0 and "--json" in r.output
    r = CliRunner().invoke(main, ["status", str(job.root), "--watch", "--interval", "0"])
    assert r.exit_code != 0 and "--interval" in r.output


def test_on_a_terminal_the_table_is_redrawn_in_place(job, monkeypatch):
    buf = io.StringIO()
    console = Console(force_terminal=True, file=buf, width=160, color_system=None)
    monkeypatch.setattr(watch_mod, "sleep", lambda s: _finish(job, "b"))
    st = watch_mod.watch(job, console, 1.0)
    assert st["totals"]["done"] == 2
    out = buf.getvalue()
    assert "\x1b[?25l" in out  # rich Live hid the cursor, and redraws over the previous table
    final = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.rsplit("\x1b[2K", 1)[-1])
    assert _totals(final)[0].startswith("2/2 done") and "pending" not in final.split("2/2 done")[0]
