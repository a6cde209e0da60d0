"""Hostile and unlucky inputs (hardening, third round): every CLI command answers with one line naming the file or
value at fault, never a traceback, and never changes a file outside the job directory. Foreign files and rows are
left alone, a second submit names the lock, a half-created job is taken over, a huge prompt is refused unread, status
checks rows against their checksums, a full disk stops the dispatch, a signal before Ray is up takes the clean path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from specrun.cli import main
from specrun.storage.rowfiles import row_writer
from specrun.storage.schemas import OUTPUT

ray = pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--max-tokens", "6", "--actors", "1", "--concurrency", "1", "-q", "--draft", "none"]


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_mha"]


@pytest.fixture(scope="module")
def ray_up():
    from specrun.actors.pool import init_ray

    init_ray(None, num_cpus=2)
    yield
    ray.shutdown()


def _prompts(path: Path, ids) -> Path:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"say {n}"}) + "\n" for n, i in enumerate(ids)))
    return path


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line_error(r, *names):
    """Exit non-zero, no traceback, a short message that names each of `names`."""
    out = r.output
    assert r.exit_code != 0, out
    assert "Traceback" not in out and not isinstance(r.exception, (AssertionError, TypeError, KeyError)), out
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [x for x in out.strip().splitlines() if x.strip()]
    assert 1 <= len(lines) <= 3, out
    for n in names:
        assert str(n) in out, (n, out)


def _tree(root: Path) -> dict:
    """path -> sha256 of every file under root (links not followed): what must stay unchanged."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture(scope="module")
def jobs(model, ray_up, tmp_path_factory):
    """Finished jobs of the tiny model: 'a' (ids a0-a2), 'b' (ids b0, b1), 'a_seed1' (a's ids, another seed)."""
    d = tmp_path_factory.mktemp("jobs")
    out = {}
    for name, ids, seed in (("a", ["a0", "a1", "a2"], 0), ("b", ["b0", "b1"], 0), ("a_seed1", ["a0", "a1", "a2"], 1)):
        r = _cli("submit", _prompts(d / f"{name}.jsonl", ids), "--model", model, "--job-dir", d / name, *FLAGS,
                 "--seed", seed, "--temperature", 1)
        assert r.exit_code == 0, r.output
        out[name] = d / name
    return out


@pytest.fixture
def job_a(jobs, tmp_path):
    dst = tmp_path / "a"
    shutil.copytree(jobs["a"], dst)
    return dst


# -- 2. symbolic links inside a job ------------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["outputs", "done"])
def test_a_symlinked_sub_directory_is_refused_and_what_it_points_to_is_untouched(job_a, jobs, tmp_path, what):
    foreign = tmp_path / "foreign"
    shutil.move(job_a / what, foreign)
    shutil.copy(next((jobs["b"] / "outputs").glob("*.parquet")), foreign / "merged.1.0123456789abcdef.parquet")
    (foreign / ".mine.12345678.tmp").write_text("a file of someone else")
    (foreign / "notes.parquet").write_text("not parquet")
    (job_a / what).symlink_to(foreign, target_is_directory=True)
    for p in (job_a / "done").glob("*.json") if what == "outputs" else ():
        p.unlink()  # markers without rows: a resume would regenerate into the link
    before = _tree(foreign)
    r = _cli("resume", job_a, "-q")
    _one_line_error(r, job_a / what, "symbolic link")
    assert _tree(foreign) == before


