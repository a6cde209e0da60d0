"""Inputs that cannot work are refused before anything is written or started, naming the fault: drafting settings a
worker would refuse, names of undecodable bytes, a pipe without --job-dir, a job dir under a file, an export or report
over the job's own files or one replacing a link or pipe, and `specrun generate`'s prompt file and stop tokens (one
error line, never an internal error).
"""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import threading

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from specrun.cli import main
from specrun.cli.generate import read_prompt
from tests.cli.test_jobs_cli import model  # noqa: F401 (a fixture)


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": "Once upon a time"}) + "\n")
    return p


def _run(args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _refused(res, fault: str) -> None:
    assert res.exit_code in (1, 2), res.output
    assert fault in res.output and "internal error" not in res.output, res.output


@pytest.mark.parametrize("flags, fault", [
    (["--draft", "heads"], "drafter 'heads' needs trained draft heads"),
    (["--draft", "fused,ngram"], "drafter 'fused' needs trained draft heads"),
    (["--heads", "{empty}"], "has no heads.json"),
    (["--draft", "recurrent", "--drafter", "none"], "--drafter none was given"),
    (["--draft", ""], "names no drafter"), (["--draft", " , "], "names no drafter"),
    (["--stop", "end\udcff"], "lone surrogate"),
])
def test_submit_refuses_settings_a_worker_would_refuse_before_writing_the_job(model, prompts, tmp_path,  # noqa: F811
                                                                                 flags, fault):
    (tmp_path / "empty").mkdir()
    job = tmp_path / "job"
    flags = [f.format(empty=tmp_path / "empty") for f in flags]
    _refused(_run(["submit", prompts, "--model", model, "--max-tokens", "4", "--job-dir", job, "-q", *flags]), fault)
    assert not job.exists()


def test_submit_refuses_hot_start_folders_that_are_no_jobs_and_columns_for_json_lines(model, prompts,  # noqa: F811
                                                                                       tmp_path):
    job = tmp_path / "job"
    _refused(_run(["submit", prompts, "--model", model, "--max-tokens", "4", "--job-dir", job, "-q", "--hot-start",
                   tmp_path]), "is not a specrun job (no job.json)")
    _refused(_run(["submit", prompts, "--model", model, "--max-tokens", "4", "--job-dir", job, "-q", "--prompt-column",
                   "text"]), "read Parquet files, and this is not one")
    assert not job.exists()


def test_submit_refuses_a_name_of_undecodable_bytes_and_a_pipe_without_job_dir(model, prompts,  # noqa: F811
                                                                               tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    latin = os.fsdecode(b"caf\xe9.jsonl")  # a Latin-1 name: its byte 0xe9 a surrogate escape
    (tmp_path / latin).write_bytes(prompts.read_bytes())
    _refused(_run(["submit", latin, "--model", model, "--max-tokens", "4", "-q"]), "is not valid UTF-8")
    r, w = os.pipe()
    try:
        os.write(w, prompts.read_bytes())
        os.close(w)
        _refused(_run(["submit", f"/dev/fd/{r}", "--model", model, "--max-tokens", "4", "-q"]), "give --job-dir")
    finally:
        os.close(r)
    assert not (tmp_path / "specrun-jobs").exists()


def test_submit_names_a_job_dir_it_cannot_create(model, prompts, tmp_path):  # noqa: F811
    (tmp_path / "a_file").write_text("x")
    job = tmp_path / "a_file" / "j" / "k"
    _refused(_run(["submit", prompts, "--model", model, "--max-tokens", "4", "-q", "--job-dir", job]),
             f"cannot create the job in {job}: {tmp_path / 'a_file'} is a file, not a folder")
    assert (tmp_path / "a_file").read_text() == "x"


def test_export_refuses_the_jobs_own_files_and_missing_folders(model, prompts, tmp_path):  # noqa: F811
    job = tmp_path / "job"
    res = _run(["submit", prompts, "--model", model, "--max-tokens", "4", "--job-dir", job, "-q", "--draft", "none"])
    assert res.exit_code == 0, res.output
    manifest = (job / "job.json").read_bytes()
    for out in (job / "job.json", job, job / "outputs" / "x.jsonl"):
        _refused(_run(["export", job, "-o", out]), "is inside the job")
    _refused(_run(["export", job, "-o", tmp_path / "no" / "such" / "x.jsonl"]), "does not exist")
    assert _run(["export", job, "-o", job / ".." / "beside.jsonl"]).exit_code == 0  # outside, once resolved
    assert (job / "job.json").read_bytes() == manifest and not (tmp_path / "no").exists()
    res = _run(["export", job, "-o", tmp_path / "out.jsonl"])
    assert res.exit_code == 0 and json.loads((tmp_path / "out.jsonl").read_text())["id"] == "a"


def test_export_writes_through_a_link_and_into_a_pipe_and_report_never_over_the_jobs_files(model, prompts,  # noqa: F811
                                                                                            tmp_path):
    """-o follows a symlink (the link stays) and writes a FIFO in place (a rename would replace it); report refuses
    the job's own files and a pipe, as export refuses them, before it needs its plotting libraries."""
    job = tmp_path / "job"
    assert _run(["submit", prompts, "--model", model, "--max-tokens", "4", "--job-dir", job, "-q",
                 "--draft", "none"]).exit_code == 0
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "target.jsonl")
    assert _run(["export", job, "-o", tmp_path / "link.jsonl"]).exit_code == 0
    assert (tmp_path / "link.jsonl").is_symlink() and json.loads((tmp_path / "target.jsonl").read_text())["id"] == "a"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)  # blocked if it were replaced
    reader.start()
    assert _run(["export", job, "-o", fifo]).exit_code == 0
    reader.join(timeout=30)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and json.loads(got[0])["id"] == "a"
    got.clear()
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert _run(["export", job, "--format", "parquet", "-o", fifo]).exit_code == 0  # a stream: no seeks
    reader.join(timeout=30)
    assert pq.read_table(io.BytesIO(got[0])).column("id").to_pylist() == ["a"]
    manifest = (job / "job.json").read_bytes()
    for out in (job / "job.json", job / "outputs" / "r.html", job / "prompts.parquet", job / "detached.json"):
        _refused(_run(["report", job, "--no-png", "-o", out]), "would go among the job's own files")
    _refused(_run(["report", job, "--no-png", "-o", fifo]), "is not a regular file")
    assert (job / "job.json").read_bytes() == manifest and stat.S_ISFIFO(fifo.stat().st_mode)


