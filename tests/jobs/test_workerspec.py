"""What the driver tells its workers: the tokens a worker's compile decisions at load are made for."""

from __future__ import annotations

from types import SimpleNamespace

from specrun.jobs.workerspec import tokens_ahead


def _prompt(pid: str, max_tokens: int):
    return SimpleNamespace(id=pid, params=SimpleNamespace(max_tokens=max_tokens))


def test_a_workers_tokens_ahead_are_its_share_of_what_is_left_and_at_least_the_longest_prompt():
    prompts = [_prompt("a", 8000), _prompt("b", 100), _prompt("c", 1024)]
    saved = {"a": 0, "b": 100, "c": 1000}.get  # b is finished but for its row, c resumes 24 tokens short of its end
    assert tokens_ahead(prompts, saved, 2) == 8000  # the worker that runs a asks that much, whatever the split
    assert tokens_ahead(prompts, lambda p: {"a": 7990}.get(p, 0), 1) == 10 + 100 + 1024
    assert tokens_ahead([_prompt(str(i), 1024) for i in range(4)], lambda p: 1000, 1) == 96  # resumed: what is left
    assert tokens_ahead([_prompt(str(i), 1024) for i in range(8)], lambda p: 0, 2) == 4096
    assert tokens_ahead([], lambda p: 0, 3) == 0


def test_the_driver_counts_each_prompts_checkpointed_tokens(tmp_path, tiny_models):
    """What the driver's tokens_ahead subtracts (Records.checkpointed, which status shows too): a prompt's checkpointed
    tokens (its progress chunks' names), 0 without any."""
    import json

    from specrun.decoding.engine import EngineConfig
    from specrun.decoding.verify.params import SamplingParams
    from specrun.jobs.modelinfo import model_info
    from specrun.jobs.submit import JobSettings, prepare_job
    from specrun.storage.chunks import write_chunk

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": i}) + "\n" for i in ("a/1", "b")))
    job, _ = prepare_job(path, tmp_path / "job", model_info(tiny_models["llama_mha"]), JobSettings(),
                         SamplingParams(max_tokens=100), EngineConfig())
    write_chunk(job.progress_dir("a/1"), 0, list(range(16)))
    write_chunk(job.progress_dir("a/1"), 16, list(range(24)))
    saved = job.records.checkpointed()
    assert (saved("a/1"), saved("b")) == (40, 0)
