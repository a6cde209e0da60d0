"""Fault 5 (issue 11, item 8): the disk fills up during a job (checkpoints, output rows, markers, lock heartbeat all
hit ENOSPC). The driver must say so clearly and exit non-zero, leave no damaged file visible, and once space is
freed a resume must finish with outputs identical to an uninterrupted run.

    OMP_NUM_THREADS=1 python -m tests.faults.disk_full --prompts 4 --tokens 300      # as root: mounts a tmpfs

The job directory lives on a small tmpfs (`mount -t tmpfs -o size=4m`, unmounted at the end); once the first
checkpoint chunk is written, a filler file takes every free byte. After the run: every visible file of the job
directory must be complete (JSON parses, Parquet reads in full with its checksums, safetensors loads), and no
temporary file may be left. Then the filler is deleted and `specrun resume` runs.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path

from tests.faults.common import (Check, arguments, differences, end_group, outputs, reference, run, setup, start,
                                 submit_args, workdir)


def _fill(path: Path) -> int:
    """Write zeros to `path` until the filesystem is full; returns the bytes written."""
    n = 0
    block = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
        try:  # the last partial block
            while True:
                n += f.write(b"\0" * 512)
        except OSError:
            pass
    return n


def _damaged(job: Path) -> tuple[list[str], list[str]]:
    """(visible files that are not complete, temporaries left) in the job directory."""
    import pyarrow.parquet as pq
    from safetensors.numpy import load_file

    bad, tmps = [], []
    for d, _, files in os.walk(job):
        for name in files:
            f = Path(d) / name
            rel = str(f.relative_to(job))
            if name.startswith(".") and name.endswith(".tmp"):
                tmps.append(rel)
                continue
            try:
                if name.endswith(".json"):
                    json.loads(f.read_text("utf-8"))
                elif name.endswith(".parquet"):
                    pq.ParquetFile(f, page_checksum_verification=True).read()
                elif name.endswith(".safetensors"):
                    load_file(f)
            except Exception as e:  # noqa: BLE001 (whatever fails to read it, the file is not complete)
                bad.append(f"{rel}: {type(e).__name__}: {str(e)[:100]}")
    return bad, tmps


def main() -> None:
    ap = arguments(__doc__, prompts=4)
    ap.add_argument("--size", default="4m", help="tmpfs size")
    a = ap.parse_args()
    check = Check()
    with workdir(a.workdir, "specrun-fault-disk-") as root:
        model, prompts = setup(root, a.prompts, a.tokens)
        ref, ref_s = reference(prompts, model, root, a.tokens, a.actors)
        mnt = root / "mnt"
        mnt.mkdir(exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={a.size}", "tmpfs", str(mnt)], check=True)
        try:
            job, log, filler = mnt / "job", root / "driver.log", mnt / "filler"
            p = start(submit_args(prompts, model, job, a.tokens, a.actors), log)
            t0 = time.monotonic()
            try:
                while p.poll() is None and not list(job.glob("progress/*/chunk-*")):
                    time.sleep(0.02)
                filled = _fill(filler)
                full_at = time.monotonic() - t0
                print(f"disk full at {full_at:.1f} s (filler {filled} bytes)", flush=True)
                rc = p.wait(timeout=900)
                took = time.monotonic() - t0
            finally:
                end_group(p)
            text = log.read_text()
            said = [x for x in text.splitlines() if "No space" in x or "disk" in x.lower()]
            check(rc != 0, f"the run exited {rc} although the disk was full")
            check(bool(said), f"the driver did not say the disk is full:\n{text[-3000:]}")
            check("Traceback" not in text, f"a traceback:\n{text[-4000:]}")
            bad, tmps = _damaged(job)
            for b in bad:
                check(False, f"damaged visible file: {b}")
            for t in tmps:
                check(False, f"temporary file left: {t}")
            st = run(["status", job, "--json"])
            check(st.returncode == 0, f"status exited {st.returncode}: {st.stderr[-1500:]}")
            states = json.loads(st.stdout)["totals"] if st.returncode == 0 else {}
            filler.unlink()
            t1 = time.monotonic()
            r = run(["resume", job, "-q"])
            resume_s = time.monotonic() - t1
            check(r.returncode == 0, f"resume exited {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}")
            got, problems = outputs(job)
            for pr in problems + differences(got, ref):
                check(False, pr)
            check.exit({"fault": f"disk full (tmpfs {a.size}) during a job", "uninterrupted_s": round(ref_s, 1),
                        "full_at_s": round(full_at, 1), "exit": rc, "run_s": round(took, 1),
                        "driver_said": [x[:300] for x in said[:8]], "n_lines_about_disk": len(said),
                        "status_after": states, "damaged_files": bad, "temporaries_left": tmps,
                        "resume_exit": r.returncode, "resume_s": round(resume_s, 1),
                        "identical": not differences(got, ref) and not problems, "rows": len(got)})
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


if __name__ == "__main__":
    main()
