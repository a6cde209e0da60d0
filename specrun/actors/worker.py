"""GenerationWorker: loads the model and builds the Engine once, then generates prompts one at a time with checkpoints.

Plain class (Ray wraps it in pool.py); writes progress chunks, matrix snapshots and live status to the shared job dir.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from specrun.storage.chunks import write_chunk
from specrun.storage.names import id_key
from specrun.storage.records import Records
from specrun.storage.state import load_matrix, save_matrix

LIVE_EVERY_S = 1.0


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


def engine_config(d: dict):
    """EngineConfig from its JSON form in the manifest (lists back to tuples; keys it no longer has are ignored)."""
    from specrun.decoding.engine import EngineConfig

    known = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known})


class GenerationWorker:
    def __init__(self, spec: WorkerSpec, slot: int):
        import torch

        from specrun.decoding.engine import Engine
        from specrun.decoding.models import load_model

        if spec.threads > 0 and spec.device == "cpu":
            torch.set_num_threads(spec.threads)
        self.spec, self.slot = spec, slot
        self.root = Path(spec.job_dir)
        self.records = Records(self.root)
        self.lm = load_model(spec.model, dtype=spec.dtype, device=spec.device, trust_remote_code=spec.trust_remote_code)
        if self.lm.fingerprint != spec.fingerprint:
            raise ValueError(f"model at {spec.model!r} has fingerprint {self.lm.fingerprint}, the job was made with "
                             f"{spec.fingerprint}: the model files changed")
        self.engine = Engine(self.lm, engine_config(spec.engine))
        self.hot_source = self._warm_start()
        self.stop = threading.Event()

    def _warm_start(self) -> str | None:
        import torch

        if self.engine.recycling is None:
            return None
        for i, d in enumerate((self.root, *map(Path, self.spec.hot_start))):
            arrays = load_matrix(d / "state", self.spec.fingerprint, self.slot if i == 0 else None)
            if arrays is not None:
                try:
                    self.engine.recycling.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()})
                    return str(d)
                except ValueError:
                    continue
        return None

    # -- remote methods -------------------------------------------------------------------------------------------
    def info(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "slot": self.slot, "hot_start": self.hot_source}

    def request_stop(self) -> None:
        """Checkpoint and return at the next step (called from another thread while generate runs)."""
        self.stop.set()

    def generate(self, task: dict) -> dict:
        """task: id, input_ids, params (SamplingParams fields), resume_from, attempt -> result dict (see driver)."""
        from specrun.decoding.models import decode_tokens
        from specrun.decoding.sampling import SamplingParams

        params = SamplingParams(**task["params"])
        resume = list(task["resume_from"])
        ckpt = _Checkpointer(self, task["id"], len(resume), params.max_tokens)
        result = self.engine.generate(list(task["input_ids"]), params, resume_from=resume, on_step=ckpt)
        if result.finish_reason == "stopped":
            ckpt.flush(result.token_ids)
            self.records.clear_live(task["id"])
            return {"id": task["id"], "stopped": True, "n_tokens": len(result.token_ids)}
        ckpt.snapshot()
        return {"id": task["id"], "stopped": False, "token_ids": result.token_ids,
                "finish_reason": result.finish_reason, "stats": result.stats, "text": decode_tokens(self.lm.tokenizer, result.token_ids),
                "resumed_tokens": len(resume)}


class _Checkpointer:
    """on_step callback: appends a chunk every checkpoint_every tokens or checkpoint_seconds; writes live status after
    each checkpoint and otherwise once per LIVE_EVERY_S."""

    def __init__(self, worker: GenerationWorker, prompt_id: str, resumed: int, max_tokens: int):
        self.w, self.id, self.max_tokens = worker, prompt_id, max_tokens
        self.progress = worker.root / "progress" / id_key(prompt_id)
        self.start = resumed  # first generated-token offset not yet in a chunk
        self.resumed = resumed
        self.buf: list[int] = []
        self.steps = 0
        self.t0 = self.last_ckpt = time.monotonic()
        self.last_live = 0.0
        self._live(time.monotonic(), force=True)

    def __call__(self, emitted: list[int]) -> bool:
        self.buf.extend(emitted)
        self.steps += 1
        now = time.monotonic()
        checkpoint = len(self.buf) >= self.w.spec.checkpoint_every or (
            bool(self.buf) and now - self.last_ckpt >= self.w.spec.checkpoint_seconds)
        if checkpoint:
            self._write(self.buf)
            self.snapshot()
            self.last_ckpt = now
        self._live(now, force=checkpoint)  # a checkpoint is news: status shows it at once
        return self.w.stop.is_set()

    def _write(self, tokens: list[int]) -> None:
        write_chunk(self.progress, self.start, tokens)
        self.start += len(tokens)
        self.buf = []

    def flush(self, all_tokens: list[int]) -> None:
        rest = all_tokens[self.start:]
        if rest:
            self._write(rest)
        self.snapshot()

    def snapshot(self) -> None:
        rec = self.w.engine.recycling
        if rec is not None:
            arrays = {k: v.numpy() for k, v in rec.state_dict().items()}
            save_matrix(self.w.root / "state", self.w.slot, arrays, self.w.spec.fingerprint)

    def _live(self, now: float, force: bool = False) -> None:
        if not force and now - self.last_live < LIVE_EVERY_S:
            return
        self.last_live = now
        new = self.start + len(self.buf) - self.resumed
        elapsed = now - self.t0
        self.w.records.write_live(self.id, {
            "tokens": self.start + len(self.buf), "checkpointed": self.start, "max_tokens": self.max_tokens,
            "tokens_per_s": new / elapsed if elapsed > 0 else 0.0,
            "mean_accepted": new / self.steps if self.steps else 0.0,
            "pid": os.getpid(), "host": socket.gethostname(), "slot": self.w.slot, "updated_at": time.time(),
        })
