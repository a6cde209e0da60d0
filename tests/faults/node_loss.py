"""Fault 4 (issue 11, item 8): a node removed from a 3-node local Ray cluster (ray.cluster_utils.Cluster) mid-job.

    OMP_NUM_THREADS=1 python -m tests.faults.node_loss --prompts 4 --tokens 300

The driver runs as `specrun submit --address <cluster>` in a subprocess; the head node has no CPU (it hosts no
worker, and the driver is attached to it), the 3 added nodes are where workers go. Once a worker has checkpointed,
the node it runs on (found from the worker's pid: its raylet is its parent) is removed.

- spare: 3 nodes of 1 CPU, --actors 2: the lost worker is replaced on the third node; the job completes (exit 0).
- no room: 1 node of 1 CPU and 2 of 0 CPU, --actors 1: the replacement can never be placed; the run fails within
  RunOptions.place_timeout_s (60 s) with an error naming what is missing, and stays resumable: a node of 1 CPU is
  added and `specrun resume --address` completes the job.
Both end with outputs identical to an uninterrupted run (a local Ray, no cluster).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.faults.common import (REPO, Check, arguments, differences, end_group, env, live_infos, outputs, reference,
                                 run, setup, start, submit_args, workdir)


def _busy_worker(job: Path) -> dict | None:
    return next((i for i in live_infos(job) if i.get("checkpointed", 0) >= 16 and i["tokens"] < i["max_tokens"] - 60),
                None)


def _node_of(cluster, pid: int):
    import psutil
    from ray._private import ray_constants

    parents = {p.pid for p in psutil.Process(pid).parents()}
    for node in cluster.worker_nodes:
        raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        if raylet in parents:
            return node
    return None


def _unadvertise(address: str) -> None:
    """Ray writes the new cluster's address to /tmp/ray/ray_current_cluster, where every plain ray.init() on this
    machine (other users' tests, specrun without --address) would join it: take it back (we pass the address)."""
    from ray._common.utils import get_ray_address_file

    f = Path(get_ray_address_file(None))
    if f.exists() and f.read_text().strip() == address:
        f.unlink()


def scenario(name: str, cpus: list[int], actors: int, root: Path, model: str, prompts: Path, tokens: int,
             ref: dict, check: Check) -> dict:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    _unadvertise(cluster.address)
    try:
        for c in cpus:
            cluster.add_node(num_cpus=c)
        cluster.wait_for_nodes()
        job, log = root / f"job-{name}", root / f"driver-{name}.log"
        p = start([*submit_args(prompts, model, job, tokens, actors), "--address", cluster.address], log)
        t0 = time.monotonic()
        try:
            victim = None
            while p.poll() is None and time.monotonic() - t0 < 600:
                victim = _busy_worker(job)
                if victim:
                    break
                time.sleep(0.05)
            node = _node_of(cluster, victim["pid"]) if victim else None
            check(node is not None, f"{name}: no busy worker found on a removable node")
            removed_at = None
            if node is not None:
                cluster.remove_node(node)
                removed_at = time.monotonic() - t0
                print(f"{name}: removed node {node.node_id[:12]} (raylet of worker pid {victim['pid']}, prompt "
                      f"{victim['id']!r} at {victim['tokens']} tokens, {victim['checkpointed']} checkpointed) at "
                      f"{removed_at:.1f} s", flush=True)
            rc = p.wait(timeout=900)
            took = time.monotonic() - t0
        finally:
            end_group(p)
        text = log.read_text()
        res = {"scenario": name, "node_cpus": cpus, "actors": actors, "removed_at_s": round(removed_at or 0, 1),
               "exit": rc, "run_s": round(took, 1), "driver_said": [x for x in text.splitlines() if x.strip()][-6:]}
        check("Traceback" not in text, f"{name}: a traceback:\n{text[-3000:]}")
        if rc != 0:
            check("specrun resume" in text, f"{name}: the failure does not say how to resume:\n{text[-2000:]}")
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            r = run(["resume", job, "-q", "--address", cluster.address])
            res["resume_exit"] = r.returncode
            check(r.returncode == 0, f"{name}: resume exited {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}")
        got, problems = outputs(job)
        for pr in problems + differences(got, ref):
            check(False, f"{name}: {pr}")
        res["identical"] = not differences(got, ref) and not problems
        print(f"{name}: {res}", flush=True)
        return res
    finally:
        cluster.shutdown()


def main() -> None:
    ap = arguments(__doc__, prompts=4, actors=None)
    ap.add_argument("--scenario", choices=["spare", "no-room", "both"], default="both")
    a = ap.parse_args()
    os.environ.update(env())  # the cluster's workers import this checkout
    assert os.environ["PYTHONPATH"].startswith(str(REPO))
    check = Check()
    with workdir(a.workdir, "specrun-fault-node-") as root:
        model, prompts = setup(root, a.prompts, a.tokens)
        ref, ref_s = reference(prompts, model, root, a.tokens, 2)
        results = []
        if a.scenario in ("spare", "both"):
            results.append(scenario("spare", [1, 1, 1], 2, root, model, prompts, a.tokens, ref, check))
        if a.scenario in ("no-room", "both"):
            results.append(scenario("no-room", [1, 0, 0], 1, root, model, prompts, a.tokens, ref, check))
        check.exit({"fault": "a node removed from a 3-node Ray cluster mid-job", "uninterrupted_s": round(ref_s, 1),
                    "scenarios": results})


if __name__ == "__main__":
    main()
