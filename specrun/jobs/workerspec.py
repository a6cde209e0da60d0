"""What every worker of a run is told (WorkerSpec): the job's model and settings for this attempt, and with
--concurrency N the batched engine's KV pool, sized so N of the job's longest prompts always fit.
"""

from __future__ import annotations

from collections.abc import Iterable

from specrun.actors.worker import WorkerSpec
from specrun.jobs.jobdir import JobDir, JobError

CUDA_PAGE_SIZE = 16  # KV page of the batched engine on GPUs (flashinfer's paged kernels)


def worker_spec(job: JobDir, manifest: dict, settings: dict, prompts: Iterable) -> WorkerSpec:
    """settings: this attempt's (attempts.attempt_settings); prompts: the job's PromptInfos (for the longest need)."""
    m, s, ck = manifest["model"], settings, settings["checkpoint"]
    return WorkerSpec(job_dir=job.location, model=s["model_path"],
                      fingerprint=m["fingerprint"], dtype=s["dtype"], device=s["device"],
                      trust_remote_code=m.get("trust_remote_code", False), engine=s["engine"],
                      checkpoint_every=ck["every"], checkpoint_seconds=ck["seconds"],
                      hot_start=tuple(s["hot_start"]), threads=1 if s["device"] == "cpu" else 0,
                      job_created_at=manifest.get("created_at"), **_batching(settings, prompts))


def _batching(settings: dict, prompts: Iterable) -> dict:
    """--concurrency N: N sequences per worker, in a KV pool that holds N of the job's longest (prompt + max_tokens)."""
    n = settings.get("concurrency", 1)
    if n == 1:
        return {}
    engine = settings["engine"]
    if engine.get("heads_path"):
        raise JobError(f"--concurrency {n}: drafting with heads does not run batched yet; use --concurrency 1")
    need = max(p.n_input + p.params.max_tokens for p in prompts) + engine["trie_budget"] + 1
    # CPU: one page per sequence, so attention reads its keys in place as a solo run does; CUDA: flashinfer's pages
    page = need if settings["device"] == "cpu" else CUDA_PAGE_SIZE
    return {"concurrency": n, "kv_tokens": n * need, "page_size": page}
