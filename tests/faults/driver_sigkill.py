"""Fault 1 (issue 11, item 8): SIGKILL the driver at random points, resume each time; the final outputs must equal an
uninterrupted run's (token_ids per id), one output row per id, nothing lost or duplicated.

    OMP_NUM_THREADS=1 python -m tests.faults.driver_sigkill --kills 10 --prompts 6 --tokens 300 --actors 2

The uninterrupted run comes first (its own job dir). Odd kills land in start-up: at a delay uniform over [0.2 s, the
reference's time to its first checkpoint] after `specrun submit` (or `resume` once job.json exists) starts, or at the
run's first new checkpoint if it comes sooner; even
kills land while the run works (generation, checkpoints, output rows, compaction): once the tokens the job holds
(checkpointed or in finished rows) pass a target drawn uniformly between what it held and half of what is left, so
the job is still unfinished after the last kill whatever the machine's speed. Only the driver process is killed;
what its local Ray does then (processes left, files still written) is observed for 3 s and reported, then the group
is cleaned up.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from tests.faults.common import (Check, arguments, next_run, checkpointed, differences, end_group, group_pids, outputs, reference,
                                 run, setup, start, workdir)


def _mtimes(root: Path) -> dict[str, int]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            try:
                out[os.path.join(d, f)] = os.stat(os.path.join(d, f)).st_mtime_ns
            except FileNotFoundError:
                pass
    return out


def _made(job: Path) -> int:
    """Generated tokens the job holds: checkpointed plus finished rows."""
    if not (job / "job.json").exists():
        return 0
    return sum(checkpointed(job).values()) + sum(map(len, outputs(job)[0].values()))


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--kills", type=int, default=10)
    a = ap.parse_args()
    check, rng = Check(), random.Random(a.seed)
    with workdir(a.workdir, "specrun-fault-sigkill-") as root:
        model, prompts = setup(root, a.prompts, a.tokens)
        ref, ref_s = reference(prompts, model, root, a.tokens, a.actors)
        startup_s, total = reference.first_chunk_s, sum(map(len, ref.values()))
        print(f"uninterrupted run: {ref_s:.1f} s, first checkpoint after {startup_s:.1f} s", flush=True)
        job, log = root / "job", root / "driver.log"
        kills = []
        for i in range(a.kills):
            cmd = next_run(prompts, model, job, a.tokens, a.actors)
            made = _made(job)
            working = i % 2 == 1
            delay = rng.uniform(0.2, startup_s)
            target = made + rng.uniform(0, 0.5) * (total - made)
            p = start(cmd, log)
            t0 = time.monotonic()
            # a start-up kill comes at its delay, or at the run's first new checkpoint if that comes first
            while p.poll() is None and (_made(job) <= target if working else
                                        time.monotonic() - t0 < delay and _made(job) == made):
                time.sleep(0.1)
            delay = time.monotonic() - t0
            if p.poll() is not None:  # it finished before the kill: nothing is left to interrupt
                kills.append({"delay_s": round(delay, 2), "killed": False, "exit": p.returncode})
                end_group(p)
                break
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            before = _mtimes(job)
            time.sleep(3)
            after = _mtimes(job)
            changed = sorted(os.path.relpath(f, job) for f in after if after[f] != before.get(f))
            left = group_pids(p.pid)
            end_group(p)
            saved = checkpointed(job)
            kills.append({"delay_s": round(delay, 2), "phase": "working" if working else "start-up", "killed": True,
                          "command": cmd[0], "held_tokens_before": made,
                          **({"target_tokens": round(target)} if working else {}),
                          "ray_processes_left": len(left), "files_written_after_kill": changed[:5],
                          "n_files_written_after_kill": len(changed),
                          "checkpointed_tokens": sum(saved.values()),
                          "done_rows": len(outputs(job)[0]) if (job / "job.json").exists() else 0})
            print(f"kill {i + 1}: {kills[-1]}", flush=True)
        t0 = time.monotonic()
        cmd = next_run(prompts, model, job, a.tokens, a.actors)
        final = run(cmd)
        final_s = time.monotonic() - t0
        check(final.returncode == 0, f"final run exited {final.returncode}: {final.stdout[-2000:]}{final.stderr[-2000:]}")
        check("Traceback" not in log.read_text() + final.stdout + final.stderr, "a traceback in the driver output")
        got, problems = outputs(job)
        for pr in problems:
            check(False, pr)
        for d in differences(got, ref):
            check(False, d)
        exported = run(["export", job])
        check(exported.returncode == 0 and len(exported.stdout.splitlines()) == len(ref),
              f"export gave {len(exported.stdout.splitlines())} lines, rc {exported.returncode}")
        from specrun.jobs.attempts import read_attempts
        from specrun.jobs.jobdir import JobDir

        check(sum(k["killed"] for k in kills) == a.kills, f"only {sum(k['killed'] for k in kills)} kills landed "
              f"before the job finished (the machine got faster than the reference run); run it again")
        check.exit({"fault": "SIGKILL of the driver at random points", "uninterrupted_s": round(ref_s, 1),
                    "kills": kills, "final_run_s": round(final_s, 1), "final_exit": final.returncode,
                    "prompts": len(ref), "rows": len(got), "identical": not differences(got, ref),
                    "attempt_records": len(read_attempts(JobDir(job)))})


if __name__ == "__main__":
    main()
