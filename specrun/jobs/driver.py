"""The driver loop: hands prompts (longest first) to idle workers, retries lost actors from the last checkpoint,
records outputs exactly once, and stops cleanly on Ctrl-C, SIGTERM or SIGHUP (twice: at once). Owns all policy;
workers only generate.

Nothing waits on Ray without a deadline: the cluster's resources are checked before any actor is started, each
actor must be placed within RunOptions.place_timeout_s and load its model within load_timeout_s (a worker that
misses its deadline is dropped with a warning; with none left the run ends with a JobError naming the missing
resource), and a stop waits at most stop_timeout_s for running prompts to checkpoint. A JobError leaves the job
resumable.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from specrun.actors.worker import WorkerSpec
from specrun.jobs.jobdir import JobDir, JobError
from specrun.jobs.progress import Display
from specrun.storage.chunks import read_progress
from specrun.storage.records import output_row

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 128 + signal.SIGINT  # a stop by signal S exits 128 + S


@dataclass(frozen=True)
class RunOptions:
    actors: int | None = None  # None: 1 on CPU, one per GPU in the cluster on CUDA
    address: str | None = None
    gpus_per_actor: float = 1.0  # used when the job's device is cuda
    max_attempts: int = 3
    hot_start: tuple[str, ...] = ()
    quiet: bool = False
    model_path: str | None = None  # where the model lives now (default: the manifest's path)
    poll_s: float = 0.25
    connect_timeout_s: float = 30.0  # --address: the Ray head must answer within this
    place_timeout_s: float = 60.0  # a worker actor must be placed (resources granted, process up) within this
    load_timeout_s: float = 1800.0  # ... and have loaded its model within this once placed
    stop_timeout_s: float = 60.0  # on Ctrl-C/SIGTERM/SIGHUP: longest wait for running prompts to checkpoint


@dataclass
class RunSummary:
    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    interrupted: bool = False
    stop_signal: int | None = None  # the signal that stopped the run (SIGINT, SIGTERM, SIGHUP)

    @property
    def exit_code(self) -> int:
        if self.failed:
            return EXIT_FAILED
        if self.interrupted:
            return 128 + (self.stop_signal or signal.SIGINT)
        return EXIT_OK


class _Interrupts:
    """The first SIGINT, SIGTERM or SIGHUP sets `requested` (checkpoint running prompts, then stop); a second one
    raises KeyboardInterrupt (stop now). Only in the main thread; the previous handlers (Ray's) come back on exit."""

    SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        self.old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum

    @property
    def name(self) -> str:
        return "Ctrl-C" if self.signum in (None, signal.SIGINT) else signal.Signals(self.signum).name

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)
        self.old = {}


