"""GenerationWorker: loads the model and builds the Engine once, then generates prompts one at a time with checkpoints.

Plain class (Ray wraps it in pool.py); writes progress chunks, timeline rows, matrix snapshots and live status to the
shared job dir, best-effort: a failed write (disk full, stale NFS handle) is logged, reported with the result and
retried at the next checkpoint; it never fails the prompt (the driver's output write is the one that must succeed).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from dataclasses import dataclass, field

from specrun.actors.batch_loop import BatchLoop
from specrun.actors.checkpointer import Checkpointer
from specrun.actors.compute import ComputeThread
from specrun.storage.atomic import read_json
from specrun.storage.fs import job_path
from specrun.storage.records import Records
from specrun.storage.state import load_matrix, save_matrix


@dataclass(frozen=True)
class WorkerSpec:
    job_dir: str
    model: str
    fingerprint: str
    dtype: str = "float32"
    device: str = "cpu"
    trust_remote_code: bool = False
    engine: dict = field(default_factory=dict)  # EngineConfig fields
    checkpoint_every: int = 2048
    checkpoint_seconds: float = 60.0
    hot_start: tuple[str, ...] = ()  # other job dirs whose matrix snapshots may warm a cold worker
    threads: int = 0  # torch CPU threads (0 = leave as is)
    job_created_at: float | None = None  # the manifest's created_at: proves a worker sees the driver's job directory
    snapshot_seconds: float = 60.0  # the recycling matrix is written at most this often (a stop always writes it)
    concurrency: int = 1  # sequences generated at once (decoding/engine.py carries them in one step)
    auto_concurrency: bool = False  # concurrency is a cap: load() lowers it to what the KV memory budget holds
    kv_need: int = 0  # KV slots one sequence may need (the job's longest prompt + max_tokens + a trie)
    page_size: int = 1  # with concurrency > 1 the engine's KV pages hold this many tokens
    workers: int = 1  # the run's workers (a CPU worker's memory budget is its share)
    rope_scaling: str | None = None  # the job's context extension (models/rope.py)
    tokens_ahead: int = 0  # new tokens the run may ask of this worker: warm() compiles what they pay for


def engine_config(d: dict):
    """EngineConfig from its JSON form in the manifest (lists back to tuples; keys it no longer has are ignored). A
    width or self-draft tree above today's limits (a job made before them) is brought within them: speed, not tokens."""
    from specrun.decoding.config import MAX_TREE_NODES, MAX_TRIE_BUDGET, tree_nodes
    from specrun.decoding.engine import EngineConfig

    known = {f.name for f in dataclasses.fields(EngineConfig)}
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known}
    if isinstance(fields.get("trie_budget"), int):
        fields["trie_budget"] = min(fields["trie_budget"], MAX_TRIE_BUDGET)
    tree = fields.get("tree")
    if isinstance(tree, tuple) and all(isinstance(k, int) for k in tree) and tree_nodes(tree) > MAX_TREE_NODES:
        fields.pop("tree")
    return EngineConfig(**fields)