def test_a_symlinked_file_deep_in_the_job_is_refused(job_a, tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    (job_a / "progress").mkdir(exist_ok=True)
    (job_a / "progress" / "x").symlink_to(victim)
    _one_line_error(_cli("resume", job_a, "-q"), "progress/x")
    assert victim.read_text() == "{}"


# -- 3. foreign rows -------------------------------------------------------------------------------------------

def test_rows_of_another_job_are_never_exported_or_merged(job_a, jobs, tmp_path):
    src = next((jobs["b"] / "outputs").glob("merged.*.parquet"))
    copied = job_a / "outputs" / src.name
    shutil.copy(src, copied)
    r = CliRunner().invoke(main, ["export", str(job_a)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["id"] for x in rows] == ["a0", "a1", "a2"]
    assert "not done" not in r.output and "not this job's" in r.output
    (job_a / "done" / "a1.json").unlink(missing_ok=True)
    r = _cli("resume", job_a, "-q")
    assert r.exit_code == 0, r.output
    assert copied.read_bytes() == src.read_bytes()
    ids = [i for p in (job_a / "outputs").glob("*.parquet") if p != copied
           for i in pq.read_table(p, columns=["id"]).column(0).to_pylist()]
    assert sorted(ids) == ["a0", "a1", "a2"]
    st = json.loads(_cli("status", job_a, "--json").stdout)
    assert st["totals"]["done"] == 3 and st["totals"]["total"] == 3


def test_a_file_of_another_job_with_the_same_ids_is_foreign(job_a, jobs):
    own = next((job_a / "outputs").glob("merged.*.parquet"))
    theirs = next((jobs["a_seed1"] / "outputs").glob("merged.*.parquet"))
    want = pq.read_table(own, columns=["id", "token_ids"]).to_pylist()
    assert pq.read_table(theirs, columns=["id", "token_ids"]).to_pylist() != want
    own.unlink()
    copied = job_a / "outputs" / theirs.name
    shutil.copy(theirs, copied)
    r = CliRunner().invoke(main, ["export", str(job_a)])
    assert r.stdout == "" and "not this job's" in r.output, r.output
    for m in (job_a / "done").glob("*.json"):
        m.unlink()
    assert _cli("resume", job_a, "-q").exit_code == 0
    assert copied.read_bytes() == theirs.read_bytes()
    r = CliRunner().invoke(main, ["export", str(job_a)])
    assert [json.loads(x)["id"] for x in r.stdout.splitlines()] == ["a0", "a1", "a2"]
    mine = [p for p in (job_a / "outputs").glob("*.parquet") if p != copied]
    assert len(mine) == 1 and pq.read_table(mine[0], columns=["id", "token_ids"]).to_pylist() == want


# -- 4, 5. the lock is taken before any file; a half-created job is taken over ---------------------------------

def test_a_submit_while_another_creates_the_job_names_the_lock(model, tmp_path):
    from specrun.storage.lock import JobLock

    root = tmp_path / "job"
    root.mkdir()
    holder = JobLock(root / "lock.json")
    holder.acquire()  # a live driver (this process) creating the job right now
    try:
        r = _cli("submit", _prompts(tmp_path / "p.jsonl", ["x"]), "--model", model, "--job-dir", root, *FLAGS)
        _one_line_error(r, f"pid {os.getpid()}")
        assert "not a specrun job" not in r.output
        assert sorted(os.listdir(root)) == ["lock.json"]
    finally:
        holder.release()


def test_a_half_created_job_is_taken_over_by_the_next_submit(model, ray_up, tmp_path):
    root = tmp_path / "job"
    root.mkdir()
    (root / ".prompts.parquet.0badc0de.tmp").write_bytes(b"PAR1 half written")
    _one_line_error(_cli("status", root), "creation was interrupted")
    _one_line_error(_cli("resume", root), "creation was interrupted")
    r = _cli("submit", _prompts(tmp_path / "p.jsonl", ["x", "y"]), "--model", model, "--job-dir", root, *FLAGS)
    assert r.exit_code == 0, r.output
    assert json.loads(_cli("status", root, "--json").stdout)["totals"]["done"] == 2
    assert not (root / ".prompts.parquet.0badc0de.tmp").exists()


def test_a_directory_with_other_files_is_never_taken_over(model, tmp_path):
    root = tmp_path / "job"
    root.mkdir()
    (root / ".prompts.parquet.0badc0de.tmp").write_bytes(b"x")
    (root / "thesis.tex").write_text("mine")
    before = _tree(root)
    r = _cli("submit", _prompts(tmp_path / "p.jsonl", ["x"]), "--model", model, "--job-dir", root, *FLAGS)
    _one_line_error(r, "not a specrun job")
    assert _tree(root) == before and sorted(os.listdir(root)) == sorted([".prompts.parquet.0badc0de.tmp", "thesis.tex"])


# -- 6. a prompt longer than any that fits is refused before tokenizing ------------------------------------------

def test_a_huge_prompt_is_refused_before_it_is_tokenized(model, tmp_path):
    from specrun.decoding.verify.params import SamplingParams
    from specrun.jobs.inputs import InputError, read_prompts
    from specrun.jobs.modelinfo import model_info
    from specrun.models.prompts import max_text_bytes

    info = model_info(model)
    longest = []

    class Watched:  # the model's tokenizer, noting the longest text it was asked to encode
        def __getattr__(self, name):
            return getattr(info.tokenizer, name)

        def encode(self, text, **kw):
            longest.append(len(text))
            return info.tokenizer.encode(text, **kw)

    n = max_text_bytes(info.tokenizer, info.max_context) + 1  # past what can fit, well within the line limit
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": "x" * n}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "y" * n}]}) + "\n"
                 + json.dumps({"prompt": "z" * (6 * n + (1 << 20))}) + "\n")  # past the line limit
    with pytest.raises(InputError) as e:
        read_prompts(p, Watched(), info.max_context, info.vocab_size, SamplingParams(max_tokens=4))
    assert [x.split(":")[0] for x in e.value.problems] == ["line 2", "line 3", "line 4"]
    assert ["not tokenized" in x for x in e.value.problems] == [True, True, False], e.value.problems
    assert "not read" in e.value.problems[2]
    assert max(longest) < 100


# -- 7. tracebacks ---------------------------------------------------------------------------------------------

def test_status_prints_markup_and_escape_sequences_in_ids_as_data(model, ray_up, tmp_path):
    ids = ["[/bold]x", "\x1b[31mred", "[red]z[/]"]
    r = _cli("submit", _prompts(tmp_path / "p.jsonl", ids), "--model", model, "--job-dir", tmp_path / "j", *FLAGS)
    assert r.exit_code == 0, r.output
    r = _cli("status", tmp_path / "j")
    assert r.exit_code == 0, r.output
    assert "[/bold]x" in r.output and "\x1b" not in r.output and "\\x1b[31mred" in r.output
    assert "[red]z[/]" in r.output


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC])
def test_resume_on_a_read_only_or_full_disk_is_one_line(job_a, monkeypatch, err):
    from specrun.storage import fs

    def refuse(self, path, data):
        raise OSError(err, os.strerror(err), str(path))

    monkeypatch.setattr(fs.LocalFS, "put_if_absent", refuse)
    r = _cli("resume", job_a, "-q")
    _one_line_error(r, job_a / "lock.json", os.strerror(err))
    assert "internal error" not in r.output  # the user's environment, not a bug
    assert _cli("status", job_a).exit_code == 0