class _SafeDisplay:
    """The Display, with output errors ignored: after SIGHUP the terminal is gone, and a failed write to it must not
    keep the running prompts from being checkpointed."""

    def __init__(self, display: Display):
        self._d = display

    def __getattr__(self, name):
        attr = getattr(self._d, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except OSError:
                return None
        return call


@dataclass
class _Start:
    """A worker actor on its way up: placed once `ping` answers, ready once `load` returns."""
    ping: object
    load: object
    t0: float
    placed_at: float | None = None
    what: str = "worker"

    def pending(self):
        return self.ping if self.placed_at is None else self.load


def run_job(job: JobDir, opts: RunOptions) -> RunSummary:
    """Run every prompt that is not done yet (failed ones are retried); the caller holds nothing, we take the lock."""
    job.acquire_lock()
    try:
        return _Driver(job, opts).run()
    finally:
        job.release_lock()


class _Driver:
    def __init__(self, job: JobDir, opts: RunOptions):
        self.job, self.opts, self.rec = job, opts, job.records
        self.manifest = job.manifest()
        self.prompts = {p.id: p for p in job.prompts()}
        self.summary = RunSummary()
        self.attempts: dict[str, int] = {}
        self.done_tokens = 0
        self.workers: dict = {}  # slot -> actor handle (starting, idle or busy)
        self.starting: dict[int, _Start] = {}
        self.idle: list[int] = []
        self.dropped: dict[int, tuple[str, str]] = {}  # slot -> (which worker, why) it has no worker any more
        self.stop_timed_out = False

    def run(self) -> RunSummary:
        todo = []
        self.finished_before = {}
        for pid, p in self.prompts.items():
            if self.rec.repair_marker(pid):
                self.finished_before[pid] = True
                self.done_tokens += (self.rec.read_done(pid) or {}).get("n_tokens", 0)
            else:
                self.rec.clear_failed(pid)
                todo.append(p)
        self.n_done_initial = len(self.prompts) - len(todo)
        self.display = _SafeDisplay(Display(len(self.prompts), self.n_done_initial,
                                            Display.choose_mode(self.opts.quiet)))
        try:
            if not todo:
                self.display.log(f"all {len(self.prompts)} prompts of {self.job.root} are done")
                return self.summary
            todo.sort(key=lambda p: len(p.input_ids) + p.params.max_tokens, reverse=True)  # longest first
            self._run_ray(deque(todo))
        finally:
            self.display.close()
        return self.summary

    # -- Ray ----------------------------------------------------------------------------------------------------
    def _spec(self) -> WorkerSpec:
        m, ck = self.manifest["model"], self.manifest["checkpoint"]
        return WorkerSpec(job_dir=str(self.job.root.resolve()), model=self.opts.model_path or m["path"],
                          fingerprint=m["fingerprint"], dtype=m["dtype"], device=m["device"],
                          trust_remote_code=m.get("trust_remote_code", False), engine=self.manifest["engine"],
                          checkpoint_every=ck["every"], checkpoint_seconds=ck["seconds"],
                          hot_start=tuple(os.path.abspath(h) for h in self.opts.hot_start),
                          threads=1 if m["device"] == "cpu" else 0, job_created_at=self.manifest.get("created_at"))

    def _run_ray(self, queue: deque) -> None:
        import ray

        from specrun.actors.pool import init_ray, resource_shortfall

        cuda = self.manifest["model"]["device"].startswith("cuda")
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
            spec = self._spec()
            if not cuda:  # split this machine's cores between the local CPU actors
                spec = dataclasses.replace(spec, threads=max(1, (os.cpu_count() or 1) // n))
            self.spec = spec
            self.display.log(f"job {self.job.root}: {len(queue)} prompts to run on {n} worker(s)")
            with _Interrupts() as intr:
                try:
                    for slot in range(n):
                        self._launch(slot)
                    self._loop(queue, intr)
                except KeyboardInterrupt:
                    self.summary.interrupted = True
                    self.summary.stop_signal = intr.signum
                    self.display.warn(f"stopped at once; checkpointed tokens are kept. Resume with: "
                                      f"specrun resume {self.job.root}")
                    raise
        finally:
            for w in self.workers.values():
                ray.kill(w, no_restart=True)
            self.workers.clear()
            if started:
                ray.shutdown()

    # -- worker slots: starting (with deadlines) -> idle <-> busy; lost -> relaunched; past a deadline -> dropped --
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
        """Moves workers that are up to idle; drops those past their placement or load deadline, or that failed."""
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
                        del self.starting[slot]
                        self.idle.append(slot)
                        if info.get("hot_start"):
                            self.display.log(f"{who}: recycling matrix warm from {info['hot_start']}")
                    elif now - st.placed_at > self.opts.load_timeout_s:
                        self._drop(slot, who, f"did not load the model within {self.opts.load_timeout_s:g} s "
                                              f"(RunOptions.load_timeout_s)")
            except ray.exceptions.RayError as e:  # died while starting, or the model failed to load
                self._drop(slot, who, f"failed while starting: {_cause(e)}")

    def _no_worker_error(self) -> JobError:
        by_why: dict[tuple[str, str], list[int]] = {}
        for slot, (who, why) in self.dropped.items():
            by_why.setdefault((who.rsplit(" ", 1)[0], why), []).append(slot)
        whys = "; ".join(f"{kind} {', '.join(map(str, slots))} {why}" for (kind, why), slots in by_why.items())
        return JobError(f"the generation workers could not start: {whys}. Checkpointed tokens are kept; "
                        f"`specrun resume {self.job.root}` continues the job")

    def _loop(self, queue: deque, intr: _Interrupts) -> None:
        import ray

        inflight: dict = {}  # ObjectRef -> (slot, prompt id)
        stopping, stop_by = False, 0.0
        while inflight or (queue and not stopping):
            if intr.requested and not stopping:
                stopping, stop_by = True, time.monotonic() + self.opts.stop_timeout_s
                self.summary.stop_signal = intr.signum
                self.display.warn(f"{intr.name}: checkpointing {len(inflight)} running prompt(s) and stopping "
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
            while self.idle and queue and not stopping:
                slot, p = self.idle.pop(0), queue.popleft()
                self.attempts[p.id] = self.attempts.get(p.id, 0) + 1
                task = {"id": p.id, "input_ids": list(p.input_ids), "params": dataclasses.asdict(p.params),
                        "resume_from": read_progress(self.job.progress_dir(p.id))}
                inflight[self.workers[slot].generate.remote(task)] = (slot, p.id)
            if not self.workers and queue and not stopping:
                raise self._no_worker_error()
            refs = list(inflight) + [st.pending() for st in self.starting.values()]
            ready = ray.wait(refs, num_returns=1, timeout=self.opts.poll_s)[0] if refs else []
            for ref in ready:
                if ref not in inflight:
                    continue  # a starting worker: _poll_starting takes it next round
                slot, pid = inflight.pop(ref)
                try:
                    res = ray.get(ref, timeout=0)
                except ray.exceptions.RayTaskError as e:  # the prompt itself failed: only this prompt
                    self._fail(pid, _cause(e))
                except ray.exceptions.RayError as e:  # the actor or its node died (or was OOM-killed): resume the
                    # prompt from its checkpoint on a new worker
                    ray.kill(self.workers.pop(slot), no_restart=True)
                    if not stopping:
                        self._launch(slot, what="replacement for lost worker")
                    if self.attempts[pid] >= self.opts.max_attempts:
                        self._fail(pid, f"worker lost {self.attempts[pid]} times; last error: {_cause(e)}")
                    else:
                        if not stopping:
                            self.display.warn(f"prompt {pid!r}: worker lost ({type(e).__name__}); retrying from "
                                              f"its last checkpoint")
                        queue.appendleft(self.prompts[pid])
                    continue
                else:
                    self._finish(res)
                self.idle.append(slot)
            self._refresh(inflight)
        self.summary.interrupted = stopping and bool(queue or self.summary.stopped)
        self._report(queue)

    def _finish(self, res: dict) -> None:
        pid = res["id"]
        for w in res.get("warnings") or ():
            self.display.warn(f"prompt {pid!r}: {w} (best-effort, retried at each checkpoint)")
        if res["stopped"]:
            self.summary.stopped.append(pid)
            return
        p = self.prompts[pid]
        try:
            self.rec.write_output(output_row(pid, res["token_ids"], res["text"], res["finish_reason"], res["stats"],
                                             prompt_tokens=len(p.input_ids), resumed_tokens=res["resumed_tokens"],
                                             attempts=self.attempts[pid]))
        except OSError as e:  # disk full, stale handle: the prompt is not done; its checkpoints are kept
            self._fail(pid, f"could not write its output row: {type(e).__name__}: {e}")
            return
        self.done_tokens += len(res["token_ids"])
        self.summary.done.append(pid)

    def _fail(self, pid: str, error: str) -> None:
        try:
            self.rec.mark_failed(pid, error, self.attempts[pid])
        except OSError as e:
            error += f" (and the failure could not be recorded: {type(e).__name__}: {e})"
        self.summary.failed[pid] = error
        self.display.warn(f"prompt {pid!r} failed: {error}")

    def _refresh(self, inflight: dict) -> None:
        live = {pid: info for _, pid in inflight.values() if (info := self.rec.read_live(pid))}
        done = self.n_done_initial + len(self.summary.done)
        total = self.done_tokens + sum(p.params.max_tokens for pid, p in self.prompts.items()
                                       if pid not in self.summary.done and not self.finished_before.get(pid))
        self.display.update(live, done, self.done_tokens + sum(i.get("tokens", 0) for i in live.values()), total)

    def _report(self, queue: deque) -> None:
        s = self.summary
        self.display.log(f"{len(s.done)} prompt(s) finished, {len(s.failed)} failed"
                         + (f", {len(s.stopped) + len(queue)} left" if s.interrupted else ""))
        if s.interrupted:
            kept = "checkpointed tokens are kept" if self.stop_timed_out else "every generated token is checkpointed"
            self.display.warn(f"stopped; {kept}. Resume with: specrun resume {self.job.root}")
        if not s.interrupted and not s.failed:
            self.display.log(f"outputs: {self.job.root}/outputs; read them with: specrun export {self.job.root} "
                             f"--format jsonl")
        if s.failed:
            self.display.warn(f"{len(s.failed)} prompt(s) failed; see `specrun status {self.job.root}`; "
                              f"`specrun resume {self.job.root}` retries them")


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
