"""What a report shows, read from the job directory without touching it: per prompt its state (jobs/status.py), its
timeline rows (storage/timeline.py) and Distinct-1..4 (of the output row, else of the checkpointed tokens).

Sums and position bins over rows are here too, so that the page, the PNGs and the tests agree on every number.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass

from specrun.jobs.jobdir import JobDir
from specrun.jobs.status import job_status
from specrun.storage.chunks import read_progress
from specrun.storage.records import distinct_n
from specrun.storage.timeline import read_timelines

TARGET = "target"  # tokens the verify forward chose itself (one per step), beside those a drafter proposed
POSITION_BINS = 40  # the job-wide curves: rows of every prompt pooled into at most this many bins of position


@dataclass
class PromptReport:
    id: str
    state: str  # jobs/status.py STATES
    tokens: int
    max_tokens: int
    finish_reason: str | None
    rows: list[dict]  # timeline rows by start offset
    distinct: list[float] | None  # Distinct-1..4; None before any token is checkpointed

    @property
    def resumes(self) -> list[int]:
        """Indexes of the rows that begin an attempt going on from an earlier one's tokens."""
        return [i for i in range(1, len(self.rows)) if self.rows[i]["attempt"] != self.rows[i - 1]["attempt"]]


@dataclass
class JobReport:
    job: str
    model: str
    made_at: float
    status: dict  # jobs/status.py job_status()["totals"]
    prompts: list[PromptReport]


def gather(job: JobDir) -> JobReport:
    st = job_status(job)
    ids = [r["id"] for r in st["prompts"]]
    cols = [f"distinct_{n}" for n in range(1, 5)]
    done = job.records.scan(ids, ["id", *cols]).rows
    prompts = []
    timelines = read_timelines(job.root, ids)  # own files of running prompts, merged ones of finished prompts
    for r in st["prompts"]:
        if r["id"] in done:
            distinct = [done[r["id"]][c] for c in cols]
        else:
            toks = read_progress(job.progress_dir(r["id"]), quarantine=False)
            distinct = [distinct_n(toks, n) for n in range(1, 5)] if toks else None
        prompts.append(PromptReport(r["id"], r["state"], r["tokens"], r["max_tokens"], r["finish_reason"],
                                    timelines.get(r["id"], []), distinct))
    return JobReport(st["job"], st["model"], time.time(), st["totals"], prompts)


def totals(rows: list[dict]) -> dict:
    """Sums over rows: tokens, steps, seconds, seconds per phase, tokens per source (drafters and TARGET), steps per
    width."""
    phase, sources, widths = Counter(), Counter(), Counter()
    tokens = steps = 0
    seconds = 0.0
    for r in rows:
        n = r["end"] - r["start"]
        tokens, steps, seconds = tokens + n, steps + r["steps"], seconds + r["seconds"]
        phase.update(r["phase_seconds"])
        sources.update(r["accepted_by_drafter"])
        sources[TARGET] += n - sum(r["accepted_by_drafter"].values())
        widths.update(r["width_steps"])
    return {"tokens": tokens, "steps": steps, "seconds": seconds, "phase": dict(phase), "sources": dict(sources),
            "widths": dict(widths)}


def rates(rows: list[dict]) -> dict:
    """Per row (x = generated position at its end): tok/s, accepted tokens per step, mean trie width chosen, ms of
    drafting per drafted node, the worker's resident memory (the last two None in rows written before them)."""
    return {"x": [r["end"] for r in rows],
            "tokens_per_s": [_ratio(r["end"] - r["start"], r["seconds"]) for r in rows],
            "accepted": [_ratio(r["end"] - r["start"], r["steps"]) for r in rows],
            "width": [_mean_width(r["width_steps"]) for r in rows],
            "draft_ms": [_ratio(1e3 * r["phase_seconds"].get("draft", 0.0), r["nodes"] - r["steps"])
                         if r.get("nodes") is not None else None for r in rows],
            "rss_mb": [r.get("rss_mb") for r in rows]}


def pooled_rates(prompts: list[PromptReport]) -> dict:
    """rates() of every prompt's rows pooled by generated position: the job-wide curves. Bins are at least a median
    row long (else neighbouring bins would hold different prompts' rows); a row goes to the bin of its midpoint, drawn
    at the mean end of the bin's rows."""
    rows = [r for p in prompts for r in p.rows]
    if not rows:
        return rates([])
    size = max(1, math.ceil(max(r["end"] for r in rows) / POSITION_BINS),
               statistics.median_low(r["end"] - r["start"] for r in rows))
    bins: dict[int, list[dict]] = {}
    for r in rows:
        bins.setdefault((r["start"] + r["end"]) // 2 // size, []).append(r)
    merged = []
    for b in sorted(bins):
        t = totals(bins[b])
        nodes = [r.get("nodes") for r in bins[b]]
        memory = [r["rss_mb"] for r in bins[b] if r.get("rss_mb") is not None]
        merged.append({"start": 0, "end": t["tokens"], "steps": t["steps"], "seconds": t["seconds"],
                       "width_steps": t["widths"], "phase_seconds": t["phase"],
                       "nodes": None if None in nodes else sum(nodes), "rss_mb": max(memory, default=None)})
    out = rates(merged)
    out["x"] = [statistics.fmean(r["end"] for r in bins[b]) for b in sorted(bins)]
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _mean_width(width_steps: dict) -> float | None:
    return _ratio(sum(w * n for w, n in width_steps.items()), sum(width_steps.values()))
