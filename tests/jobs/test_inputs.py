"""prompts.jsonl validation: every bad line reported with its number and reason, nothing written; accepted formats."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specrun.cli import main
from specrun.decoding.sampling import SamplingParams
from specrun.jobs.inputs import InputError, derive_seed, read_prompts
from specrun.jobs.modelinfo import model_info


@pytest.fixture(scope="module")
def info(tiny_models):
    return model_info(tiny_models["llama_mha"])


def _write(tmp_path, lines, name="prompts.jsonl"):
    p = tmp_path / name
    p.write_bytes(b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines))
    return p


def _read(info, path, **base):
    return read_prompts(path, info.tokenizer, info.max_context, info.vocab_size, SamplingParams(**base))


BAD_LINES = [
    ('{"prompt": "a", ', "bad JSON"),
    ('["a"]', "expected a JSON object"),
    ('{"prompt": 5}', "prompt must be a string"),
    ('{"prompt": ""}', "prompt is empty"),
    ('{"prompt": "a", "messages": []}', "exactly one of"),
    ('{"id": 1.5, "prompt": "a"}', "id 1.5"),
    ('{"id": "", "prompt": "a"}', "id ''"),
    ('{"prompt": "a", "max_tokens": "9"}', "max_tokens='9' must be an integer"),
    ('{"prompt": "a", "temperature": -1}', "temperature=-1"),
    ('{"prompt": "a", "max_token": 3}', "unknown field 'max_token'"),
    ('{"input_ids": [1, 99999]}', "input_ids holds 99999"),
    ('{"input_ids": []}', "non-empty list"),
    ('{"messages": [{"role": "user"}]}', "messages[0]"),
    ('{"prompt": "a", "max_tokens": 5000}', "exceeds the model context of 4096"),
    ('{"body": {"prompt": "a"}}', "custom_id"),
    ('{"custom_id": "c", "url": "/v1/embeddings", "body": {"input": "a"}}', "not supported"),
]


@pytest.mark.parametrize("line,reason", BAD_LINES)
def test_each_bad_line_is_reported_with_its_number(info, tmp_path, line, reason):
    path = _write(tmp_path, ['{"prompt": "fine"}', line])
    with pytest.raises(InputError) as e:
        _read(info, path)
    assert e.value.total == 1
    assert e.value.problems[0].startswith("line 2: ") and reason in e.value.problems[0], e.value.problems


def test_non_utf8_and_duplicates_and_all_lines_reported(info, tmp_path):
    path = _write(tmp_path, ['{"id": "x", "prompt": "a"}', b'{"prompt": "\xff\xfe"}', "", '{"id": "x", "prompt": "b"}',
                             '{"prompt": "c"}', '{"id": 5, "prompt": "d"}'])
    with pytest.raises(InputError) as e:
        _read(info, path)
    msg = str(e.value)
    assert "line 2: not valid UTF-8" in msg
    assert "line 4: duplicate id 'x' (first used on line 1)" in msg
    assert "line 6: duplicate id '5' (first used on line 5)" in msg  # the default id is the line number
    assert e.value.total == 3


def test_report_is_capped(info, tmp_path):
    path = _write(tmp_path, ["nope"] * 30)
    with pytest.raises(InputError) as e:
        read_prompts(path, info.tokenizer, info.max_context, info.vocab_size, SamplingParams(), max_reported=5)
    assert len(e.value.problems) == 5 and e.value.total == 30 and "and 25 more" in str(e.value)


def test_empty_file_is_an_error(info, tmp_path):
    with pytest.raises(InputError, match="no prompts"):
        _read(info, _write(tmp_path, ["", "  "]))


def test_accepted_formats_and_overrides(info, tmp_path):
    tok = info.tokenizer
    path = _write(tmp_path, [
        '{"prompt": "hello", "max_tokens": 7, "temperature": 0.5, "seed": 3}',
        '{"id": "m", "messages": [{"role": "user", "content": "hi"}]}',
        '{"id": 9, "input_ids": [1, 2, 3]}',
        json.dumps({"custom_id": "oa-chat", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "repetition_penalty": 1.1}}),
        json.dumps({"custom_id": "oa-cmpl", "url": "/v1/completions", "body": {"prompt": "hey", "top_p": 0.9}}),
    ])
    recs = {r.id: r for r in _read(info, path, max_tokens=20, seed=11)}
    assert list(recs) == ["1", "m", "9", "oa-chat", "oa-cmpl"]
    r1 = recs["1"]
    assert r1.input_ids == tuple(tok.encode("hello", add_special_tokens=True))
    assert (r1.params.max_tokens, r1.params.temperature, r1.params.seed) == (7, 0.5, 3)
    assert recs["m"].text == tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                     add_generation_prompt=True)
    assert recs["m"].params.seed == derive_seed(11, "m") and recs["m"].params.max_tokens == 20
    assert recs["9"].input_ids == (1, 2, 3) and recs["9"].text is None
    assert recs["oa-chat"].params.penalty == 1.1 and recs["oa-chat"].params.max_tokens == 4
    assert recs["oa-cmpl"].params.top_p == 0.9 and recs["oa-cmpl"].text == "hey"


def test_derived_seeds_differ_per_id_and_are_stable():
    assert derive_seed(0, "a") == derive_seed(0, "a") != derive_seed(0, "b")
    assert derive_seed(0, "a") != derive_seed(1, "a")
    assert 0 <= derive_seed(5, "x") < 2**63


def test_cli_submit_with_bad_input_exits_nonzero_and_writes_nothing(tiny_models, tmp_path):
    path = _write(tmp_path, ['{"prompt": "ok"}', '{"prompt": ""}', "{oops", '{"prompt": "x", "max_tokens": 99999}'])
    job = tmp_path / "job"
    r = CliRunner().invoke(main, ["submit", str(path), "--max-tokens", "8", "--model", tiny_models["llama_mha"],
                                  "--job-dir", str(job)])
    assert r.exit_code != 0
    for n in (2, 3, 4):
        assert f"line {n}:" in r.output
    assert not job.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


def test_cli_submit_bad_flag_value_is_named(tiny_models, tmp_path):
    path = _write(tmp_path, ['{"prompt": "ok"}'])
    r = CliRunner().invoke(main, ["submit", str(path), "--max-tokens", "8", "--top-p", "2",
                                  "--model", tiny_models["llama_mha"], "--job-dir", str(tmp_path / "j")])
    assert r.exit_code != 0 and "top_p=2" in r.output and not (tmp_path / "j").exists()
