"""Fault 6 (issue 11, item 8): a truncated and a bit-flipped copy of every kind of file in a job directory. For each,
`status`, `export` and `resume` must either repair (regenerate: the outputs end identical to an uninterrupted run) or
refuse with a clear error naming the file: never a traceback, never silently different output.

    OMP_NUM_THREADS=1 python -m tests.faults.corrupt_files [--kinds job.json,lock] [--flips 3]

Two base jobs: `interrupted` (the driver SIGKILLed with one prompt done but not merged, others with checkpoints, plus a
failed marker: job.json, prompts.parquet, progress chunks, an output part, done markers, live files, a recycling
matrix snapshot, a stale lock, an attempt record, timeline files) and `finished` (that job resumed to the end: one
merged output file). Each case copies a base, damages one file (truncated to half; one bit flipped at the middle
byte, or at --flips random places), then runs status --json, export and resume in this process (one local Ray), and
prints one line per case: what each command did and a verdict (repaired / refused naming the file / BUG: ...).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

from tests.faults.common import (Check, arguments, differences, end_group, live_infos, outputs, reference, setup, start,
                                 submit_args, workdir)

PROMPTS = [{"id": f"long{i}", "prompt": f"long {i} " * (i + 1), "max_tokens": 200} for i in range(3)] + \
          [{"id": f"short{i}", "prompt": f"short {i}", "max_tokens": 120} for i in range(3)]
# kind -> (base, glob of the file damaged: the first match)
KINDS = {
    "job.json": ("interrupted", "job.json"),
    "prompts": ("interrupted", "prompts.parquet"),
    "chunk": ("interrupted", "progress/*/chunk-0000000000-*.parquet"),
    "output part": ("interrupted", "outputs/*-*.parquet"),
    "merged output": ("finished", "outputs/merged.*.parquet"),
    "done marker": ("interrupted", "done/*.json"),
    "failed marker": ("interrupted", "failed/*.json"),
    "live status": ("interrupted", "live/*.json"),
    "recycling matrix": ("interrupted", "state/recycling-*.safetensors"),
    "lock": ("interrupted", "lock.json"),
    "attempt record": ("interrupted", "attempts/0001.json"),
    "timeline": ("interrupted", "timeline/*.parquet"),
}


def make_bases(root: Path, model: str, prompts: Path) -> dict[str, Path]:
    """The interrupted job (SIGKILLed) and the finished one (a copy resumed to the end)."""
    from click.testing import CliRunner

    from specrun.cli import main
    from specrun.jobs.jobdir import JobDir

    job, log = root / "base-interrupted", root / "base.log"
    p = start(submit_args(prompts, model, job, 200, 2, every=8), log)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 900:
            if p.poll() is not None:
                raise SystemExit(f"the base run ended ({p.returncode}) before it could be interrupted")
            done = list(job.glob("done/*.json"))
            busy = [i for i in live_infos(job) if i.get("checkpointed", 0) >= 8 and i["tokens"] < i["max_tokens"] - 30]
            if done and busy and list(job.glob("state/*")):
                break
            time.sleep(0.02)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    finally:
        end_group(p)
    jd = JobDir(job)
    pending = [pid for pid in jd.prompt_ids() if not (jd.progress_dir(pid)).exists()
               and not jd.records.read_done(pid)]
    if pending:  # a failed marker, as a prompt that failed in that run would have
        jd.records.mark_failed(pending[-1], "RuntimeError: made up by the fault script", 1)
    finished = root / "base-finished"
    shutil.copytree(job, finished)
    r = CliRunner().invoke(main, ["resume", str(finished), "-q"])
    if r.exit_code != 0:
        raise SystemExit(f"resuming the finished base failed: {r.output}")
    return {"interrupted": job, "finished": finished}


def damage(path: Path, how: str, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[:len(data) // 2]))
        return f"truncated {len(data)} -> {len(data) // 2} bytes"
    pos = len(data) // 2 if how == "bitflip" else rng.randrange(len(data))
    bit = 1 << (2 if how == "bitflip" else rng.randrange(8))
    data[pos] ^= bit
    path.write_bytes(bytes(data))
    return f"bit {bit:#04x} of byte {pos}/{len(data)} flipped"


def _invoke(args: list[str]) -> dict:
    """Run a CLI command in this process: exit code, first lines of its message, and a traceback if it raised."""
    from click.testing import CliRunner

    from specrun.cli import main

    r = CliRunner().invoke(main, args)
    out = {"exit": r.exit_code}
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback

        out["traceback"] = "".join(traceback.format_exception(r.exception))[-1500:]
    out["said"] = " | ".join(x.strip() for x in r.stderr.splitlines() if x.strip())[:800]
    return out


def run_case(kind: str, how: str, base: Path, target: str, cases: Path, ref: dict, rng: random.Random,
             fresh_lock: bool = True) -> dict:
    from specrun.jobs.export import export  # noqa: F401  (imported early: its import errors are not the case's)

    case = cases / f"{kind.replace(' ', '_')}-{how}{'' if fresh_lock else '-old'}"
    shutil.copytree(base, case)
    matches = sorted(case.glob(target))
    if not matches:
        return {"kind": kind, "how": how, "verdict": f"SKIPPED: no {target} in the {base.name} job"}
    f = matches[0]
    what = damage(f, how, rng)
    if kind == "lock" and not fresh_lock:
        old = time.time() - 600
        os.utime(f, (old, old))
    rel = str(f.relative_to(case))
    res = {"kind": kind, "how": how, "file": rel, "damage": what}
    res["status"] = _invoke(["status", str(case), "--json"])
    exported = case.parent / f"{case.name}.jsonl"
    res["export"] = _invoke(["export", str(case), "-o", str(exported)])
    wrong_export = []
    if exported.exists():
        for line in exported.read_text().splitlines():
            row = json.loads(line)
            if row["id"] in ref and row["token_ids"] != ref[row["id"]]:
                wrong_export.append(row["id"])
    res["resume"] = _invoke(["resume", str(case), "-q"])
    got, problems = outputs(case) if res["resume"]["exit"] == 0 else ({}, [])
    diffs = differences(got, ref) + problems
    name = f.name
    tracebacks = [c for c in ("status", "export", "resume") if "traceback" in res[c]]
    if tracebacks:
        res["verdict"] = f"BUG: traceback in {', '.join(tracebacks)}"
    elif wrong_export or diffs:
        res["verdict"] = f"BUG: different output ({wrong_export or diffs})"
    elif res["resume"]["exit"] == 0:
        res["verdict"] = "repaired (resume completes, outputs identical)"
    elif name in res["resume"]["said"] or rel in res["resume"]["said"]:
        res["verdict"] = "refused, naming the file"
    else:
        res["verdict"] = "BUG: refused without naming the file"
    return res


def main() -> None:
    ap = arguments(__doc__, prompts=None, tokens=None, actors=None)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma list of: " + ", ".join(KINDS))
    ap.add_argument("--flips", type=int, default=0, help="also this many bit flips at random places per file")
    a = ap.parse_args()
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    check, rng = Check(), random.Random(a.seed)
    with workdir(a.workdir, "specrun-fault-corrupt-") as root:
        model, _ = setup(root, 0, 0)
        prompts = root / "prompts6.jsonl"
        prompts.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
        ref, ref_s = reference(prompts, model, root, 200, 2)
        bases = make_bases(root, model, prompts)
        from specrun.actors.pool import init_ray

        init_ray(None, num_cpus=max(2, os.cpu_count() or 1))
        cases = root / "cases"
        cases.mkdir(exist_ok=True)
        results = []
        for kind in kinds:
            which, target = KINDS[kind]
            hows = ["truncated", "bitflip"] + [f"bitflip@random{i}" for i in range(a.flips)]
            for how in hows:
                res = run_case(kind, how if "random" not in how else "random", bases[which], target, cases, ref, rng)
                res["how"] = how
                results.append(res)
                print(json.dumps({k: res.get(k) for k in ("kind", "how", "file", "damage", "verdict")}), flush=True)
                for c in ("status", "export", "resume"):
                    if c in res:
                        print(f"    {c}: exit {res[c]['exit']}: {res[c]['said'][:300]}", flush=True)
                check(not res["verdict"].startswith("BUG"), f"{kind} {how}: {res['verdict']}: "
                      + " ".join(res[c].get("traceback", "")[-600:] for c in ("status", "export", "resume")
                                 if c in res))
            if kind == "lock":
                res = run_case(kind, "truncated", bases[which], target, cases, ref, rng, fresh_lock=False)
                res["how"] = "truncated, 10 min old"
                results.append(res)
                print(json.dumps({k: res.get(k) for k in ("kind", "how", "file", "damage", "verdict")}), flush=True)
                check(not res["verdict"].startswith("BUG"), f"{kind} {res['how']}: {res['verdict']}")
        check.exit({"fault": "truncated / bit-flipped files of every kind", "uninterrupted_s": round(ref_s, 1),
                    "cases": [{k: r.get(k) for k in ("kind", "how", "file", "verdict")} | {
                        c: {"exit": r[c]["exit"], "said": r[c]["said"][:200]} for c in ("status", "export", "resume")
                        if c in r} for r in results]})


if __name__ == "__main__":
    main()
