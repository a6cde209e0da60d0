"""What every worker of a run is told (WorkerSpec): the job's model and settings for this attempt, and with
--concurrency N (or auto) how many sequences it runs at once and the KV each one reserves.
"""

from __future__ import annotations

from collections.abc import Iterable

from specrun.actors.memory import AUTO_MAX, kv_need, page_size_for
from specrun.actors.worker import WorkerSpec
from specrun.jobs.jobdir import JobDir, JobError


def worker_spec(job: JobDir, manifest: dict, settings: dict, prompts: Iterable, workers: int = 1,
                to_run: int | None = None) -> WorkerSpec:
    """settings: this attempt's (attempts.attempt_settings); prompts: the job's PromptInfos (for the longest need);
    workers: how many the run starts; to_run: prompts left to run (auto concurrency never seats more per worker)."""
    m, s, ck = manifest["model"], settings, settings["checkpoint"]
    prompts = list(prompts)
    return WorkerSpec(job_dir=job.location, model=s["model_path"],
                      fingerprint=m["fingerprint"], dtype=s["dtype"], device=s["device"],
                      trust_remote_code=m.get("trust_remote_code", False) is not False, engine=s["engine"],
                      checkpoint_every=ck["every"], checkpoint_seconds=ck["seconds"],
                      hot_start=tuple(s["hot_start"]), threads=1 if s["device"] == "cpu" else 0,
                      job_created_at=manifest.get("created_at"), rope_scaling=m.get("rope_scaling"),
                      **_batching(settings, prompts, workers, len(prompts) if to_run is None else to_run))


def _batching(settings: dict, prompts: list, workers: int, to_run: int) -> dict:
    """N sequences per worker, each with the KV of the job's longest (prompt + max_tokens) reserved. --concurrency N
    is checked against the worker's memory at load; auto is a cap the worker lowers to what its memory holds."""
    n, engine = settings.get("concurrency", 1), settings["engine"]
    auto = n == "auto"
    if auto:
        if engine.get("attention", "sdpa") != "sdpa":  # a backend of one sequence's cache: one sequence a worker
            return {}
        n = min(AUTO_MAX["cuda" if settings["device"].startswith("cuda") else "cpu"], -(-to_run // max(1, workers)))
    if n == 1:
        return {}
    if engine.get("attention", "sdpa") != "sdpa":
        raise JobError(f"--concurrency {n}: the {engine['attention']!r} attention backend runs one prompt at a time "
                       f"(batched workers attend with sdpa); use --concurrency 1")
    need = kv_need(max(p.n_input + p.params.max_tokens for p in prompts), engine["trie_budget"])
    page = page_size_for(settings["device"], need)
    return {"concurrency": n, "auto_concurrency": auto, "kv_need": need, "page_size": page, "workers": workers}


def tokens_ahead(prompts: Iterable, saved, workers: int) -> int:
    """New tokens a worker of the run may be asked for, which its compile decisions at load are made for: its share
    of what the prompts have left (max_tokens less saved(id), their checkpointed tokens), and at least the longest
    one's (the worker that runs it asks that much)."""
    left = [max(0, p.params.max_tokens - saved(p.id)) for p in prompts]
    return max(-(-sum(left) // max(1, workers)), max(left, default=0))
