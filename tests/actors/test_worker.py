"""GenerationWorker without Ray: checkpoint chunks, stop-and-flush, resume identical, hot start, model check."""

from __future__ import annotations

import dataclasses
import shutil
import threading

import pyarrow.parquet as pq
import pytest

from specrun.actors.worker import GenerationWorker, WorkerSpec
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs.modelinfo import model_info
from specrun.models.loader import load_model
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


def test_failed_checkpoint_status_and_matrix_writes_are_retried_not_fatal(model, reference, tmp_path, monkeypatch,
                                                                          caplog):
    """Each kind of worker write raises OSError once (a stale NFS handle for the chunk: a full disk refusing the tokens
    stops the generation instead, test_timeline; disk full for the others): the prompt still finishes with the same
    tokens, every token gets checkpointed at a later checkpoint, and the failures are reported."""
    import specrun.actors.worker as worker_mod
    from specrun.actors import checkpointer

    w = GenerationWorker(_spec(model, tmp_path, checkpoint_every=16), slot=0)
    failed = set()

    def once(name, real):
        def f(*a, **kw):
            if name not in failed:
                failed.add(name)
                if name == "chunk":
                    raise OSError(116, f"Stale file handle ({name})")
                raise OSError(28, f"No space left on device ({name})")
            return real(*a, **kw)
        return f

    monkeypatch.setattr(checkpointer, "write_chunk", once("chunk", checkpointer.write_chunk))
    monkeypatch.setattr(worker_mod, "save_matrix", once("matrix", worker_mod.save_matrix))
    monkeypatch.setattr(w.records, "write_live", once("live", w.records.write_live))
    with caplog.at_level("WARNING", logger="specrun.actors.checkpointer"):
        res = w.generate(_task())
    assert failed == {"chunk", "matrix", "live"}
    assert res["token_ids"] == reference
    saved = read_progress(tmp_path / "progress" / id_key("p/1"))
    assert len(saved) >= 120 - 16 and saved == reference[:len(saved)]  # the failed chunk's tokens came later
    assert (tmp_path / "state" / "recycling-000.safetensors").exists()
    assert w.records.read_live("p/1")["checkpointed"] >= 16
    assert len(res["warnings"]) == 3 and sum("No space left" in m for m in res["warnings"]) == 2
    assert sum("retrying at the next checkpoint" in r.getMessage() for r in caplog.records) == 3


def test_worker_refuses_a_job_directory_other_than_the_drivers(model, tmp_path):
    """A worker on another node that sees no (or another) job.json at the driver's path must not write there."""
    (tmp_path / "job.json").write_text('{"created_at": 1.5}')
    spec = dataclasses.replace(_spec(model, tmp_path), job_created_at=2.5)
    with pytest.raises(ValueError, match="does not see the driver's job directory"):
        GenerationWorker(spec, slot=0)
    GenerationWorker(dataclasses.replace(spec, job_created_at=1.5), slot=0)


