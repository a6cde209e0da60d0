"""The driver loop: hands prompts (longest first) to idle workers, retries lost actors from the last checkpoint,
records outputs exactly once, and stops cleanly on Ctrl-C, SIGTERM or SIGHUP (twice: at once). Owns all policy;
workers only generate.

Nothing waits on Ray without a deadline: the cluster's resources are checked before any actor is started, each
actor must be placed within RunOptions.place_timeout_s and load its model within load_timeout_s (a worker that
misses its deadline is dropped with a warning; with none left the run ends with a JobError naming the missing
resource), and a stop waits at most stop_timeout_s for running prompts to checkpoint. A JobError leaves the job
resumable.

Scale: the run starts from one scan of the outputs (Records.repair); after that, every event (a prompt finished,
failed or was lost) costs O(1): counters, never a pass over the prompts. A finished prompt's row is written durably,
then its done marker, then its progress chunks are removed (I3); parts are merged in the background (compaction.py)
and, once every prompt is done, into one output file. The driver keeps no token ids of its own: the prompts' stay in
Arrow until dispatched. If the job lock is lost (storage/lock.py), the run stops as on SIGTERM.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import time
from collections import deque

from specrun.jobs.attempts import attempt_settings, recorded_attempt
from specrun.jobs.compaction import Compactor
from specrun.jobs.interrupts import _Interrupts, _SafeDisplay
from specrun.jobs.jobdir import JobDir, JobError
from specrun.jobs.progress import make_view
from specrun.jobs.runopts import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, RunOptions, RunSummary  # noqa: F401
from specrun.jobs.slots import _cause, _Slots, _Start
from specrun.jobs.snapshot import Snapshot
from specrun.jobs.workerspec import tokens_ahead, worker_spec
from specrun.storage.chunks import read_progress
from specrun.storage.outputs import is_foreign
from specrun.storage.records import output_row

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
REFRESH_S = 0.5  # the display (and the live files it reads) is refreshed at most this often

def run_job(job: JobDir, opts: RunOptions, view=None) -> RunSummary:
    """Run every prompt that is not done yet (failed ones are retried); the caller holds nothing, we take the lock.
    The run is recorded as the job's next attempt (jobs/attempts.py) with the settings it uses. Progress goes to
    `view` (progress.py; default make_view(opts.quiet))."""
    settings = attempt_settings(job.manifest(), opts)
    job.acquire_lock()
    try:
        with recorded_attempt(job, settings) as end:
            end["summary"] = _Driver(job, opts, settings, view).run()
            return end["summary"]
    finally:
        job.release_lock()


class _Driver(_Slots):
    """Bookkeeping is O(1) per event (a prompt finished, failed or was lost): counters, never scans of the prompts;
    the display reads the in-flight prompts' live files at most every REFRESH_S."""

    def __init__(self, job: JobDir, opts: RunOptions, settings: dict, view=None):
        self.job, self.opts, self.rec = job, opts, job.records
        self.view = view if view is not None else make_view(opts.quiet)  # progress.py: what the run shows
        self.manifest = job.manifest()
        self.settings = settings  # this attempt's (attempts.attempt_settings)
        infos, self.input_ids = job.prompt_infos()  # token ids stay in Arrow until a prompt is dispatched
        self.prompts = {p.id: p for p in infos}
        self.summary = RunSummary()
        self.attempts: dict[str, int] = {}
        self.done_tokens = 0
        self.workers: dict = {}  # slot -> actor handle (starting, idle or busy)
        self.starting: dict[int, _Start] = {}
        self.idle: list[int] = []
        self.dropped: dict[int, tuple[str, str]] = {}  # slot -> (which worker, why) it has no worker any more
        self.lost_nodes: list[str] = []  # Ray nodes that died with a worker on them (named in errors)
        self.stop_timed_out = False
        self.last_refresh = 0.0

    def run(self) -> RunSummary:
        ids = list(self.prompts)
        scan = self.rec.repair(ids)  # outputs verified, markers and leftovers made to agree with them
        todo = [p for pid, p in self.prompts.items() if pid not in scan.rows]
        for p in todo:
            self.rec.clear_failed(p.id)
        self.n_done_initial = len(self.prompts) - len(todo)
        self.done_tokens = sum(r["n_tokens"] for r in scan.rows.values())
        self.tokens_left = sum(p.params.max_tokens for p in todo)  # max_tokens of the prompts not done yet
        self.compactor = Compactor(self.rec, ids)
        self.compactor.pending.extend(scan.in_parts)
        self.display = _SafeDisplay(self.view)
        try:
            for problem in scan.problems:
                lost = "" if is_foreign(problem) else "; the prompts it held are generated again"
                self.display.warn(f"outputs: {problem}{lost}")
            if not todo:
                self.display.log(f"all {len(self.prompts)} prompts of {self.job.root} are done")
            else:
                todo.sort(key=lambda p: p.n_input + p.params.max_tokens, reverse=True)  # longest first
                self._run_ray(deque(todo))
        except KeyboardInterrupt:  # stop at once
            self.compactor.cancel()
            raise
        except JobError:  # no worker could start: what did finish is merged, the rest resumes later
            self._compact_final()
            raise
        except BaseException:
            self.compactor.wait()
            raise
        else:
            self._compact_final()
        finally:
            self.display.close()
        return self.summary

    def _compact_final(self) -> None:
        """Merge every part left; when every prompt is done, leave one output file."""
        all_done = self.n_done_initial + len(self.summary.done) == len(self.prompts)
        self.compactor.finish(everything=all_done)
        for m in self.compactor.drain():
            self.display.warn(m)

    # -- Ray ----------------------------------------------------------------------------------------------------
    def _run_ray(self, queue: deque) -> None:
        import ray

        from specrun.actors.pool import init_ray, resource_shortfall

        cuda = self.settings["device"].startswith("cuda")
        n = self.opts.actors
        # a local Ray gets at least one CPU per requested actor, or extra actors would wait forever
        try:
            started = init_ray(self.opts.address, num_cpus=max(os.cpu_count() or 1, n or 1),
                               connect_timeout_s=self.opts.connect_timeout_s)
        except ConnectionError as e:
            raise JobError(f"{e}. Nothing was run; `specrun resume {self.job.root}` continues the job") from None
        try:
            if n is None:
                n = max(1, int(ray.cluster_resources().get("GPU", 0) / self.opts.gpus_per_actor)) if cuda else 1
            n = max(1, min(n, len(queue)))
            self.gpus = self.opts.gpus_per_actor if cuda else 0.0
            short = resource_shortfall(n, self.gpus, self.opts.actors)
            if short:
                raise JobError(f"cannot start the generation workers: {short}. Nothing was run; "
                               f"`specrun resume {self.job.root}` continues the job")
            spec = worker_spec(self.job, self.manifest, self.settings, self.prompts.values(), n, len(queue))
            if not cuda:  # split this machine's cores between the local CPU actors
                spec = dataclasses.replace(spec, threads=max(1, (os.cpu_count() or 1) // n))
            spec = dataclasses.replace(spec, tokens_ahead=tokens_ahead(queue, self.rec.checkpointed(), n))
            self.spec = spec
            self.display.log(f"job {self.job.root}: {len(queue)} prompts to run on {n} worker(s)")
            with _Interrupts() as intr:
                try:
                    for slot in range(n):
                        self._launch(slot)
                    self._loop(queue, intr)
                    if not self.summary.interrupted:
                        self._save_worker_state()
                except KeyboardInterrupt:
                    self.summary.interrupted = True
                    self.summary.stop_signal = intr.signum
                    self.display.warn(f"stopped at once; checkpointed tokens are kept. Resume with: "
                                      f"specrun resume {self.job.root}")
                    raise
        finally:
            # a signal now finds the work done (or already stopping): noted, not raised, so that Ray is shut down whole
            # and a finished run reports done (a second signal still stops at once)
            with _Interrupts():
                for w in self.workers.values():
                    ray.kill(w, no_restart=True)
                self.workers.clear()
                if started:
                    ray.shutdown()

    def _loop(self, queue: deque, intr: _Interrupts) -> None:
        import ray

        inflight: dict = {}  # ObjectRef -> (slot, prompt id)
        stopping, stop_by = False, 0.0
        while inflight or (queue and not stopping):
            lock_lost = not stopping and self.job.lock_lost()
            full = self.summary.disk_full is not None
            if (intr.requested or lock_lost or full) and not stopping:
                stopping, stop_by = True, time.monotonic() + self.opts.stop_timeout_s
                self.summary.stop_signal = intr.signum if intr.requested else signal.SIGTERM
                why = (intr.name if intr.requested else "the disk is full" if full
                       else "the job lock was lost (see the warning above)")
                self.display.warn(f"{why}: checkpointing {len(inflight)} running prompt(s) and stopping "
                                  f"({intr.name} again to stop at once)")
                for slot, _ in inflight.values():
                    self.workers[slot].request_stop.remote()
            if stopping and time.monotonic() > stop_by:
                left = [pid for _, pid in inflight.values()]
                self.summary.stopped.extend(left)
                self.stop_timed_out = True
                self.display.warn(f"{len(left)} prompt(s) did not checkpoint within {self.opts.stop_timeout_s:g} s "
                                  f"(RunOptions.stop_timeout_s); they resume from their last checkpoint")
                break
            if self.starting:
                self._poll_starting()
            self._dispatch(queue, inflight, stopping)
            if not self.workers and queue and not stopping:
                raise self._no_worker_error()
            refs = list(inflight) + [st.pending() for st in self.starting.values()]
            ready = ray.wait(refs, num_returns=1, timeout=self.opts.poll_s)[0] if refs else []
            for ref in ready:
                if ref not in inflight:
                    continue  # a starting worker: _poll_starting takes it next round
                slot, pid = inflight.pop(ref)
                res = None
                try:
                    res = ray.get(ref, timeout=0)
                except ray.exceptions.RayTaskError as e:  # the prompt itself failed: only this prompt
                    self._fail(pid, _cause(e))
                except ray.exceptions.RayError as e:  # the actor or its node died (or was OOM-killed)
                    self._worker_lost(slot, pid, e, inflight, queue, stopping)
                    continue
                self.idle.append(slot)
                self._dispatch(queue, inflight, stopping)  # the worker goes on while the output row is written
                if res is not None:
                    self._finish(res)
            self._refresh(inflight)
        self._refresh(inflight, force=True)
        self.summary.interrupted = stopping and bool(queue or self.summary.stopped)
        for warn, line in self.summary.closing(self.job.root, len(queue), self.stop_timed_out):
            (self.display.warn if warn else self.display.log)(line)

    def _dispatch(self, queue: deque, inflight: dict, stopping: bool) -> None:
        while self.idle and queue and not stopping:
            slot, p = self.idle.pop(0), queue.popleft()
            self.attempts[p.id] = self.attempts.get(p.id, 0) + 1
            task = {"id": p.id, "input_ids": self.input_ids[p.row].as_py(),
                    "params": dataclasses.asdict(p.params), "resume_from": read_progress(self.job.progress_dir(p.id))}
            inflight[self.workers[slot].generate.remote(task)] = (slot, p.id)

    def _finish(self, res: dict) -> None:
        pid = res["id"]
        for w in res.get("warnings") or ():
            self.display.warn(f"prompt {pid!r}: {w} (best-effort, retried at each checkpoint)")
        if res["stopped"]:
            if res.get("disk_full"):
                self._disk_full(pid, OSError(errno.ENOSPC, res["disk_full"]))
            else:
                self.summary.stopped.append(pid)
            return
        p = self.prompts[pid]
        try:
            self.rec.write_output(output_row(pid, res["token_ids"], res["text"], res["finish_reason"], res["stats"],
                                             prompt_tokens=p.n_input, resumed_tokens=res["resumed_tokens"],
                                             attempts=self.attempts[pid]))
        except OSError as e:  # disk full, stale handle: the prompt is not done; its checkpoints are kept
            if e.errno in DISK_FULL:
                self._disk_full(pid, e)
            else:
                self._fail(pid, f"could not write its output row: {type(e).__name__}: {e}")
            return
        try:  # every token is in the durable row now: the chunks have served (I3)
            self.rec.drop_progress(pid)
        except OSError as e:
            self.display.warn(f"prompt {pid!r}: could not remove its progress chunks ({e}); the next run does")
        self.done_tokens += len(res["token_ids"])
        self.tokens_left -= p.params.max_tokens
        self.summary.done.append(pid)
        self.compactor.add(pid)
        for m in self.compactor.drain():
            self.display.warn(m)

    def _disk_full(self, pid: str, e: OSError) -> None:
        """No space for a prompt's row or checkpoint: it stays not done (its checkpoints are kept), nothing more starts,
        and the running prompts are asked to checkpoint what they can and stop (the loop sees summary.disk_full)."""
        self.summary.stopped.append(pid)
        if self.summary.disk_full is None:
            self.summary.disk_full = f"{e.filename or self.rec.outputs}: {e.strerror or e}"
            self.display.warn(f"no space left on the job's disk ({self.summary.disk_full}), seen by prompt {pid!r}: "
                              f"starting no more prompts")

    def _fail(self, pid: str, error: str) -> None:
        try:
            self.rec.mark_failed(pid, error, self.attempts[pid])
        except OSError as e:
            error += f" (and the failure could not be recorded: {type(e).__name__}: {e})"
        self.summary.failed[pid] = error
        self.display.warn(f"prompt {pid!r} failed: {error}")

    def _refresh(self, inflight: dict, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_refresh < REFRESH_S:
            return
        self.last_refresh = now
        live = {pid: info for _, pid in inflight.values() if (info := self.rec.read_live(pid))}
        done = self.n_done_initial + len(self.summary.done)
        self.display.update(Snapshot(len(self.prompts), done, self.done_tokens + sum(i.get("tokens", 0)
                                                                               for i in live.values()),
                                     self.done_tokens + self.tokens_left, live))