def test_generate_with_a_pickled_checkpoint_is_one_line(model, tmp_path):
    import torch
    from safetensors.torch import load_file

    d = tmp_path / "pickled"
    shutil.copytree(model, d)
    weights = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save({**weights, "extra": Watched()}, d / "pytorch_model.bin")  # a global the weights-only loader refuses
    _one_line_error(_cli("generate", "--model", d, "--prompt", "hi", "--max-tokens", "2"), d)


class Watched:
    """A picklable object of a class torch's weights-only loader does not allow."""


def test_generate_with_a_chat_template_the_sandbox_refuses_is_one_line(model, tmp_path):
    d = tmp_path / "evil"
    shutil.copytree(model, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    _one_line_error(_cli("generate", "--model", d, "--chat", "--prompt", "hi", "--max-tokens", "2"), "chat template")


def test_an_internal_error_is_one_line_and_its_traceback_a_file(job_a, monkeypatch):
    from specrun.jobs import status

    def broken(job):
        raise RuntimeError("a bug")

    monkeypatch.setattr(status, "job_status", broken)
    r = _cli("status", job_a)
    _one_line_error(r, "internal error: RuntimeError: a bug", "full traceback in")
    path = r.output.split("full traceback in ")[1].split(";")[0]
    assert "RuntimeError: a bug" in Path(path).read_text() and "Traceback" in Path(path).read_text()
    os.unlink(path)


# -- 8. status checks the checksummed columns ----------------------------------------------------------------------

def test_status_does_not_call_a_row_with_a_wrong_token_done(job_a):
    out = next((job_a / "outputs").glob("merged.*.parquet"))
    t = pq.read_table(out)
    rows = t.to_pylist()
    rows[1]["token_ids"] = [(rows[1]["token_ids"][0] + 1) % 250, *rows[1]["token_ids"][1:]]
    with row_writer(out, OUTPUT) as w:  # valid Parquet, valid page checksums; the row's own checksum now disagrees
        w.add(pa.Table.from_pylist(rows, schema=OUTPUT))
    st = json.loads(_cli("status", job_a, "--json").stdout)
    states = {p["id"]: p["state"] for p in st["prompts"]}
    assert states == {"a0": "done", "a1": "repair", "a2": "done"}, states
    assert "checksum" in st["prompts"][1]["error"]


def test_status_names_an_output_file_it_cannot_read(job_a):
    """A truncated output file holds rows no command can read: status says so (the prompts show pending, as resume
    regenerates them), it does not just count them as never done."""
    out = next((job_a / "outputs").glob("merged.*.parquet"))
    data = out.read_bytes()
    out.write_bytes(data[: len(data) // 2])
    try:
        r = _cli("status", job_a)
        said = " ".join(r.output.split())  # as rich wrapped it
        assert r.exit_code == 0 and f"warning: outputs: {out.name} is unreadable" in said, r.output
        assert "`specrun resume` generates the prompts it held again" in said
        st = json.loads(_cli("status", job_a, "--json").stdout)
        assert st["problems"] and {p["state"] for p in st["prompts"]} == {"pending"}
    finally:
        out.write_bytes(data)


def test_status_does_not_call_done_a_row_export_cannot_read(job_a):
    """A page of a column the row checksum does not cover (prompt_tokens) damaged: export cannot read that row
    group, so status does not count its prompts done either; it names the file."""
    out = next((job_a / "outputs").glob("merged.*.parquet"))
    data = out.read_bytes()
    meta = pq.ParquetFile(out).metadata
    assert meta.num_row_groups == 1
    chunk = meta.row_group(0).column(meta.schema.to_arrow_schema().get_field_index("prompt_tokens"))
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    damaged = bytearray(data)
    damaged[start + chunk.total_compressed_size - 2] ^= 0xFF  # in its last page's values (its CRC now disagrees)
    out.write_bytes(bytes(damaged))
    try:
        exported = _cli("export", job_a, "--format", "jsonl")
        assert not [x for x in exported.stdout.splitlines() if x.startswith("{")], exported.output
        st = json.loads(_cli("status", job_a, "--json").stdout)
        assert {p["state"] for p in st["prompts"]} == {"pending"}, st["prompts"]
        assert any(out.name in x and "unreadable" in x for x in st["problems"]), st["problems"]
    finally:
        out.write_bytes(data)


# -- 9. a signal before Ray is up ------------------------------------------------------------------------------

def test_sigterm_while_the_prompts_are_read_takes_the_clean_path(model, tmp_path):
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    p = subprocess.Popen([sys.executable, "-c", "from specrun.cli import main; main()", "submit", str(fifo),
                          "--model", model, "--job-dir", str(tmp_path / "job"), *FLAGS], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    opened = threading.Event()

    def writer():  # returns once the driver opened the FIFO to read it: it is past its imports, inside the scan
        try:
            with open(fifo, "w") as f:
                opened.set()
                f.write(json.dumps({"prompt": "hi"}) + "\n")
                f.flush()
                time.sleep(60)
        except BrokenPipeError:  # the driver is gone: what the test waits for
            pass

    threading.Thread(target=writer, daemon=True).start()
    try:
        assert opened.wait(120), "the driver never opened its prompts"
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + signal.SIGTERM, out
    assert "Traceback" not in out and "stopped by SIGTERM" in out, out
    assert not (tmp_path / "job").exists()


# -- 10. a full disk stops the dispatch ------------------------------------------------------------------------

def test_a_full_disk_starts_no_more_prompts_and_says_so(model, ray_up, tmp_path, monkeypatch):
    from specrun.storage.records import Records

    def full(self, row):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.outputs / "x.parquet"))

    monkeypatch.setattr(Records, "write_output", full)
    ids = [f"p{i}" for i in range(4)]
    r = _cli("submit", _prompts(tmp_path / "p.jsonl", ids), "--model", model, "--job-dir", tmp_path / "j", *FLAGS)
    assert r.exit_code == 1, r.output
    assert "disk holding the job is full" in r.output and "specrun resume" in r.output
    monkeypatch.undo()
    st = json.loads(_cli("status", tmp_path / "j", "--json").stdout)
    assert st["totals"]["failed"] == 0 and st["totals"]["done"] == 0
    attempts = {p["id"]: p for p in st["prompts"]}
    assert len(attempts) == 4
    r = _cli("resume", tmp_path / "j", "-q")
    assert r.exit_code == 0 and json.loads(_cli("status", tmp_path / "j", "--json").stdout)["totals"]["done"] == 4


# -- 11. Ray processes of a SIGKILLed driver -------------------------------------------------------------------

@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper reads /proc")
def test_the_reaper_stops_the_ray_processes_of_a_killed_driver_only(tmp_path):
    code = ("import os, subprocess, sys, time\n"
            "from specrun.actors.reaper import start_reaper\n"
            "agent = subprocess.Popen(['bash', '-c', 'exec -a ray::FakeAgent sleep 300'])\n"
            "other = subprocess.Popen(['sleep', '300'])\n"
            "start_reaper()\n"
            "print(agent.pid, other.pid, flush=True)\n"
            "time.sleep(300)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    driver = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    agent, other = map(int, driver.stdout.readline().split())
    time.sleep(2.5)  # the reaper has seen the driver's Ray processes
    driver.kill()
    driver.wait()
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end and Path(f"/proc/{agent}").exists() and _state(agent) != "Z":
            time.sleep(0.2)
        assert not Path(f"/proc/{agent}").exists() or _state(agent) == "Z", "the Ray process was left running"
        assert Path(f"/proc/{other}").exists() and _state(other) != "Z", "a process that is not Ray's was stopped"
    finally:
        for pid in (agent, other):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
