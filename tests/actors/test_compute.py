"""A worker runs all its torch work on one thread, whichever of Ray's actor threads calls it (actors/compute.py):
a second thread starting OpenMP work gets a second pool of helpers, and with more helpers than CPUs they sleep."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from specrun.actors.compute import ComputeThread
from specrun.actors.worker import GenerationWorker, WorkerSpec
from specrun.decoding.drafters.recycling import RecyclingMatrix
from specrun.decoding.engine import Engine
from specrun.decoding.forward.runner import DecoderRunner
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs.modelinfo import model_info
from specrun.models import loader

PARAMS = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_mha"]


def _in_threads(*calls) -> tuple[list, set[int]]:
    """Each call in a thread of its own, one after another; every thread lives until the last call is done, so none
    reuses another's ident. -> results, the threads' idents"""
    done, out, threads = threading.Event(), [], []
    for fn in calls:
        ready = threading.Event()

        def body(fn=fn, ready=ready):
            try:
                out.append(fn())
            except BaseException as e:  # noqa: BLE001 - raised below, in the test's thread
                out.append(e)
            ready.set()
            done.wait()
        threads.append(threading.Thread(target=body))
        threads[-1].start()
        ready.wait()
    done.set()
    for t in threads:
        t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out, {t.ident for t in threads}


def _task(key: str) -> dict:
    return {"id": key, "input_ids": [1, 2, 3], "params": dataclasses.asdict(PARAMS), "resume_from": []}


@pytest.fixture(scope="module")
def expected(model):
    return Engine(loader.load_model(model)).generate([1, 2, 3], PARAMS).token_ids


@pytest.fixture
def torch_threads(monkeypatch):
    """The threads that loaded a model, ran a decoder forward or read the recycling matrix."""
    seen: set[int] = set()

    def spy(owner, name):
        real = getattr(owner, name)

        def wrapped(*a, **kw):
            seen.add(threading.get_ident())
            return real(*a, **kw)
        monkeypatch.setattr(owner, name, wrapped)

    spy(loader, "load_model")
    spy(DecoderRunner, "logits")
    spy(RecyclingMatrix, "state_dict")
    return seen


@pytest.mark.parametrize("batched", [False, True])
def test_load_generate_and_snapshot_share_one_thread_whoever_calls(model, expected, tmp_path, torch_threads, batched):
    kw = {"concurrency": 2, "kv_need": 64, "page_size": 64} if batched else {}
    spec = WorkerSpec(job_dir=str(tmp_path), model=model, fingerprint=model_info(model).fingerprint, **kw)
    w = GenerationWorker(spec, slot=0, load=False)
    (_, first, _), callers = _in_threads(w.load, lambda: w.generate(_task("a")), w.save_state)
    second = w.generate(_task("b"))
    assert w.info()["concurrency"] == (2 if batched else 1)
    assert first["token_ids"] == second["token_ids"] == expected
    assert len(torch_threads) == 1 and not torch_threads & (callers | {threading.get_ident()})


def test_run_returns_raises_and_nests_on_the_compute_thread():
    c = ComputeThread()
    ident = c.run(threading.get_ident)
    assert ident != threading.get_ident() and _in_threads(lambda: c.run(threading.get_ident))[0] == [ident]
    assert c.run(lambda: c.run(threading.get_ident)) == ident  # from the compute thread itself: at once, no deadlock
    with pytest.raises(ZeroDivisionError):
        c.run(lambda: 1 / 0)
    assert c.submit(threading.get_ident).result() == ident


def test_ray_data_actor_loads_and_generates_on_one_thread(model, expected, torch_threads):
    """Ray Data builds a map_batches class in the actor's thread and calls it from a thread of its own."""
    import pyarrow as pa

    from specrun.jobs.parquet_in import Columns
    from specrun.ray_data import _Generate

    (gen,), built_by = _in_threads(lambda: _Generate(model, "auto", "cpu", None, PARAMS, Columns()))
    (table,), called_by = _in_threads(lambda: gen(pa.table({"input_ids": [[1, 2, 3]]})))
    assert table.column("generated_token_ids").to_pylist() == [expected]
    assert len(torch_threads) == 1 and not torch_threads & (built_by | called_by | {threading.get_ident()})
