"""--concurrency auto: the KV memory budget (container limit honoured, split between CPU workers) over one
sequence's need; an explicit N that does not fit fails at load with both sizes; a worker resolves N when it loads."""

from __future__ import annotations

import dataclasses

import pytest

from specrun.actors.memory import (
    AUTO_MAX,
    CPU_SHARE,
    GiB,
    _meminfo_available,
    check_concurrency,
    fit_concurrency,
    kv_budget_bytes,
)
from specrun.actors.worker import GenerationWorker, WorkerSpec
from specrun.decoding.engine import Engine
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs.jobdir import JobError, PromptInfo
from specrun.jobs.modelinfo import model_info
from specrun.jobs.workerspec import _batching


def test_fit_concurrency_is_what_the_budget_holds_between_1_and_the_cap():
    assert fit_concurrency(8, need_tokens=1000, bytes_per_token=100, budget=350_000) == 3
    assert fit_concurrency(2, need_tokens=1000, bytes_per_token=100, budget=10**9) == 2
    assert fit_concurrency(8, need_tokens=1000, bytes_per_token=100, budget=10) == 1  # admission names the need


def test_each_sequences_draft_window_counts_against_the_budget():
    assert fit_concurrency(8, need_tokens=1000, bytes_per_token=100, budget=350_000, extra=75_000) == 2
    check_concurrency(2, 1000, 100, 350_000, extra=75_000)
    with pytest.raises(ValueError, match=r"--concurrency 3 needs .*window of the 4-bit draft"):
        check_concurrency(3, 1000, 100, 350_000, extra=75_000)


def test_an_explicit_concurrency_over_the_budget_names_both_sizes():
    check_concurrency(4, 1000, 100, 400_000)
    with pytest.raises(ValueError, match=r"--concurrency 5 needs 0\.00 GiB .*5 x 1000 tokens.*auto"):
        check_concurrency(5, 1000, 100, 400_000)


def test_cpu_budget_is_a_share_of_the_available_memory_and_honours_the_container_limit(tmp_path, monkeypatch):
    assert _meminfo_available() > 0  # the real reading parses
    # MemAvailable moves between two reads on a busy host: pin it so both sides see one value
    monkeypatch.setattr("specrun.actors.memory._meminfo_available", lambda: 10 * GiB)
    (tmp_path / "memory.max").write_text("max\n")
    assert kv_budget_bytes("cpu", 1, cgroup=tmp_path) == int(CPU_SHARE * 10 * GiB)
    assert kv_budget_bytes("cpu", 4, cgroup=tmp_path) == int(CPU_SHARE * 10 * GiB / 4)
    (tmp_path / "memory.max").write_text(str(3 * GiB))
    (tmp_path / "memory.current").write_text(str(1 * GiB))
    assert kv_budget_bytes("cpu", 2, cgroup=tmp_path) == int(CPU_SHARE * 2 * GiB / 2)  # the container's 2 GiB left
    monkeypatch.setattr("specrun.actors.memory._meminfo_available", lambda: 1 * GiB)
    assert kv_budget_bytes("cpu", 2, cgroup=tmp_path) == int(CPU_SHARE * 1 * GiB / 2)  # the host's 1 GiB is less


def _prompt(n_input, max_tokens):
    return PromptInfo(id="x", line=1, n_input=n_input, params=SamplingParams(max_tokens=max_tokens), row=0)


def _settings(concurrency, device="cpu", **engine):
    return {"concurrency": concurrency, "device": device, "engine": {"trie_budget": 64, **engine}}


def test_auto_seats_at_most_the_prompts_per_worker_and_the_device_cap():
    prompts = [_prompt(10, 100), _prompt(30, 200)]
    assert _batching(_settings("auto"), prompts, workers=2, to_run=5) == {
        "concurrency": 3, "auto_concurrency": True, "kv_need": 30 + 200 + 64 + 1, "page_size": 295, "workers": 2}
    assert _batching(_settings("auto"), prompts, workers=1, to_run=100)["concurrency"] == AUTO_MAX["cpu"]
    cuda = _batching(_settings("auto", device="cuda"), prompts, workers=1, to_run=100)
    assert cuda["concurrency"] == AUTO_MAX["cuda"] and cuda["page_size"] == 16
    # one prompt per worker: one sequence an engine
    assert _batching(_settings("auto"), prompts, workers=2, to_run=2) == {}
    assert _batching(_settings(3), prompts, workers=4, to_run=1)["concurrency"] == 3  # an explicit N is kept


def test_auto_keeps_the_solo_engine_for_a_solo_attention_backend_and_a_fixed_n_is_refused():
    prompts = [_prompt(10, 100)] * 8
    assert _batching(_settings("auto", heads_path="/h"), prompts, 1, 8)["concurrency"] == 8  # heads run batched
    assert _batching(_settings("auto", attention="split"), prompts, 1, 8) == {}
    assert _batching(_settings(1, attention="split"), prompts, 1, 8) == {}
    with pytest.raises(JobError, match="'split' attention backend runs one prompt at a time"):
        _batching(_settings(4, attention="split"), prompts, 1, 8)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_mha"]


def test_a_worker_resolves_auto_at_load_from_its_memory(model, tmp_path, monkeypatch):
    spec = WorkerSpec(job_dir=str(tmp_path), model=model, fingerprint=model_info(model).fingerprint,
                      concurrency=4, auto_concurrency=True, kv_need=300, page_size=300)
    w = GenerationWorker(spec, slot=0)
    assert w.info()["concurrency"] == 4 and isinstance(w.engine, Engine)
    assert w.engine.batch.kv_tokens == 4 * 300
    # a budget for two sequences: auto seats two, an explicit 4 refuses to load
    from specrun.decoding.forward.paged_runner import kv_bytes_per_token

    two = 2 * 300 * kv_bytes_per_token(w.lm.model.config, w.lm.dtype)
    monkeypatch.setattr("specrun.actors.memory.kv_budget_bytes", lambda device, workers: two + 1)
    assert GenerationWorker(spec, slot=0).info()["concurrency"] == 2
    with pytest.raises(ValueError, match="--concurrency 4 needs"):
        GenerationWorker(dataclasses.replace(spec, auto_concurrency=False), slot=0)
    monkeypatch.setattr("specrun.actors.memory.kv_budget_bytes", lambda device, workers: 1)
    solo = GenerationWorker(spec, slot=0)
    assert solo.info()["concurrency"] == 1 and isinstance(solo.engine, Engine)