class GenerationWorker:
    """GenerationWorker(spec, slot) loads at once; with load=False (the pool) construction is instant, so that the
    driver can tell "placed" (ping answers) from "model loaded" (load returns) and give each its own deadline."""

    def __init__(self, spec: WorkerSpec, slot: int, load: bool = True):
        self.spec, self.slot = spec, slot
        self.root = job_path(spec.job_dir)  # a local path or an object-store URI (storage/fs.py)
        self.records = Records(self.root)
        self.stop = threading.Event()
        self.lm = self.engine = self.hot_source = None
        self.batch = None  # BatchLoop when it runs more than one sequence at once
        self.concurrency = 1  # sequences at once, resolved by load()
        self.last_snapshot = float("-inf")
        self.compute = ComputeThread()  # every torch call of this worker runs there
        if load:
            self.load()

    def _check_job_dir(self) -> None:
        if self.spec.job_created_at is None:
            return
        try:
            created = read_json(self.root / "job.json").get("created_at")
        except (OSError, ValueError) as e:
            created = f"unreadable ({type(e).__name__})"
        if created != self.spec.job_created_at:
            raise ValueError(f"the worker on host {socket.gethostname()} does not see the driver's job directory "
                             f"{self.root} (job.json there: created_at {created!r}, the driver's: "
                             f"{self.spec.job_created_at!r}); put the job on storage every node mounts at that path")

    def _warm_start(self) -> str | None:
        import torch

        if self.engine.recycling is None:
            return None
        for i, d in enumerate((self.root, *map(job_path, self.spec.hot_start))):
            arrays = load_matrix(d / "state", self.spec.fingerprint, self.slot if i == 0 else None)
            if arrays is not None:
                try:
                    self.engine.recycling.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()})
                    return str(d)
                except ValueError:
                    continue
        return None

    # -- remote methods -------------------------------------------------------------------------------------------
    def ping(self) -> dict:
        """Answers as soon as the actor is placed and its process is up (load may still be running)."""
        return {"pid": os.getpid(), "host": socket.gethostname(), "slot": self.slot}

    def load(self) -> dict:
        """Load the model and build the engine (once); returns info()."""
        return self.compute.run(self._load)

    def _load(self) -> dict:
        if self.engine is None:
            import torch

            from specrun.actors.memory import concurrency_for, engine_for
            from specrun.decoding.forward.decoder import FusedDecoder
            from specrun.models.loader import load_model

            self._check_job_dir()
            spec = self.spec
            if spec.threads > 0 and spec.device == "cpu":
                torch.set_num_threads(spec.threads)
            lm = load_model(spec.model, dtype=spec.dtype, device=spec.device, trust_remote_code=spec.trust_remote_code,
                            rope_scaling=spec.rope_scaling)
            if lm.fingerprint != spec.fingerprint:
                raise ValueError(f"model at {spec.model!r} has fingerprint {lm.fingerprint}, the job was made with "
                                 f"{spec.fingerprint}: the model files changed")
            self.lm = lm
            FusedDecoder.of(lm.model)  # fused and prepacked weights first: the KV budget measures memory after them
            spec_engine = engine_config(spec.engine)
            self.concurrency = concurrency_for(lm, spec_engine, spec.concurrency, spec.kv_need, spec.device,
                                               spec.workers, spec.auto_concurrency)
            self.engine = engine_for(lm, spec_engine, self.concurrency, spec.kv_need, spec.page_size)
            if self.concurrency > 1:
                self.batch = BatchLoop(self.engine, self.compute)
            self.hot_source = self._warm_start()
        return self.info()

    def info(self) -> dict:
        """What the driver shows of a loaded worker; `compiles`: warm() would compile (minutes), not load, what
        `builds` names."""
        e = self.engine
        builds = e.would_build(self.spec.tokens_ahead) if e is not None else []
        return {"pid": os.getpid(), "host": socket.gethostname(), "slot": self.slot, "hot_start": self.hot_source,
                "concurrency": self.concurrency, "compiles": bool(builds), "builds": builds,
                "compile_failed": e.draft_compile_error if e is not None else None,
                "layers_failed": e.compiles.layers_error if e is not None else None}

    def warm(self) -> dict:
        """Compile (or load) what the run's tokens pay for before its first prompt (the 4-bit draft's graph: on a
        first run on a machine a minute or more, which mid-run would stall every sequence); returns info()."""
        return self.compute.run(self._warm)

    def _warm(self) -> dict:
        self._load()
        self.engine.expect(self.spec.tokens_ahead)
        return self.info()

    def save_state(self) -> None:
        """Write the recycling matrix snapshot now (OSError when that fails); the driver calls it at the end."""
        self.compute.run(self._save_state)

    def _save_state(self) -> None:
        rec = self.engine.recycling if self.engine is not None else None
        if rec is not None:
            save_matrix(self.root / "state", self.slot, {k: v.numpy() for k, v in rec.state_dict().items()},
                        self.spec.fingerprint)
        self.last_snapshot = time.monotonic()

    def request_stop(self) -> None:
        """Checkpoint and return at the next step (called from another thread while generate runs)."""
        self.stop.set()

    def generate(self, task: dict) -> dict:
        """task: id, input_ids, params (SamplingParams fields), resume_from -> result dict (see driver); "warnings"
        lists the best-effort writes that failed (and were retried) on the way."""
        from specrun.decoding.verify.params import SamplingParams
        from specrun.models.loader import output_text

        self.load()
        params = SamplingParams(**task["params"])
        resume = list(task["resume_from"])
        ckpt = Checkpointer(self, task["id"], len(resume), params.max_tokens)
        if self.batch is None:
            ckpt.stats = lambda: self.engine.stats
            result = self.compute.run(self.engine.generate, list(task["input_ids"]), params, resume_from=resume,
                                      on_step=ckpt)
        else:  # one of up to `concurrency` sequences of the worker's batch (this call runs in its own actor thread)
            ckpt.stats = lambda: self.batch.stats_of(task["id"])
            result, stats = self.batch.generate(task["id"], list(task["input_ids"]), params, resume, ckpt)
            ckpt.stats = lambda: stats
        if result.finish_reason == "stopped":
            ckpt.flush(result.token_ids)
            ckpt.best_effort("live status", self.records.clear_live, task["id"])
            return {"id": task["id"], "stopped": True, "n_tokens": len(result.token_ids),
                    "checkpointed": ckpt.start, "warnings": ckpt.report(), "disk_full": ckpt.disk_full}
        ckpt.finish(result.token_ids)
        ckpt.snapshot()
        return {"id": task["id"], "stopped": False, "token_ids": result.token_ids,
                "finish_reason": result.finish_reason, "stats": result.stats,
                "text": output_text(self.lm.tokenizer, result.token_ids, result.finish_reason, params),
                "resumed_tokens": len(resume),
                "warnings": ckpt.report()}
