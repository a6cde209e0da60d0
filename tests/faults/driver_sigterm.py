"""Fault 3 (issue 11, item 8): SIGTERM to the driver (as from `timeout`, a preemption, systemd): it checkpoints every
running prompt, exits 143 and leaves the job resumable; after several such stops a resume gives outputs identical to
an uninterrupted run's.

    OMP_NUM_THREADS=1 python -m tests.faults.driver_sigterm --stops 4 --prompts 6 --tokens 300 --actors 2

The first stop comes 1 s after the driver starts (before Ray and the workers are up), the others at a random delay
after the first new checkpoint of the run. After each stop: the exit status, how long the driver took to exit, that
the lock is released, and that no running prompt lost a generated token (tokens in chunks = the live files' count).
"""

from __future__ import annotations

import random
import signal
import time

from tests.faults.common import (Check, arguments, next_run, checkpointed, differences, end_group, outputs, reference, run, setup,
                                 start, workdir)


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--stops", type=int, default=4)
    a = ap.parse_args()
    check, rng = Check(), random.Random(a.seed)
    with workdir(a.workdir, "specrun-fault-sigterm-") as root:
        model, prompts = setup(root, a.prompts, a.tokens)
        ref, ref_s = reference(prompts, model, root, a.tokens, a.actors)
        job, log = root / "job", root / "driver.log"
        stops = []
        for i in range(a.stops):
            cmd = next_run(prompts, model, job, a.tokens, a.actors)
            before = sum(checkpointed(job).values())
            mark = len(log.read_text()) if log.exists() else 0
            p = start(cmd, log)
            t0 = time.monotonic()
            try:
                if i == 0:
                    time.sleep(1.0)
                else:  # a random point after this run's first checkpoint
                    while p.poll() is None and sum(checkpointed(job).values()) <= before:
                        time.sleep(0.05)
                    time.sleep(rng.uniform(0, 3))
                if p.poll() is not None:
                    stops.append({"stop": i + 1, "finished_before_the_signal": True, "exit": p.returncode})
                    continue
                at = time.monotonic() - t0
                p.send_signal(signal.SIGTERM)
                t1 = time.monotonic()
                rc = p.wait(timeout=180)
                took = time.monotonic() - t1
            finally:
                end_group(p)
            text = log.read_text()[mark:]
            saved = checkpointed(job)
            stops.append({"stop": i + 1, "at_s": round(at, 1), "exit": rc, "exit_after_s": round(took, 1),
                          "checkpointed_tokens": sum(saved.values()),
                          "message": next((x for x in text.splitlines() if "SIGTERM" in x), "")[:160]})
            print(f"stop {i + 1}: {stops[-1]}", flush=True)
            check(rc in (143, -signal.SIGTERM), f"stop {i + 1}: exit {rc}, not 143")
            check(not (job / "lock.json").exists() or rc == -signal.SIGTERM, f"stop {i + 1}: lock left behind")
            check("Traceback" not in text, f"stop {i + 1}: a traceback:\n{text[-3000:]}")
            if rc == 143:
                check("every generated token is checkpointed" in text, f"stop {i + 1}: tokens not all checkpointed")
        r = run(["resume", job, "-q"])
        check(r.returncode == 0, f"resume exited {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}")
        got, problems = outputs(job)
        for pr in problems + differences(got, ref):
            check(False, pr)
        check.exit({"fault": "SIGTERM to the driver", "uninterrupted_s": round(ref_s, 1), "stops": stops,
                    "resume_exit": r.returncode, "identical": not differences(got, ref), "rows": len(got)})


if __name__ == "__main__":
    main()
