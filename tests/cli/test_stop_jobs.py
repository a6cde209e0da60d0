"""Stop strings and stop token ids end to end: `specrun generate` (JSON and streamed text) and jobs (`submit`, then
`resume` from checkpoints taken before, inside and right after a stop string): the outputs end where AR does, with
finish_reason "stop" and the text cut before the stop, whatever the checkpoint boundaries."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from specrun.cli import main
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs.jobdir import JobDir
from specrun.jobs.modelinfo import model_info
from specrun.jobs.submit import JobSettings, prepare_job
from specrun.models.loader import decode_tokens, load_model, output_text
from specrun.storage.chunks import write_chunk
from tests.decoding.test_stops import _first_completion, _inside_steps, _texts

PROMPT = "abc abc abc abc abc"  # repetitive: drafts are accepted on the tiny model
N = 120
FLAGS = ["--max-tokens", str(N), "--ignore-eos", "--draft", "ngram,recycling", "--dtype", "float32"]


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["qwen2"]


@pytest.fixture(scope="module")
def reference(model):
    """AR tokens (float32, as the CLI runs the tiny model) and stops that first complete inside an accepted run of
    drafted tokens: (k, stop) with the stop completed by token k."""
    lm = load_model(model)
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    out = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    steps: list[list[int]] = []
    Engine(lm, EngineConfig(drafters=("ngram", "recycling"), adaptive_budget=False)).generate(
        prompt, params, on_step=lambda e: steps.append(list(e)) and False)
    texts = _texts(lm.tokenizer, out)
    stops = []
    for k in sorted(_inside_steps(steps)):
        s = texts[k + 1][-3:]
        if k >= 10 and len(s) == 3 and "\ufffd" not in s and _first_completion(texts, [s]) == k:
            stops.append((k, s))
    assert len(stops) >= 3, stops
    return lm, out, stops


def _check_row(lm, out, row, k, params):
    assert row["token_ids"] == out[: k + 1], row["id"]
    assert row["finish_reason"] == "stop"
    assert row["text"] == output_text(lm.tokenizer, out[: k + 1], "stop", params)


def test_generate_json_and_stream_cut_at_the_stop(model, reference):
    lm, out, stops = reference
    k, stop = stops[0]
    for args in (["--stop", stop], ["--stop", "never", "--stop", stop]):
        r = CliRunner().invoke(main, ["generate", "--model", model, "--prompt", PROMPT, "--json", *FLAGS, *args])
        assert r.exit_code == 0, r.output
        res = json.loads(r.stdout)
        assert res["token_ids"] == out[: k + 1] and res["finish_reason"] == "stop"
        assert res["text"] == decode_tokens(lm.tokenizer, out[: k + 1])[: -len(stop)]
        streamed = CliRunner().invoke(main, ["generate", "--model", model, "--prompt", PROMPT, *FLAGS, *args])
        assert streamed.exit_code == 0, streamed.output
        assert streamed.stdout == res["text"] + "\n"  # the stop string was never printed
        assert "finish: stop" in streamed.stderr
    # a stop token id: kept in token_ids, not in the text (streamed or not)
    j = next(j for j in range(10, N) if out[j] not in out[:j])
    args = ["--stop-token-id", str(out[j])]
    r = CliRunner().invoke(main, ["generate", "--model", model, "--prompt", PROMPT, "--json", *FLAGS, *args])
    res = json.loads(r.stdout)
    assert res["token_ids"] == out[: j + 1] and res["finish_reason"] == "stop"
    assert res["text"] == decode_tokens(lm.tokenizer, out[:j])
    streamed = CliRunner().invoke(main, ["generate", "--model", model, "--prompt", PROMPT, *FLAGS, *args])
    assert streamed.stdout == res["text"] + "\n"
    r = CliRunner().invoke(main, ["generate", "--model", model, "--prompt", "x", "--stop", ""])
    assert r.exit_code == 2 and "stop is empty" in r.output


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    from specrun.actors.pool import init_ray

    started = init_ray(None, num_cpus=max(2, os.cpu_count() or 1))
    yield
    if started:
        ray.shutdown()


def _lines(stops, out):
    j = next(j for j in range(10, N) if out[j] not in out[:j])
    lines = [{"id": f"s{i}", "prompt": PROMPT, "stop": [s, "never"] if i % 2 else s} for i, (_, s) in enumerate(stops)]
    lines.append({"custom_id": "openai", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": PROMPT, "stop": stops[0][1], "max_tokens": N}})
    lines.append({"id": "token", "prompt": PROMPT, "stop_token_ids": [out[j]], "stop": []})  # not the job's stop
    lines.append({"id": "job-stop", "prompt": PROMPT})  # the job's --stop
    expect = {f"s{i}": (k, (s,)) for i, (k, s) in enumerate(stops)}
    expect.update({"openai": (stops[0][0], (stops[0][1],)), "token": (j, ()), "job-stop": (stops[-1][0], ())})
    return lines, expect


def test_submit_ends_every_prompt_at_its_stop(model, reference, tmp_path, local_ray):
    lm, out, stops = reference
    stops = stops[:3]
    lines, expect = _lines(stops, out)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = CliRunner().invoke(main, ["submit", str(path), "--model", model, "--job-dir", str(tmp_path / "job"),
                                  "--checkpoint-every", "2", "--actors", "1", "-q", "--stop", stops[-1][1], *FLAGS])
    assert r.exit_code == 0, r.output
    job = JobDir(tmp_path / "job")
    rows = {row["id"]: row for row in job.records.read_outputs().to_pylist()}
    params = {p.id: p.params for p in job.prompts()}
    assert sorted(rows) == sorted(expect)
    for pid, (k, _) in expect.items():
        _check_row(lm, out, rows[pid], k, params[pid])
    assert rows["token"]["text"] == decode_tokens(lm.tokenizer, out[: expect["token"][0]])
    r = CliRunner().invoke(main, ["export", str(job.root)])
    exported = {json.loads(x)["id"]: json.loads(x)["text"] for x in r.stdout.splitlines()}
    assert exported == {pid: row["text"] for pid, row in rows.items()}
    # submitting the same again resumes (the stored stop lists equal the new ones): nothing to do
    r = CliRunner().invoke(main, ["submit", str(path), "--model", model, "--job-dir", str(job.root),
                                  "--checkpoint-every", "2", "--actors", "1", "-q", "--stop", stops[-1][1], *FLAGS])
    assert r.exit_code == 0, r.output


def test_resume_from_checkpoints_before_inside_and_after_the_stop(model, reference, tmp_path, local_ray):
    """As if the job had been killed after checkpointing `split` tokens: inside the stop string (its first tokens
    checkpointed, the rest not), right after its completing token (the output row was never written), or before."""
    lm, out, stops = reference
    k, stop = stops[1]
    n_stop_tokens = len(stop.encode())  # byte-level tokenizer: one token per byte
    splits = sorted({k - n_stop_tokens - 1, k - n_stop_tokens + 1, k - 1, k, k + 1})
    lines = [{"id": f"at{split}", "prompt": PROMPT, "stop": stop} for split in splits]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    params = SamplingParams(max_tokens=N, ignore_eos=True, stop=stop)
    job, _ = prepare_job(path, tmp_path / "job", model_info(model), JobSettings(checkpoint_every=2), params,
                         EngineConfig(drafters=("ngram", "recycling")))
    for split in splits:
        write_chunk(job.progress_dir(f"at{split}"), 0, out[:split])
    r = CliRunner().invoke(main, ["resume", str(job.root), "--actors", "1", "-q"])
    assert r.exit_code == 0, r.output
    rows = {row["id"]: row for row in job.records.read_outputs().to_pylist()}
    for split in splits:
        row = rows[f"at{split}"]
        _check_row(lm, out, row, k, params)
        assert row["resumed_tokens"] == split