def test_export_into_a_pipe_its_reader_closed_exits_quietly(model, prompts, tmp_path):  # noqa: F811
    """`specrun export JOB | head`: the reader gone, export stops as coreutils do (SIGPIPE's status, no message)."""
    job = tmp_path / "job"
    assert _run(["submit", prompts, "--model", model, "--max-tokens", "4", "--job-dir", job, "-q",
                 "--draft", "none"]).exit_code == 0
    r, w = os.pipe()
    os.close(r)  # the reader gone before export starts
    try:
        p = subprocess.Popen([sys.executable, "-c", "from specrun.cli import main; main()", "export", str(job)],
                             stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 141 and b"Error:" not in err and b"BrokenPipe" not in err, err
    # another pipe's reader gone while stdout is a live pipe: an error, not hidden as the reader of stdout leaving
    boom = ("import os\nfrom specrun.cli import main\n@main.command('boom')\ndef boom():\n"
            "    r, w = os.pipe()\n    os.close(r)\n    os.write(w, b'x')\nmain()\n")
    res = subprocess.run([sys.executable, "-c", boom, "boom"], capture_output=True, timeout=120, check=False)
    assert res.returncode == 1 and b"Error: BrokenPipeError: Broken pipe" in res.stderr, res.stderr


def test_generate_names_a_prompt_file_of_bad_utf8_and_a_stop_token_past_the_vocabulary(model, tmp_path):  # noqa: F811
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"hello\n\xff there")
    _refused(_run(["generate", "--model", model, "--prompt-file", bad, "--max-tokens", "2"]),
             "is not valid UTF-8 (byte 0xff on line 2)")
    _refused(_run(["generate", "--model", model, "--prompt", "hi", "--max-tokens", "2", "--stop-token-id", "99999"]),
             "stop_token_ids holds 99999")
    _refused(_run(["generate", "--model", model, "--prompt", "\udced\udca0\udc80", "--max-tokens", "2"]),
             "lone surrogate")
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"one\r\ntwo\rthree")
    assert read_prompt(crlf) == "one\ntwo\nthree"  # read as text, as ever: a CRLF file's prompt is the LF one's