def test_each_checkpoint_trims_the_heap(model, reference, tmp_path, monkeypatch):
    """The C heap's free pages go back to the OS at every checkpoint (actors/heap.py) and before the last timeline
    row (the tokens after the last chunk), so that every row's RSS is the memory in use; not at every step."""
    from specrun.actors import checkpointer

    trims = []
    monkeypatch.setattr(checkpointer, "trim_heap", lambda: trims.append(1))
    # plain AR, a token a step: a chunk every 16 tokens whatever the width tuner would choose on this host's clock
    spec = _spec(model, tmp_path, checkpoint_every=16, checkpoint_seconds=1000, engine={"drafters": []})
    assert GenerationWorker(spec, slot=0).generate(_task())["token_ids"] == reference
    chunks = list((tmp_path / "progress" / id_key("p/1")).iterdir())
    rows = sum(pq.read_table(f).num_rows for f in (tmp_path / "timeline").iterdir())
    last = max(int(c.name.split(".")[0].split("-")[-1]) for c in chunks)  # chunk-START-END.parquet
    assert last < len(reference), "the text must end past its last chunk, so that the last row has its own trim"
    assert len(trims) == rows == len(chunks) + 1 > 2


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor compiles C++: no compiler here")
@pytest.mark.parametrize("ahead", [99, 100])
def test_a_worker_compiles_its_draft_when_warmed_not_during_its_prompts(tmp_path, monkeypatch, ahead, build_once):
    """The 4-bit draft on torch's kernels, its graph not cached, compile_draft auto (its mark here 100 tokens): with
    the run's tokens for this worker (tokens_ahead) past the mark, info() says warm() will compile; warm() compiles
    it, once, and the prompt then drafts through it with no compile of its own; short of the mark warm() compiles
    nothing (the prompt's 120 tokens then pass the mark at its admission, as before). Output AR's either way."""
    from specrun.decoding import config as engine_config
    from specrun.decoding.drafters import quant_draft
    from specrun.decoding.drafters.quant_ring import RingForward
    from specrun.decoding.drafters.quant_torch import TorchForward
    from specrun.models.tiny import build_tiny_model

    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))  # nothing cached
    monkeypatch.setattr(engine_config, "COMPILE_DRAFT_TOKENS", 100)
    built, real = [], quant_draft.ring_forward
    monkeypatch.setattr(quant_draft, "ring_forward", lambda f, batched=False: built.append(batched) or real(f, batched))
    model = str(build_tiny_model(tmp_path / "llama", hidden=128, heads=4, kv_heads=2, layers=2, seed=5,
                                 initializer_range=0.3))  # products in groups of 32: the 4-bit draft takes it
    ar = Engine(load_model(model), EngineConfig(drafters=())).generate([1, 2, 3], PARAMS).token_ids
    spec = _spec(model, tmp_path / "job", engine={"drafters": ["quant"], "trie_budget": 4, "adaptive_budget": False},
                 tokens_ahead=ahead)
    w = GenerationWorker(spec, slot=0)
    assert isinstance(w.engine.quant, TorchForward) and w.info()["compiles"] is (ahead == 100) and built == []
    assert w.warm()["compiles"] is False and built == ([False] if ahead == 100 else [])
    if ahead == 100:
        ring = w.engine.quant
        assert isinstance(ring, RingForward) and ring.built == 1
    assert w.generate(_task())["token_ids"] == ar
    assert built == [False] and w.engine.quant.calls > 0
    if ahead == 100:
        assert w.engine.quant is ring
    again = GenerationWorker(dataclasses.replace(spec, job_dir=str(tmp_path / "job2")), slot=0)  # cached now
    assert again.info()["compiles"] is False and again.warm()["compile_failed"] is None


def test_a_worker_reports_a_draft_compile_that_failed(tmp_path, monkeypatch):
    """Where the draft's graph does not build (no C++ compiler, an inductor error), warm() says why (the driver warns:
    a worker's stderr does not reach the user), drafts with the eager draft, and does not try again."""
    from specrun.decoding import config as engine_config
    from specrun.decoding.drafters.quant_ring import RingForward
    from specrun.decoding.drafters.quant_torch import TorchForward
    from specrun.models.tiny import build_tiny_model

    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(engine_config, "COMPILE_DRAFT_TOKENS", 100)

    def fails(self, batched=False):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(RingForward, "warm", fails)
    model = str(build_tiny_model(tmp_path / "llama", hidden=128, heads=4, kv_heads=2, layers=2, seed=5,
                                 initializer_range=0.3))
    w = GenerationWorker(_spec(model, tmp_path / "job", engine={"drafters": ["quant"]}, tokens_ahead=100), slot=0)
    assert w.info()["compiles"] is True and w.info()["compile_failed"] is None
    info = w.warm()
    assert info["compile_failed"] == "RuntimeError: no compiler here" and info["compiles"] is False
    assert isinstance(w.engine.quant, TorchForward)
