"""Scale run (issue 11, item 6): N prompts x T tokens on a tiny model with one local CPU worker. Reports the driver's
CPU time and peak RSS, the files in the job directory (the most seen at once while it runs, and what is left), and the
peak RSS of `specrun export` (jsonl and parquet); checks every row is exported once, in input order, readable by
pyarrow (and duckdb, pandas when installed), and a sample of rows against plain AR generation.

    OMP_NUM_THREADS=1 taskset -c 1 python tests/faults/scale.py --prompts 10000 --tokens 4

The driver and each export run in a child process of their own; their figures are getrusage(RUSAGE_SELF) of that
child (its own CPU time and peak RSS: not Ray's worker processes). tests/jobs/test_scale.py runs a small version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _usage(t0: float, cpu0: float, **extra) -> dict:
    """Wall and CPU seconds of the operation (this process, all its threads), and its peak RSS (VmHWM: unlike
    ru_maxrss, not inherited from the parent that forked it)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": round(time.monotonic() - t0, 2), "cpu_s": round(ru.ru_utime + ru.ru_stime - cpu0, 2),
            "peak_rss_mb": _vm("VmHWM"), **extra}


def _vm(field: str) -> float:
    """VmHWM (peak RSS) or VmRSS (now) of this process, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _child(args: list[str]) -> None:
    """Runs in the child: `_drive JOB` or `_export JOB FORMAT OUT`; prints one JSON line."""
    from specrun.jobs.jobdir import JobDir

    ru = resource.getrusage(resource.RUSAGE_SELF)
    t0, cpu0 = time.monotonic(), ru.ru_utime + ru.ru_stime
    job = JobDir(args[1])
    if args[0] == "_drive":
        from specrun.jobs.driver import RunOptions, run_job

        base = _vm("VmRSS")  # after the imports (torch, ray, pyarrow): what any run starts from
        summary = run_job(job, RunOptions(actors=1, quiet=True))
        print(json.dumps(_usage(t0, cpu0, rss_before_mb=base, exit_code=summary.exit_code, done=len(summary.done))))
    else:
        from specrun.jobs.export import export

        base = _vm("VmRSS")
        rows, missing = export(job, args[2], args[3])
        print(json.dumps(_usage(t0, cpu0, rss_before_mb=base, rows=rows, missing=missing)))


def _count_files(root: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for d, _, files in os.walk(root):
        top = Path(d).relative_to(root).parts[:1]
        key = top[0] if top else "."
        counts[key] = counts.get(key, 0) + len(files)
    return counts


def _run_child(args: list[str], poll_root: Path | None = None) -> tuple[dict, dict[str, int]]:
    import specrun  # the children use the same specrun as this process (PYTHONPATH=/some/other/checkout works)

    first = str(Path(specrun.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [first, os.environ.get("PYTHONPATH")]))}
    p = subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE, text=True)
    peak: dict[str, int] = {}
    while p.poll() is None:
        if poll_root is not None and poll_root.exists():
            now = _count_files(poll_root)
            peak["total"] = max(peak.get("total", 0), sum(now.values()))
            for k, v in now.items():
                peak[k] = max(peak.get(k, 0), v)
        time.sleep(0.5)
    out = p.stdout.read()
    if p.returncode != 0:
        raise RuntimeError(f"{args[0]} failed with {p.returncode}: {out[-2000:]}")
    return json.loads(out.strip().splitlines()[-1]), peak


def run(n: int, tokens: int, workdir: Path, check: int = 50, model: str | None = None) -> dict:
    from specrun.decoding.engine import EngineConfig
    from specrun.decoding.verify.params import SamplingParams
    from specrun.jobs.modelinfo import model_info
    from specrun.jobs.submit import JobSettings, prepare_job
    from specrun.models.tiny import build_tiny_model

    workdir.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = str(build_tiny_model(workdir / "model", arch="llama", heads=4, kv_heads=4, seed=1))
    prompts = workdir / "prompts.jsonl"
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"id": f"p{i:06d}", "prompt": f"prompt number {i}"}) + "\n" for i in range(n))
    t0 = time.monotonic()
    job, _ = prepare_job(prompts, workdir / "job", model_info(model),
                         JobSettings(checkpoint_every=max(1, tokens // 2)),  # chunk files too, removed when done
                         SamplingParams(max_tokens=tokens, temperature=1.0, seed=11, ignore_eos=True), EngineConfig())
    submit_s = time.monotonic() - t0
    drive, peak = _run_child(["_drive", str(job.root)], poll_root=job.root)
    left = _count_files(job.root)
    report = {"prompts": n, "tokens": tokens, "submit_s": round(submit_s, 2), "driver": drive,
              "files_peak": peak, "files_left": left}
    for fmt, name in (("jsonl", "out.jsonl"), ("parquet", "out.parquet")):
        report[f"export_{fmt}"], _ = _run_child(["_export", str(job.root), fmt, str(workdir / name)])
    report["checks"] = _check(job, workdir, n, check, model)
    return report


def run_export_only(n: int, tokens: int, workdir: Path, files: int = 4) -> dict:
    """Export memory with long outputs: n rows of `tokens` tokens written straight into `files` merged files (rows
    dealt round-robin, so export merges them all at once), then exported by child processes."""
    import pyarrow as pa

    from specrun.decoding.verify.params import SamplingParams
    from specrun.jobs.inputs import PromptRecord
    from specrun.jobs.jobdir import JobDir
    from specrun.storage.records import output_row
    from specrun.storage.rowfiles import row_writer
    from specrun.storage.schemas import OUTPUT

    job = JobDir(workdir / "job")
    ids = [f"p{i:06d}" for i in range(n)]
    job.create({"model": {}, "checkpoint": {}}, [PromptRecord(pid, i + 1, "x", (1,), {}, SamplingParams())
                                                 for i, pid in enumerate(ids)])
    rng = random.Random(0)
    for f in range(files):
        with row_writer(job.records.outputs / f"merged.1.{f:016x}.parquet", OUTPUT, durable=False) as w:
            for pid in ids[f::files]:
                toks = [rng.randrange(50000) for _ in range(tokens)]
                w.add(pa.Table.from_pylist([output_row(pid, toks, "x" * tokens, "length", {}, prompt_tokens=1,
                                                       resumed_tokens=0, attempts=1)], schema=OUTPUT))
    size = sum(p.stat().st_size for p in job.records.outputs.iterdir())
    report = {"rows": n, "tokens_per_row": tokens, "output_files": files, "output_mb": round(size / 2**20, 1)}
    for fmt, name in (("jsonl", "out.jsonl"), ("parquet", "out.parquet")):
        report[f"export_{fmt}"], _ = _run_child(["_export", str(job.root), fmt, str(workdir / name)])
        report[f"export_{fmt}"]["out_mb"] = round((workdir / name).stat().st_size / 2**20, 1)
    return report


def _check(job, workdir: Path, n: int, check: int, model: str) -> dict:
    import pyarrow.parquet as pq

    ids = [f"p{i:06d}" for i in range(n)]
    with open(workdir / "out.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["id"] for r in rows] == ids, "jsonl export: not every prompt once, in input order"
    t = pq.read_table(workdir / "out.parquet")
    assert t.column("id").to_pylist() == ids
    out_files = sorted(job.records.outputs.glob("*.parquet"))
    res = {"output_files": len(out_files), "row_groups": sum(pq.ParquetFile(f).metadata.num_row_groups
                                                               for f in out_files)}
    assert pq.read_table(job.records.outputs).num_rows == n
    try:
        import duckdb

        glob = str(job.records.outputs / "*.parquet")
        query = f"select count(distinct id) from read_parquet('{glob}')"
        res["duckdb_rows"] = duckdb.connect().execute(query).fetchone()[0]
        assert res["duckdb_rows"] == n
    except ImportError:
        pass
    try:
        import pandas as pd

        res["pandas_rows"] = len(pd.read_parquet(job.records.outputs))
        assert res["pandas_rows"] == n
    except ImportError:
        pass
    from specrun.decoding.engine import Engine
    from specrun.models.loader import load_model

    engine = Engine(load_model(model))
    by_id = {p.id: p for p in job.prompts()}
    sample = random.Random(0).sample(range(n), min(check, n))
    for i in sample:
        p = by_id[ids[i]]
        assert rows[i]["token_ids"] == engine.generate(list(p.input_ids), p.params).token_ids, ids[i]
    res["ar_checked"] = len(sample)
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        return _child(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--check", type=int, default=50, help="rows compared with plain AR generation")
    ap.add_argument("--workdir", default=None, help="default: a temporary directory, removed afterwards")
    ap.add_argument("--export-only", action="store_true",
                    help="no generation: write --prompts rows of --tokens tokens into 4 output files and export them "
                         "(export memory with long outputs, e.g. --prompts 2000 --tokens 50000)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)

    def go(d: Path) -> dict:
        return run_export_only(a.prompts, a.tokens, d) if a.export_only else run(a.prompts, a.tokens, d, a.check)

    if a.workdir:
        print(json.dumps(go(Path(a.workdir)), indent=2))
    else:
        with tempfile.TemporaryDirectory(prefix="specrun-scale-") as d:
            print(json.dumps(go(Path(d)), indent=2))


if __name__ == "__main__":
    main()
