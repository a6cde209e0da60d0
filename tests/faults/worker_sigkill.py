"""Fault 2 (issue 11, item 8): SIGKILL worker (Ray actor) processes again and again mid-job; the driver retries each
prompt from its last checkpoint on a replacement worker, and the outputs equal an uninterrupted run's.

    OMP_NUM_THREADS=1 python -m tests.faults.worker_sigkill --kills 6 --prompts 6 --tokens 300 --actors 2

A victim is the worker of a running prompt that has checkpointed since it was (re)started, found through the live
status files (pid of the worker). The first prompt hit is killed until it reaches the driver's limit (RunOptions.
max_attempts = 3 losses: it fails, the run exits 1 naming it), the others once each; then `specrun resume` finishes
the failed one. Each output row's `attempts` must count its losses.
"""

from __future__ import annotations

import os
import signal
import time

from tests.faults.common import (Check, arguments, differences, end_group, live_infos, outputs, reference, run, setup,
                                 start, submit_args, workdir)

MAX_ATTEMPTS = 3  # RunOptions.max_attempts


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--kills", type=int, default=6)
    a = ap.parse_args()
    check = Check()
    with workdir(a.workdir, "specrun-fault-worker-") as root:
        model, prompts = setup(root, a.prompts, a.tokens)
        ref, ref_s = reference(prompts, model, root, a.tokens, a.actors)
        job, log = root / "job", root / "driver.log"
        # one prompt per worker: the losses are counted per prompt (a batched worker would take others down with it)
        p = start([*submit_args(prompts, model, job, a.tokens, a.actors), "--concurrency", "1"], log)
        kills: list[dict] = []
        losses: dict[str, int] = {}
        killed_pids: set[int] = set()
        first = None
        t0 = time.monotonic()
        try:
            while p.poll() is None and len(kills) < a.kills:
                for info in live_infos(job):
                    pid = info["id"]
                    limit = MAX_ATTEMPTS if first in (None, pid) else 1
                    if (info["pid"] in killed_pids or losses.get(pid, 0) >= limit
                            or info.get("checkpointed", 0) < 16 or info["tokens"] > info["max_tokens"] - 40):
                        continue
                    try:
                        os.kill(info["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    first = first or pid
                    killed_pids.add(info["pid"])
                    losses[pid] = losses.get(pid, 0) + 1
                    kills.append({"at_s": round(time.monotonic() - t0, 1), "prompt": pid, "worker_pid": info["pid"],
                                  "tokens": info["tokens"], "checkpointed": info["checkpointed"]})
                    print(f"kill {len(kills)}: {kills[-1]}", flush=True)
                    break
                time.sleep(0.05)
            rc = p.wait(timeout=900)
        finally:
            end_group(p)
        text = log.read_text()
        failed_first = losses.get(first, 0) >= MAX_ATTEMPTS
        check(rc == (1 if failed_first else 0), f"the run exited {rc}")
        if failed_first:
            check(f"prompt {first!r} failed: worker lost {MAX_ATTEMPTS} times" in text,
                  "the failure after max_attempts losses is not reported by name")
        check(text.count("worker lost") >= len(kills) - failed_first, "a lost worker was not reported")
        r = run(["resume", job, "-q"])
        check(r.returncode == 0, f"resume exited {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}")
        check("Traceback" not in text + r.stdout + r.stderr, "a traceback in the driver output")
        got, problems = outputs(job)
        for pr in problems + differences(got, ref):
            check(False, pr)
        from specrun.jobs.jobdir import JobDir

        rows = {x["id"]: x for x in JobDir(job).records.read_outputs().to_pylist()}
        attempts = {pid: rows[pid]["attempts"] for pid in rows}
        for pid, n in losses.items():
            want = 1 if pid == first and failed_first else n + 1  # a failed prompt's count starts again on resume
            check(attempts.get(pid) == want, f"{pid}: attempts {attempts.get(pid)}, expected {want}")
        check.exit({"fault": "SIGKILL of worker processes mid-job", "uninterrupted_s": round(ref_s, 1),
                    "kills": kills, "first_run_exit": rc, "losses_per_prompt": losses,
                    "failed_after_max_attempts": first if failed_first else None,
                    "resume_exit": r.returncode, "attempts_per_row": attempts,
                    "resumed_tokens_per_row": {pid: rows[pid]["resumed_tokens"] for pid in rows},
                    "identical": not differences(got, ref), "rows": len(got)})


if __name__ == "__main__":
    main()
