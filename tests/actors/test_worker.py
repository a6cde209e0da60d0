"""GenerationWorker without Ray: checkpoint chunks, stop-and-flush, resume identical, hot start, model check."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from specrun.actors.worker import GenerationWorker, WorkerSpec
from specrun.decoding.engine import Engine
from specrun.decoding.models import load_model
from specrun.decoding.sampling import SamplingParams
from specrun.jobs.modelinfo import model_info
from specrun.storage.chunks import read_progress
from specrun.storage.names import id_key

PARAMS = SamplingParams(max_tokens=120, temperature=1.0, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_mha"]


@pytest.fixture(scope="module")
def reference(model):
    return Engine(load_model(model)).generate([1, 2, 3], PARAMS).token_ids


def _spec(model, job_dir, **kw):
    return WorkerSpec(job_dir=str(job_dir), model=model, fingerprint=model_info(model).fingerprint, **kw)


def _task(resume=()):
    return {"id": "p/1", "input_ids": [1, 2, 3], "params": dataclasses.asdict(PARAMS), "resume_from": list(resume)}


def test_generate_checkpoints_and_matches_the_engine(model, reference, tmp_path):
    w = GenerationWorker(_spec(model, tmp_path, checkpoint_every=16), slot=0)
    res = w.generate(_task())
    assert res["token_ids"] == reference and not res["stopped"] and res["resumed_tokens"] == 0
    chunks = sorted((tmp_path / "progress" / id_key("p/1")).iterdir())
    assert len(chunks) >= 120 // 16 - 1
    assert read_progress(tmp_path / "progress" / id_key("p/1")) == reference[: len(read_progress(chunks[0].parent))]
    assert (tmp_path / "state" / "recycling-000.safetensors").exists()
    assert w.records.read_live("p/1")["max_tokens"] == 120


def test_stop_flushes_every_token_and_resume_continues_identically(model, reference, tmp_path):
    w = GenerationWorker(_spec(model, tmp_path, checkpoint_every=1000, checkpoint_seconds=1000), slot=0)
    calls = {"n": 0}
    inner = w.engine.generate

    def stop_after_some(*a, on_step, **kw):
        def step(tokens):
            calls["n"] += 1
            if calls["n"] == 5:
                threading.Thread(target=w.request_stop).start()
                threading.Event().wait(0.05)
            return on_step(tokens)
        return inner(*a, on_step=step, **kw)

    w.engine.generate = stop_after_some
    res = w.generate(_task())
    assert res["stopped"] and 0 < res["n_tokens"] < 120
    saved = read_progress(tmp_path / "progress" / id_key("p/1"))
    assert saved == reference[: res["n_tokens"]]  # everything generated before the stop is checkpointed

    w2 = GenerationWorker(_spec(model, tmp_path), slot=0)
    assert w2.hot_source == str(tmp_path)  # the matrix snapshot warmed the new worker
    res2 = w2.generate(_task(saved))
    assert res2["token_ids"] == reference
    assert res2["resumed_tokens"] == len(saved) and res2["stats"]["new_tokens"] == 120 - len(saved)


def test_hot_start_from_another_job(model, tmp_path):
    GenerationWorker(_spec(model, tmp_path / "old"), slot=0).generate(_task())
    w = GenerationWorker(_spec(model, tmp_path / "new", hot_start=(str(tmp_path / "old"),)), slot=1)
    assert w.hot_source == str(tmp_path / "old")


def test_worker_refuses_a_model_whose_files_changed(model, tmp_path):
    with pytest.raises(ValueError, match="fingerprint"):
        GenerationWorker(dataclasses.replace(_spec(model, tmp_path), fingerprint="0" * 16), slot=0)
