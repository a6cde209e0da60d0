"""`specrun export --format openai`: an OpenAI batch input file round-trips (each custom_id once, chat lines as
chat.completion, completion lines as text_completion, texts and token counts as the job's rows, finish_reason mapped);
a plain prompts file exports with custom_id = the prompt id and the kind its line's field implies."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from specrun.cli import main
from specrun.decoding.engine import EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs.export import export
from specrun.jobs.modelinfo import model_info
from specrun.jobs.submit import JobSettings, prepare_job
from specrun.storage.records import output_row

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


def _line(cid: str, url: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"model": "anything", **body}}) + "\n"


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_mha"]


def test_an_openai_batch_file_round_trips(tmp_path, model, local_ray):
    vocab = model_info(model).vocab_size
    batch = tmp_path / "batch.jsonl"
    batch.write_text(_line("req-chat", CHAT, messages=[{"role": "user", "content": "Hi there"}], max_tokens=9)
                     + _line("req-text", TEXT, prompt="abc abc abc")
                     + _line("req-ids", TEXT, prompt=[5, 6, 7], max_completion_tokens=5)
                     + _line("req-stop", TEXT, prompt="xyz", stop_token_ids=list(range(vocab))))  # stops at once
    job = tmp_path / "job"
    r = CliRunner().invoke(main, ["submit", str(batch), "--model", model, "--max-tokens", "12", "--ignore-eos",
                                  "--job-dir", str(job), "--actors", "1", "--quiet"])
    assert r.exit_code == 0, r.output
    for fmt, out in (("openai", "o.jsonl"), ("parquet", "o.parquet")):
        r = CliRunner().invoke(main, ["export", str(job), "--format", fmt, "-o", str(tmp_path / out)])
        assert r.exit_code == 0 and "wrote 4 row(s)" in r.output, r.output
    rows = {row["id"]: row for row in pq.read_table(tmp_path / "o.parquet").to_pylist()}
    lines = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["req-chat", "req-text", "req-ids", "req-stop"]  # each once, in order
    assert len({x["id"] for x in lines}) == 4 and len({x["response"]["body"]["id"] for x in lines}) == 4
    for x in lines:
        row, resp = rows[x["custom_id"]], x["response"]
        body, choice = resp["body"], resp["body"]["choices"][0]
        assert x["error"] is None and resp["status_code"] == 200 and resp["request_id"].startswith("req_")
        assert body["model"] == model and isinstance(body["created"], int) and choice["index"] == 0
        chat = x["custom_id"] == "req-chat"
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        assert body["id"].startswith("chatcmpl-" if chat else "cmpl-")
        text = choice["message"]["content"] if chat else choice["text"]
        assert text == row["text"] and (choice["message"]["role"] == "assistant" if chat else "message" not in choice)
        assert body["usage"] == {"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["n_tokens"],
                                 "total_tokens": row["prompt_tokens"] + row["n_tokens"]}
    got = {x["custom_id"]: (x["response"]["body"]["usage"]["completion_tokens"],
                            x["response"]["body"]["choices"][0]["finish_reason"]) for x in lines}
    assert got == {"req-chat": (9, "length"), "req-text": (12, "length"), "req-ids": (5, "length"),
                   "req-stop": (1, "stop")}
    assert rows["req-stop"]["finish_reason"] == "stop"
    assert lines == [json.loads(x) for x in _stdout_export(job).splitlines()]  # the same on every export


def _stdout_export(job) -> str:
    r = CliRunner().invoke(main, ["export", str(job), "--format", "openai"])
    assert r.exit_code == 0, r.output
    return r.stdout


def test_a_plain_prompts_file_exports_by_prompt_id_and_field(tmp_path, model):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "c", "messages": [{"role": "user", "content": "hey"}]}\n{"id": "t", "prompt": "one"}\n'
                 '{"id": 7, "input_ids": [5]}\n{"prompt": "not done"}\n')
    job, _ = prepare_job(p, tmp_path / "job", model_info(model), JobSettings(), SamplingParams(max_tokens=10),
                         EngineConfig())
    for pid, reason in (("c", "eos"), ("t", "stop"), ("7", "length")):
        job.records.write_output(output_row(pid, [7, 8, 9], f"text {pid}", reason, {}, prompt_tokens=4,
                                            resumed_tokens=0, attempts=1))
    assert export(job, "openai", str(tmp_path / "o.jsonl")) == (3, 1)
    lines = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [(x["custom_id"], x["response"]["body"]["object"], x["response"]["body"]["choices"][0]["finish_reason"])
            for x in lines] == [("c", "chat.completion", "stop"), ("t", "text_completion", "stop"),
                                ("7", "text_completion", "length")]
    assert lines[0]["response"]["body"]["choices"][0]["message"] == {"role": "assistant", "content": "text c"}
    assert lines[2]["response"]["body"]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
