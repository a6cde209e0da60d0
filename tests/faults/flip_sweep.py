"""Fault 6, exhaustively (issue 11, item 8): flip one bit of every byte (bit = position mod 8; --stride N: every Nth
byte) of one file of each kind in a job directory, and read it back each time through the reader the job itself uses
for that kind. Each flip is counted as refused (the reader raises or skips the damaged data: it is regenerated or
named), same (what is read equals the undamaged read) or DIFFERENT (read as other content, silently).

    OMP_NUM_THREADS=1 python -m tests.faults.flip_sweep JOBDIR [JOBDIR ...] [--stride 1]

The job directories are those corrupt_files.py leaves in its --workdir (base-interrupted, base-finished); each is
copied first. DIFFERENT is a bug for job.json, prompts, chunks and outputs (the tokens a job produces or resumes
from); for the recycling matrix (drafting only: outputs do not depend on it), live files, done and failed markers,
attempt records and timelines it is reported as what status/report would show.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

# kind -> glob of the file swept (the first match), and whether a DIFFERENT read changes what the job produces
KINDS = {"job.json": ("job.json", True), "prompts": ("prompts.parquet", True),
         "chunk": ("progress/*/chunk-0000000000-*.parquet", True), "output part": ("outputs/*-*.parquet", True),
         "merged output": ("outputs/merged.*.parquet", True), "done marker": ("done/*.json", False),
         "failed marker": ("failed/*.json", False), "live status": ("live/*.json", False),
         "recycling matrix": ("state/recycling-*.safetensors", False), "lock": ("lock.json", False),
         "attempt record": ("attempts/0001.json", False), "timeline": ("timeline/*.parquet", False)}


def reader(kind: str, job: Path, f: Path):
    """A function that reads the file as the job does: returns what was read, or raises when it refuses it."""
    from specrun.jobs.attempts import read_attempts
    from specrun.jobs.jobdir import JobDir
    from specrun.storage.atomic import read_json
    from specrun.storage.chunks import read_progress
    from specrun.storage.lock import read_lock
    from specrun.storage.state import load_matrix
    from specrun.storage.timeline import read_timeline

    ids = JobDir(job).prompt_ids()
    if kind == "job.json":
        return lambda: JobDir(job).manifest()
    if kind == "prompts":
        return lambda: [(p.id, p.input_ids, p.params) for p in JobDir(job).prompts()]
    if kind == "chunk":  # tokens resumed from: a shorter run is regenerated, other tokens would be wrong
        return lambda: read_progress(f.parent, quarantine=False)
    if kind in ("output part", "merged output"):  # what export and the driver's scans read
        return lambda: {pid: t.to_pylist()[0] for pid, t in JobDir(job).records.iter_outputs(ids)}
    if kind in ("done marker", "failed marker", "live status"):
        return lambda: read_json(f)
    if kind == "recycling matrix":
        fp = JobDir(job).manifest()["model"]["fingerprint"]
        return lambda: {k: v.tolist() for k, v in (load_matrix(f.parent, fp, int(f.stem.split("-")[1])) or {}).items()}
    if kind == "lock":
        return lambda: read_lock(f)[0]
    if kind == "attempt record":
        return lambda: read_attempts(JobDir(job))
    return lambda: read_timeline(f)


def _refused(kind: str, good, got) -> bool:
    """A read that dropped the damaged data (to regenerate it) rather than raising."""
    if kind == "chunk":
        return len(got) < len(good) and got == good[:len(got)]
    if kind in ("output part", "merged output"):
        return set(got) < set(good) and all(got[k] == good[k] for k in got)
    if kind == "recycling matrix":
        return got == {}
    if kind == "attempt record":
        return len(got) == len(good) and any("error" in a and "settings" not in a for a in got)
    return kind in ("lock", "timeline") and not got


def sweep(kind: str, base: Path, stride: int) -> dict | None:
    pattern, matters = KINDS[kind]
    with tempfile.TemporaryDirectory(prefix="specrun-sweep-") as d:
        job = Path(d) / "job"
        shutil.copytree(base, job)
        files = sorted(job.glob(pattern))
        if not files:
            return None
        f = files[0]
        if kind == "recycling matrix":  # else load_matrix falls back to another slot's snapshot
            for other in set(f.parent.glob("recycling-*")) - {f}:
                other.unlink()
        data = f.read_bytes()
        read = reader(kind, job, f)
        good = read()
        counts = {"refused": 0, "same": 0, "DIFFERENT": 0}
        examples = []
        try:
            for pos in range(0, len(data), stride):
                flipped = bytearray(data)
                flipped[pos] ^= 1 << pos % 8
                f.write_bytes(bytes(flipped))
                try:
                    got = read()
                except Exception as e:  # noqa: BLE001 (a refusal, whatever it is: the CLI names it or not)
                    counts["refused"] += 1
                    if not examples or type(e).__name__ not in examples[-1]:
                        examples.append(f"refused at {pos}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                if got == good:
                    counts["same"] += 1
                elif _refused(kind, good, got):
                    counts["refused"] += 1
                else:
                    counts["DIFFERENT"] += 1
                    if sum("DIFFERENT" in x for x in examples) < 3:
                        examples.append(f"DIFFERENT at byte {pos}")
        finally:
            f.write_bytes(data)
        return {"kind": kind, "file": str(f.relative_to(job)), "bytes": len(data), "flips": len(range(0, len(data),
                stride)), **counts, "changes_outputs_if_different": matters, "examples": examples[:6]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jobs", nargs="+", type=Path)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--stride", type=int, default=1)
    a = ap.parse_args()
    results, bad = [], []
    for kind in (k.strip() for k in a.kinds.split(",")):
        for base in a.jobs:
            res = sweep(kind, base, a.stride)
            if res is None:
                continue
            res["job"] = base.name
            results.append(res)
            print(json.dumps(res), flush=True)
            if res["DIFFERENT"] and res["changes_outputs_if_different"]:
                bad.append(f"{kind} ({base.name}): {res['DIFFERENT']} of {res['flips']} flips read as other content")
            break  # one file per kind
    print("RESULT:", "FAIL: " + "; ".join(bad) if bad else "OK")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
