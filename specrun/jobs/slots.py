"""The driver's worker slots: starting (placed once `ping` answers, ready once `load` returns, or once `warm` then
returns where load says a graph must compile: each with a deadline) -> idle <-> busy; a lost worker is relaunched;
one past a deadline, or failing to start, is dropped with a warning, and with none left the run ends with a JobError
naming what is missing (the job stays resumable).

A mixin of jobs.driver._Driver (it uses self.spec, self.gpus, self.opts, self.display, self.job, the slot dicts,
and for a lost worker's prompts self.attempts, self.prompts, self.lost_nodes and self._fail).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from specrun.jobs.jobdir import JobError

SAVE_STATE_TIMEOUT_S = 10.0  # at the end: longest wait for idle workers to save their recycling matrix


@dataclass
class _Start:
    """A worker actor on its way up: placed once `ping` answers, ready once `load` returns (and, where its load says
    a graph must compile, once `warm` then returns)."""
    ping: object
    load: object
    t0: float
    placed_at: float | None = None
    what: str = "worker"
    warming: bool = False

    def pending(self):
        return self.ping if self.placed_at is None else self.load



class _Slots:
    def _launch(self, slot: int, what: str = "worker") -> None:
        from specrun.actors.pool import start_worker

        w = start_worker(self.spec, slot, self.gpus)
        self.workers[slot] = w
        self.starting[slot] = _Start(w.ping.remote(), w.load.remote(), time.monotonic(), what=what)

    def _drop(self, slot: int, who: str, why: str) -> None:
        """Give up on a slot's worker; with none left the loop raises _no_worker_error (which says why)."""
        import ray

        ray.kill(self.workers.pop(slot), no_restart=True)
        self.starting.pop(slot, None)
        self.dropped[slot] = (who, why)
        if self.workers:
            self.display.warn(f"{who} {why}; going on with {len(self.workers)} worker(s)")

    def _poll_starting(self) -> None:
        """Moves workers that are up to idle (warming first those whose load says a graph compiles); drops those past
        their placement, load or warm deadline, or that failed."""
        import ray

        from specrun.actors.pool import describe_resources

        now = time.monotonic()
        for slot, st in list(self.starting.items()):
            who = f"{st.what} {slot}"
            try:
                if st.placed_at is None:
                    if ray.wait([st.ping], timeout=0)[0]:
                        ray.get(st.ping, timeout=0)
                        st.placed_at = now
                    elif now - st.t0 > self.opts.place_timeout_s:
                        self._drop(slot, who, f"could not be placed on the Ray cluster within "
                                              f"{self.opts.place_timeout_s:g} s: {describe_resources(self.gpus)}")
                        continue
                if st.placed_at is not None:
                    if ray.wait([st.load], timeout=0)[0]:
                        info = ray.get(st.load, timeout=0)
                        if info.get("compiles") and not st.warming:  # before any prompt: nothing stalls mid-run
                            what = " and ".join(info.get("builds") or ["the quantized self-draft"])
                            self.display.log(f"{who}: compiling {what} for this machine (a minute or more each, once: "
                                             f"later runs load them)")
                            st.load, st.warming, st.placed_at = self.workers[slot].warm.remote(), True, now
                            continue
                        if info.get("compile_failed"):
                            self.display.warn(f"{who}: the quantized self-draft did not compile ({info['compile_failed']});"
                                              f" it drafts with the eager one")
                        if info.get("layers_failed"):
                            self.display.warn(f"{who}: the layers did not compile ({info['layers_failed']}); they run "
                                              f"eagerly")
                        del self.starting[slot]
                        seats = info.get("concurrency", 1)
                        self.idle.extend([slot] * seats)  # one seat per sequence it runs at once
                        if seats > 1 and self.spec.auto_concurrency:
                            self.display.log(f"{who}: {seats} prompts at once (--concurrency auto)")
                        if info.get("hot_start"):
                            self.display.log(f"{who}: recycling matrix warm from {info['hot_start']}")
                    elif now - st.placed_at > self.opts.load_timeout_s:
                        self._drop(slot, who, f"did not {'compile its draft' if st.warming else 'load the model'} "
                                              f"within {self.opts.load_timeout_s:g} s "
                                              f"(RunOptions.load_timeout_s)")
            except ray.exceptions.RayError as e:  # died while starting, or the model failed to load
                self._drop(slot, who, f"failed while starting: {_cause(e)}")

    def _worker_lost(self, slot: int, pid: str, e, inflight: dict, queue, stopping: bool) -> None:
        """Resume every prompt the lost worker ran (pid and the others in flight on it) from their checkpoints on a
        replacement; a prompt lost max_attempts times fails."""
        import ray

        ray.kill(self.workers.pop(slot), no_restart=True)
        self.idle = [s for s in self.idle if s != slot]  # its free seats went with it
        lost = [pid] + [inflight.pop(r)[1] for r in [r for r, (s, _) in inflight.items() if s == slot]]
        node = _node_lost(e)
        if node and node not in self.lost_nodes:
            self.lost_nodes.append(node)
        if not stopping:
            self._launch(slot, what="replacement for lost worker")
        for pid in lost:
            if self.attempts[pid] >= self.opts.max_attempts:
                self._fail(pid, f"worker lost {self.attempts[pid]} times; last error: {_cause(e)}")
                continue
            if not stopping:
                self.display.warn(f"prompt {pid!r}: worker lost ({type(e).__name__}"
                                  f"{f'; its {node} died' if node else ''}); retrying from its last checkpoint")
            queue.appendleft(self.prompts[pid])

    def _save_worker_state(self) -> None:
        """At the end of a run, the (idle) workers write their recycling matrix once more: they snapshot it only
        every WorkerSpec.snapshot_seconds. Best-effort, within SAVE_STATE_TIMEOUT_S."""
        import ray

        refs = [self.workers[slot].save_state.remote() for slot in self.idle if slot in self.workers]
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=SAVE_STATE_TIMEOUT_S)
            except Exception:
                pass

    def _no_worker_error(self) -> JobError:
        by_why: dict[tuple[str, str], list[int]] = {}
        for slot, (who, why) in self.dropped.items():
            by_why.setdefault((who.rsplit(" ", 1)[0], why), []).append(slot)
        whys = "; ".join(f"{kind} {', '.join(map(str, slots))} {why}" for (kind, why), slots in by_why.items())
        lost = f" (workers were lost with {', '.join(self.lost_nodes)})" if self.lost_nodes else ""
        return JobError(f"the generation workers could not start: {whys}{lost}. Checkpointed tokens are kept; "
                        f"`specrun resume {self.job.root}` continues the job")



def _node_lost(e: BaseException) -> str | None:
    """'node 16abc0e6f8d9 (192.0.2.2)' when Ray says the actor died because its node died, else None."""
    text = str(e)
    node = re.search(r"its node has died\. Node Id: ([0-9a-f]+)", text)
    ip = re.search(r"^\s*ip: (\S+)", text, re.M)
    return f"node {node.group(1)[:12]}" + (f" ({ip.group(1)})" if ip else "") if node else None


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
