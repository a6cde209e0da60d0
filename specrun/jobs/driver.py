"""The driver loop: hands prompts (longest first) to idle workers, retries lost actors from the last checkpoint,
records outputs exactly once, and stops cleanly on Ctrl-C (twice: at once). Owns all policy; workers only generate.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections import deque
from dataclasses import dataclass, field

from specrun.actors.worker import WorkerSpec
from specrun.jobs.jobdir import JobDir, JobError
from specrun.jobs.progress import Display
from specrun.storage.chunks import read_progress
from specrun.storage.records import output_row

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


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


@dataclass
class RunSummary:
    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        return EXIT_FAILED if self.failed else EXIT_INTERRUPTED if self.interrupted else EXIT_OK


class _Interrupts:
    """First SIGINT sets `requested`; the second raises KeyboardInterrupt (stop now). Only in the main thread."""

    def __init__(self):
        self.requested = False
        self.old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)


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
        self.display = Display(len(self.prompts), self.n_done_initial, Display.choose_mode(self.opts.quiet))
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
                          hot_start=tuple(os.path.abspath(h) for h in self.opts.hot_start), threads=1 if m["device"] == "cpu" else 0)

    def _run_ray(self, queue: deque) -> None:
        import ray

        from specrun.actors.pool import infra_errors, init_ray, start_worker

        cuda = self.manifest["model"]["device"].startswith("cuda")
        n = self.opts.actors
        # a local Ray gets at least one CPU per requested actor, or extra actors would wait forever
        started = init_ray(self.opts.address, num_cpus=None if cuda else max(os.cpu_count() or 1, n or 1))
        try:
            if n is None:
                n = max(1, int(ray.cluster_resources().get("GPU", 0) / self.opts.gpus_per_actor)) if cuda else 1
            n = max(1, min(n, len(queue)))
            gpus = self.opts.gpus_per_actor if cuda else 0.0
            spec = self._spec()
            if not cuda:  # split this machine's cores between the local CPU actors
                spec = dataclasses.replace(spec, threads=max(1, (os.cpu_count() or 1) // n))
            self.workers = [start_worker(spec, i, gpus) for i in range(n)]
            try:
                infos = ray.get([w.info.remote() for w in self.workers])
            except infra_errors() as e:
                raise JobError(f"the generation workers could not start: {_cause(e)}") from None
            hot = {i["hot_start"] for i in infos} - {None}
            self.display.log(f"job {self.job.root}: {len(queue)} prompts to run on {n} worker(s)"
                             + (f", recycling matrix warm from {', '.join(sorted(hot))}" if hot else ""))
            with _Interrupts() as intr:
                try:
                    self._loop(queue, spec, gpus, intr, infra_errors())
                except KeyboardInterrupt:
                    self.summary.interrupted = True
                    self.display.warn(f"stopped at once; checkpointed tokens are kept. Resume with: "
                                      f"specrun resume {self.job.root}")
                    raise
        finally:
            for w in getattr(self, "workers", []):
                ray.kill(w, no_restart=True)
            if started:
                ray.shutdown()

    def _loop(self, queue: deque, spec: WorkerSpec, gpus: float, intr: _Interrupts, infra) -> None:
        import ray

        from specrun.actors.pool import start_worker

        idle = list(range(len(self.workers)))
        inflight: dict = {}  # ObjectRef -> (slot, prompt id)
        stopping = False
        while inflight or (queue and not stopping):
            if intr.requested and not stopping:
                stopping = True
                self.display.warn(f"Ctrl-C: checkpointing {len(inflight)} running prompt(s) and stopping "
                                  f"(Ctrl-C again to stop at once)")
                for slot, _ in inflight.values():
                    self.workers[slot].request_stop.remote()
            while idle and queue and not stopping:
                slot, p = idle.pop(0), queue.popleft()
                self.attempts[p.id] = self.attempts.get(p.id, 0) + 1
                task = {"id": p.id, "input_ids": list(p.input_ids), "params": dataclasses.asdict(p.params),
                        "resume_from": read_progress(self.job.progress_dir(p.id))}
                inflight[self.workers[slot].generate.remote(task)] = (slot, p.id)
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=self.opts.poll_s)
            for ref in ready:
                slot, pid = inflight.pop(ref)
                try:
                    res = ray.get(ref)
                except infra as e:  # the actor or its node died: resume the prompt from its checkpoint elsewhere
                    ray.kill(self.workers[slot], no_restart=True)
                    self.workers[slot] = start_worker(spec, slot, gpus)
                    if self.attempts[pid] >= self.opts.max_attempts:
                        self._fail(pid, f"worker lost {self.attempts[pid]} times; last error: {_cause(e)}")
                    else:
                        self.display.warn(f"prompt {pid!r}: worker lost ({type(e).__name__}); retrying from its "
                                          f"last checkpoint")
                        queue.appendleft(self.prompts[pid])
                except ray.exceptions.RayTaskError as e:  # the prompt itself failed: only this prompt
                    self._fail(pid, _cause(e))
                else:
                    self._finish(res)
                idle.append(slot)
            self._refresh(inflight)
        self.summary.interrupted = stopping and bool(queue or self.summary.stopped)
        self._report(queue)

    def _finish(self, res: dict) -> None:
        pid = res["id"]
        if res["stopped"]:
            self.summary.stopped.append(pid)
            return
        p = self.prompts[pid]
        self.rec.write_output(output_row(pid, res["token_ids"], res["text"], res["finish_reason"], res["stats"],
                                         prompt_tokens=len(p.input_ids), resumed_tokens=res["resumed_tokens"],
                                         attempts=self.attempts[pid]))
        self.done_tokens += len(res["token_ids"])
        self.summary.done.append(pid)

    def _fail(self, pid: str, error: str) -> None:
        self.rec.mark_failed(pid, error, self.attempts[pid])
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
            self.display.warn(f"stopped; every generated token is checkpointed. Resume with: "
                              f"specrun resume {self.job.root}")
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
