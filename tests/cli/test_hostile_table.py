"""Every CLI command against hostile inputs (missing, wrong-kind, garbage, looping and read-only paths, damaged and
half-made jobs, symlinked and foreign files, a full disk where a tmpfs can be mounted): the rule is one short error
naming the fault, never a traceback, never an internal error, and no file outside the job directory changed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrun.cli import main

ray = pytest.importorskip("ray")

JOB_COMMANDS = (["status"], ["status", "--json"], ["export"], ["export", "--format", "parquet", "-o", "{out}"],
                ["resume", "-q"], ["stop", "--wait", "1"], ["report", "-o", "{out}"])
MODEL_COMMANDS = (["generate", "--prompt", "hi", "--max-tokens", "2", "--model"],
                  ["bench", "--prompt", "hi", "--max-tokens", "2", "--model"],
                  ["train-heads", "--data", "{text}", "--out", "{out}", "--steps", "1", "--model"],
                  ["train-drafter", "--data", "{text}", "--out", "{out}", "--steps", "1", "--model"],
                  ["submit", "{prompts}", "--max-tokens", "2", "-q", "--job-dir", "{out}", "--model"])


@pytest.fixture(scope="module")
def place(tmp_path_factory, tiny_models):
    """Hostile things, each a path: name -> path; 'outside' is what nothing may change."""
    d = tmp_path_factory.mktemp("hostile")
    outside = d / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    p = {"missing": d / "nope", "dir": outside, "garbage": d / "garbage.bin", "loop": d / "loop",
         "proc": Path("/proc/specrun-hostile"), "outside": outside}
    p["garbage"].write_bytes(bytes(range(256)) * 64)
    p["loop"].symlink_to(p["loop"])
    bad = d / "badjob"
    bad.mkdir()
    (bad / "job.json").write_bytes(b"\x00{not json")
    p["badjob"] = bad
    half = d / "halfjob"
    half.mkdir()
    (half / ".prompts.parquet.0badc0de.tmp").write_bytes(b"PAR1")
    p["halfjob"] = half
    notjob = d / "notjob"
    notjob.mkdir()
    (notjob / "thesis.tex").write_text("mine")
    p["notjob"] = notjob
    p["text"] = d / "corpus.txt"
    p["text"].write_text("tiny corpus " * 50)
    p["prompts"] = d / "prompts.jsonl"
    p["prompts"].write_text(json.dumps({"id": "[/bold]\x1b[2J", "prompt": "hi"}) + "\n"
                            + json.dumps({"id": "$\\frac{$", "prompt": "ho"}) + "\n")  # matplotlib mathtext
    p["model"] = Path(tiny_models["llama_mha"])
    return p


@pytest.fixture(scope="module")
def linked_job(place, tmp_path_factory):
    """A finished job whose outputs/ is a link into 'outside', with a foreign file there."""
    d = tmp_path_factory.mktemp("linked")
    r = CliRunner().invoke(main, ["submit", str(place["prompts"]), "--model", str(place["model"]), "--max-tokens", "2",
                                  "--actors", "1", "-q", "--draft", "none", "--job-dir", str(d / "job")])
    assert r.exit_code == 0, r.output
    target = place["outside"] / "their-outputs"
    shutil.move(d / "job" / "outputs", target)
    (d / "job" / "outputs").symlink_to(target, target_is_directory=True)
    for m in (d / "job" / "done").glob("*.json"):
        m.unlink()
    return d / "job"


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _check(args, outside: Path, ok_exit=False):
    before = _tree(outside)
    r = CliRunner().invoke(main, [str(a) for a in args])
    out = r.output
    assert "Traceback" not in out and "internal error" not in out, (args, out)
    assert r.exception is None or isinstance(r.exception, SystemExit), (args, repr(r.exception))
    if not ok_exit:
        assert r.exit_code != 0, (args, out)
        lines = [x for x in out.splitlines() if x.strip()]
        # one error line; a prompts file's bad lines follow it, one indented line each (at most 20 and a count)
        assert "Error: " in out and all(x.startswith("  ") for x in lines[4:]) and len(lines) <= 24, (args, out)
    assert _tree(outside) == before, args
    return r


def _fill(args, place, tmp_path):
    return [str(a).format(out=tmp_path / "out", text=place["text"], prompts=place["prompts"]) for a in args]


@pytest.mark.parametrize("cmd", JOB_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("job", ["missing", "dir", "garbage", "loop", "proc", "badjob", "halfjob", "notjob"])
def test_job_commands_on_hostile_job_paths(cmd, job, place, tmp_path):
    ok = job == "dir" and cmd[0] == "stop"  # nothing to stop is not an error
    _check([cmd[0], place[job], *_fill(cmd[1:], place, tmp_path)], place["outside"], ok_exit=ok)


@pytest.mark.parametrize("cmd", MODEL_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("model", ["missing", "dir", "garbage", "loop", "proc"])
def test_model_commands_on_hostile_model_paths(cmd, model, place, tmp_path):
    _check([*_fill(cmd, place, tmp_path), place[model]], place["outside"])


@pytest.mark.parametrize("cmd", MODEL_COMMANDS[2:], ids=lambda c: c[0])
@pytest.mark.parametrize("data", ["missing", "dir", "garbage", "loop", "proc"])
def test_commands_on_hostile_input_files(cmd, data, place, tmp_path):
    args = [str(place[data]) if a in ("{text}", "{prompts}") else a for a in cmd]
    _check([*_fill(args, place, tmp_path), place["model"]], place["outside"])


@pytest.mark.parametrize("out", ["proc", "dir", "loop"])
def test_outputs_to_hostile_places(out, place, linked_job, tmp_path):
    _check(["export", linked_job.parent / "nojob", "-o", place[out]], place["outside"])
    if out != "dir":  # a job directory inside a directory is a fine place
        _check(["submit", place["prompts"], "--model", place["model"], "--max-tokens", "2", "-q", "--job-dir",
                place[out] / "job"], place["outside"])


@pytest.mark.parametrize("cmd", [["resume", "-q"], ["status"], ["export"], ["report", "-o", "{out}"]], ids=" ".join)
def test_a_job_with_a_symlinked_sub_directory(cmd, place, linked_job, tmp_path):
    r = _check([cmd[0], linked_job, *_fill(cmd[1:], place, tmp_path)], place["outside"], ok_exit=cmd[0] != "resume")
    if cmd[0] == "resume":
        assert "symbolic link" in r.output


@pytest.fixture
def full_disk(tmp_path):
    d = tmp_path / "tmpfs"
    d.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root in a container that allows mounts)")
    try:
        filler = d / "filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 512)
            except OSError:
                pass
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_commands_on_a_full_disk(place, linked_job, full_disk, tmp_path):
    _check(["submit", place["prompts"], "--model", place["model"], "--max-tokens", "2", "-q", "--job-dir",
            full_disk / "job"], place["outside"])
    _check(["export", linked_job, "-o", full_disk / "out.jsonl"], place["outside"])
    _check(["train-heads", "--data", place["text"], "--out", full_disk / "heads", "--steps", "1", "--model",
            place["model"]], place["outside"])
