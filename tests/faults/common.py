"""Shared by the fault scripts (tests/faults/*.py, run by hand): a tiny model and prompts in a work directory, the CLI
as a subprocess in its own process group, an uninterrupted reference run, and the exactly-once and identity checks.

Each script prints a short summary and exits 1 when a check fails (Check collects them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SAMPLING = ["--temperature", "1.0", "--seed", "7", "--ignore-eos", "--dtype", "float32"]


def cli(*args) -> list[str]:
    return [sys.executable, "-c", "from specrun.cli import main; main()", *map(str, args)]


def env() -> dict:
    """This checkout first on the path, one torch thread per process (2-core machines)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def start(args, log: Path) -> subprocess.Popen:
    """The CLI in a new session (its local Ray shares its process group); output to `log`."""
    return subprocess.Popen(cli(*args), env=env(), stdout=log.open("a"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def run(args, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), check=False, env=env(), capture_output=True, text=True, timeout=timeout)


def end_group(p: subprocess.Popen) -> list[int]:
    """SIGKILL what is left of a process group we started (a dead driver's local Ray); returns the pids it held."""
    left = group_pids(p.pid)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()
    return left


def group_pids(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    out.append(int(d.name))
            except (ProcessLookupError, PermissionError):
                pass
    return out


def arguments(doc: str, prompts: int | None = 6, tokens: int | None = 300, actors: int | None = 2):
    """An ArgumentParser with the flags every fault script has: --prompts, --tokens, --actors (None leaves one out),
    --seed and --workdir."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--prompts", prompts), ("--tokens", tokens), ("--actors", actors)):
        if default is not None:
            ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random choices")
    ap.add_argument("--workdir", default=None, help="default: a temporary directory, removed afterwards")
    return ap


def live_infos(job: Path) -> list[dict]:
    """The running prompts' live status files (id, pid of the worker, tokens, checkpointed, max_tokens, ...)."""
    out = []
    for f in job.glob("live/*.json"):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    return out


@contextmanager
def workdir(path: str | None, prefix: str):
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as d:
            yield Path(d)


def setup(root: Path, n_prompts: int, tokens: int) -> tuple[str, Path]:
    """A tiny Llama (built offline) and a prompts file of n prompts: (model dir, prompts path)."""
    from specrun.models.tiny import build_tiny_model

    model = root / "model"
    if not (model / "config.json").exists():
        build_tiny_model(model, arch="llama", heads=4, kv_heads=4, seed=1)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt {i}: " + "abc " * i,
                                           "max_tokens": tokens - 20 * (i % 3)}) + "\n" for i in range(n_prompts)))
    return str(model), prompts


def submit_args(prompts: Path, model: str, job: Path, tokens: int, actors: int, every: int = 16) -> list:
    return ["submit", prompts, "--model", model, "--job-dir", job, "--max-tokens", tokens, *SAMPLING,
            "--checkpoint-every", every, "--actors", actors, "-q"]


def next_run(prompts: Path, model: str, job: Path, tokens: int, actors: int) -> list:
    """`resume JOB` once the job exists (job.json written), else the submit that creates it."""
    return ["resume", job, "-q"] if (job / "job.json").exists() else submit_args(prompts, model, job, tokens, actors)


def reference(prompts: Path, model: str, root: Path, tokens: int, actors: int) -> tuple[dict[str, list[int]], float]:
    """token_ids per id of an uninterrupted run (its own job dir), and how long it took (s); reference.first_chunk_s
    is when its first checkpoint appeared (what start-up costs)."""
    job, log = root / "ref", root / "ref.log"
    t0 = time.monotonic()
    p = start(submit_args(prompts, model, job, tokens, actors), log)
    try:
        while p.poll() is None and not list(job.glob("progress/*/chunk-*")):
            time.sleep(0.05)
        reference.first_chunk_s = time.monotonic() - t0
        rc = p.wait()
    finally:
        end_group(p)
    if rc != 0:
        raise SystemExit(f"the uninterrupted reference run failed ({rc}):\n{log.read_text()[-3000:]}")
    return outputs(job)[0], time.monotonic() - t0


def outputs(job_dir: Path) -> tuple[dict[str, list[int]], list[str]]:
    """(token_ids per id, problems): every row the job's output files hold, read raw (as pyarrow, pandas or duckdb
    would: every file, no dedupe), so a row in two files or two rows for one id is a problem, as is a missing one."""
    import pyarrow.parquet as pq

    from specrun.jobs.jobdir import JobDir

    job = JobDir(job_dir)
    ids = job.prompt_ids()
    rows: dict[str, list[int]] = {}
    problems = []
    for f in sorted((job_dir / "outputs").glob("*.parquet")):
        for r in pq.read_table(f, columns=["id", "token_ids"]).to_pylist():
            if r["id"] in rows:
                problems.append(f"{r['id']} has more than one output row ({f.name})")
            rows[r["id"]] = r["token_ids"]
    problems += [f"{i} has no output row" for i in ids if i not in rows]
    problems += [f"{i} is not a prompt of the job" for i in rows if i not in ids]
    return rows, problems


def differences(got: dict[str, list[int]], ref: dict[str, list[int]]) -> list[str]:
    out = []
    for pid, toks in ref.items():
        if pid in got and got[pid] != toks:
            n = next((i for i, (a, b) in enumerate(zip(got[pid], toks)) if a != b), min(len(got[pid]), len(toks)))
            out.append(f"{pid}: token_ids differ from the uninterrupted run at position {n} "
                       f"({len(got[pid])} vs {len(toks)} tokens)")
    return out


def checkpointed(job_dir: Path) -> dict[str, int]:
    """Tokens in valid progress chunks per prompt, and done prompts (read without touching anything)."""
    from specrun.jobs.jobdir import JobDir
    from specrun.storage.chunks import read_progress

    job = JobDir(job_dir)
    if not job.exists():
        return {}
    return {pid: len(read_progress(job.progress_dir(pid), quarantine=False)) for pid in job.prompt_ids()}


class Check:
    """Collects failed checks; `exit()` prints them and leaves with 1 if any."""

    def __init__(self):
        self.failures: list[str] = []

    def __call__(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failures.append(what)
            print(f"FAIL: {what}", flush=True)
        return ok

    def exit(self, summary: dict) -> None:
        summary["failures"] = self.failures
        print(json.dumps(summary, indent=2, default=str))
        print("RESULT:", "FAIL" if self.failures else "OK")
        sys.exit(1 if self.failures else 0)
