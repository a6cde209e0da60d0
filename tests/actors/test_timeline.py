"""The worker's timeline (storage/timeline.py) without Ray: a row per chunk and one for the tail, every token covered
once across a stop and a resume, the engine's counters split exactly between rows, rows of regenerated tokens dropped,
and the file outlives the progress chunks."""

from __future__ import annotations

import dataclasses

import pytest

from specrun.actors.worker import GenerationWorker, WorkerSpec
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.width.tuner import candidate_widths
from specrun.jobs.modelinfo import model_info
from specrun.storage.chunks import read_progress
from specrun.storage.names import id_key
from specrun.storage.records import Records
from specrun.storage.timeline import read_timeline, timeline_path

PARAMS = SamplingParams(max_tokens=150, temperature=1.0, seed=11, ignore_eos=True)
ENGINE = {"drafters": ["ngram", "recycling"], "trie_budget": 16}


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_mha"]


def _worker(model, job_dir, **kw) -> GenerationWorker:
    spec = WorkerSpec(job_dir=str(job_dir), model=model, fingerprint=model_info(model).fingerprint, engine=ENGINE,
                      checkpoint_seconds=1000, **kw)
    return GenerationWorker(spec, slot=0)


def _task(resume=()):
    return {"id": "p/1", "input_ids": [5, 6, 7], "params": dataclasses.asdict(PARAMS), "resume_from": list(resume)}


def _stop_after(w: GenerationWorker, steps: int) -> None:
    inner, calls = w.engine.generate, {"n": 0}

    def generate(*a, on_step, **kw):
        def step(tokens):
            calls["n"] += 1
            if calls["n"] == steps:
                w.request_stop()
            return on_step(tokens)
        return inner(*a, on_step=step, **kw)

    w.engine.generate = generate


def _covers(rows, n: int) -> None:
    assert [r["start"] for r in rows] == [0] + [r["end"] for r in rows[:-1]] and rows[-1]["end"] == n


def _sums(rows) -> dict:
    out = {"steps": 0, "nodes": 0, "by_drafter": {}}
    for r in rows:
        out["steps"] += r["steps"]
        out["nodes"] += r["nodes"]
        for k, v in r["accepted_by_drafter"].items():
            out["by_drafter"][k] = out["by_drafter"].get(k, 0) + v
    return out


def test_rows_cover_every_token_once_across_a_stop_and_a_resume(model, tmp_path):
    w = _worker(model, tmp_path, checkpoint_every=24)
    _stop_after(w, 12)
    first = w.generate(_task())
    assert first["stopped"]
    saved = read_progress(tmp_path / "progress" / id_key("p/1"))
    rows1 = read_timeline(timeline_path(tmp_path, "p/1"))
    _covers(rows1, len(saved))  # the stop's flush got its row too
    assert {r["attempt"] for r in rows1} == {1} and sum(r["steps"] for r in rows1) == 12

    res = _worker(model, tmp_path, checkpoint_every=24).generate(_task(saved))
    assert not res["stopped"] and len(res["token_ids"]) == 150
    Records(tmp_path).drop_progress("p/1")  # what the driver does once the output row is durable
    rows = read_timeline(timeline_path(tmp_path, "p/1"))
    _covers(rows, 150)
    assert rows[:len(rows1)] == rows1
    second = [r for r in rows if r["attempt"] == 2]
    assert second[0]["start"] == len(saved) and len(second) >= (150 - len(saved)) // 24
    stats, sums = res["stats"], _sums(second)
    # the attempt's rows split its engine counters exactly, the tail after the last chunk included
    assert sums["steps"] == stats["steps"]
    assert sums["nodes"] == round(stats["mean_trie_nodes"] * stats["steps"]) > sums["steps"]  # drafted nodes too
    assert all(r["rss_mb"] > 0 for r in rows)  # the worker's memory at each row
    assert sums["by_drafter"] == {k: v for k, v in stats["tokens_by_drafter"].items() if v}
    assert all(sum(r["width_steps"].values()) == r["steps"] for r in rows)
    assert {w for r in rows for w in r["width_steps"]} <= set(candidate_widths(16))
    for r in second:
        assert 0 < sum(r["phase_seconds"].values()) <= r["seconds"] and r["ended_at"] > 0
    assert "prefill" in second[0]["phase_seconds"] and "prefill" not in second[1]["phase_seconds"]


def test_rows_of_tokens_generated_again_are_dropped(model, tmp_path):
    w = _worker(model, tmp_path, checkpoint_every=5)
    _stop_after(w, 15)
    w.generate(_task())
    saved = read_progress(tmp_path / "progress" / id_key("p/1"))
    rows1 = read_timeline(timeline_path(tmp_path, "p/1"))
    assert len(rows1) >= 2
    keep = rows1[-2]["end"]  # as if the last chunk was lost: its tokens are generated again
    _worker(model, tmp_path, checkpoint_every=20).generate(_task(saved[:keep]))
    rows = read_timeline(timeline_path(tmp_path, "p/1"))
    _covers(rows, 150)
    assert [r["attempt"] for r in rows if r["start"] < keep] == [1] * (len(rows1) - 1)
    assert {r["attempt"] for r in rows if r["start"] >= keep} == {2}


def test_an_unreadable_timeline_is_started_again_and_never_fails_the_prompt(model, tmp_path):
    path = timeline_path(tmp_path, "p/1")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not parquet")
    res = _worker(model, tmp_path, checkpoint_every=50).generate(_task())
    rows = read_timeline(path)
    _covers(rows, 150)
    assert {r["attempt"] for r in rows} == {1} and not res["warnings"]
    assert sum(r["steps"] for r in rows) == res["stats"]["steps"]


def test_the_stats_count_the_width_chosen_for_every_step(model, tmp_path):
    w = _worker(model, tmp_path)
    stats = w.generate(_task())["stats"]
    assert sum(stats["widths"].values()) == stats["steps"] and len(stats["widths"]) > 1  # the tuner explored


def test_a_failed_timeline_write_is_retried_at_the_next_checkpoint(model, tmp_path, monkeypatch):
    import specrun.storage.timeline as timeline_mod

    real, failed = timeline_mod.atomic_write_table, []

    def once(*a, **kw):
        if not failed:
            failed.append(1)
            raise OSError(28, "No space left on device")
        return real(*a, **kw)

    monkeypatch.setattr(timeline_mod, "atomic_write_table", once)
    res = _worker(model, tmp_path, checkpoint_every=30).generate(_task())
    assert failed and len(res["warnings"]) == 1 and "timeline" in res["warnings"][0]
    _covers(read_timeline(timeline_path(tmp_path, "p/1")), 150)


def test_no_room_for_a_checkpoint_stops_the_generation_and_says_so(model, tmp_path, monkeypatch):
    """A full disk refusing the tokens themselves stops the generation at once (what follows could not be kept
    either); the driver sees disk_full and starts no more prompts. Other ENOSPC writes are retried (above)."""
    from specrun.actors import checkpointer

    def full(*a, **kw):
        raise OSError(28, "No space left on device", "progress/chunk")

    monkeypatch.setattr(checkpointer, "write_chunk", full)
    res = _worker(model, tmp_path, checkpoint_every=30).generate(_task())
    assert res["stopped"] and "No space left" in res["disk_full"]
    assert res["n_tokens"] < 60  # stopped at the first checkpoint, not generated to the end (150)
