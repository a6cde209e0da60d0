"""prompts.jsonl validation: every bad line reported with its number and reason, nothing written; accepted formats;
one streaming read that also hashes the input; hostile input (surrogates, deep nesting, huge numbers, NaN/Infinity,
unsupported OpenAI fields, a raising chat template, over-long lines) reported as bad lines, never a traceback."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
from click.testing import CliRunner

from specrun.cli import main
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs import inputs
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
    records, _sha = read_prompts(path, info.tokenizer, info.max_context, info.vocab_size, SamplingParams(**base))
    return records


def _oa(body: dict, url="/v1/completions", **line) -> str:
    return json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": body, **line})


CHAT = "/v1/chat/completions"


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
    ('{"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}}', "not supported"),
    # unencodable text: the tokenizer would raise a TypeError, parquet a UnicodeEncodeError
    (r'{"prompt": "\ud800"}', r"invalid unicode (lone surrogate '\ud800') in prompt"),
    (r'{"messages": [{"role": "user", "content": "a\udc00"}]}', r"surrogate '\udc00') in messages[0].content"),
    (r'{"id": "x\ud800", "prompt": "a"}', "lone surrogate '\\ud800') in id"),
    (r'{"prompt": "a", "\udbff": 1}', "lone surrogate '\\udbff') in a field name in the line"),
    (_oa({"messages": [{"role": "user", "content": "\ud800"}]}, CHAT), ") in body.messages[0].content"),
    # absurd nesting and numbers
    ("[" * 100000, "bad JSON: nested too deeply"),
    ('{"prompt": "a", "max_tokens": ' + "[" * 500 + "]" * 500 + "}", "max_tokens=[[[[[["),
    ('{"prompt": "a", "seed": ' + "7" * 5000 + "}", "bad JSON: Exceeds the limit (4300 digits) for integer string"),
    # an integer field's own bound (not int64's)
    ('{"prompt": "a", "top_k": 9223372036854775808}', "top_k=9223372036854775808 must be in [0, 2147483647]"),
    ('{"prompt": "a", "max_tokens": 99999999999999999999999}', "must be in [1, 2147483647]"),
    ('{"prompt": "a", "seed": 9223372036854775808}', "seed=9223372036854775808 must be in [0, 2**63)"),
    ('{"prompt": "a", "temperature": 1' + "0" * 400 + "}", "is out of range (at most 2**63 - 1)"),
    ('{"prompt": "a", "temperature": Infinity}', "temperature=inf must be a finite number"),
    ('{"prompt": "a", "top_p": NaN}', "top_p=nan must be a finite number"),
    ('{"prompt": "a", "penalty": 1e400}', "penalty=inf must be a finite number"),
    ('{"prompt": "a", "min_p": -Infinity}', "min_p=-inf must be a finite number"),
    ("null", "expected a JSON object, got NoneType"),
    ("\u00a0", "bad JSON"),  # not JSON whitespace: not a blank line
    # a field given twice: JSON keeps the last one, the line's author meant one of them
    ('{"prompt": "a", "max_tokens": 3, "max_tokens": 9}', "field 'max_tokens' is given twice in one object"),
    ('{"messages": [{"role": "user", "content": "a", "role": "system"}]}', "field 'role' is given twice"),
    # OpenAI batch lines: method + url required, every body field we do not implement refused by name
    (json.dumps({"custom_id": "c", "method": "POST", "body": {"prompt": "a"}}), "needs a 'url'"),
    (_oa({"prompt": "a"}, url=""), "needs a 'url'"),
    (_oa({"prompt": "a"}, url={"a": 1}), "url {'a': 1} is not supported"),
    (_oa({"prompt": "a"}, method="GET"), 'needs "method": "POST" (got \'GET\')'),
    (json.dumps({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "a"}}), 'needs "method": "POST"'),
    (_oa({"prompt": "a"}, priority=1), "unknown field 'priority' in an OpenAI batch line"),
    (_oa({"prompt": "a", "max_tokens": 3, "max_completion_tokens": 4}), "both 'max_tokens' and 'max_completion"),
    (_oa({"messages": [{"role": "user", "content": "x"}]}), "body field 'messages' is not supported by /v1/compl"),
    (_oa({"prompt": "a"}, CHAT), "body field 'prompt' is not supported by /v1/chat/completions"),
    (_oa({"model": "m"}, CHAT), "body needs 'messages' for /v1/chat/completions"),
    *[(_oa({"prompt": "a", field: value}), f"body field {field!r} is not supported")
      for field, value in [("logit_bias", {"5": 100}), ("top_logprobs", 2),
                           ("tools", []), ("tool_choice", "auto"), ("response_format", {"type": "json_object"}),
                           ("suffix", "x"), ("stream_options", {}), ("metadata", {}), ("min_tokens", 3)]],
    *[(_oa({"prompt": "a", field: value}), f"body field {field!r} is only supported as {neutral}")
      for field, value, neutral in [("n", 2, "1"), ("best_of", 3, "1"), ("stream", True, "false"),
                                    ("echo", True, "false"), ("logprobs", 1, "false"), ("frequency_penalty", 0.5, "0"),
                                    ("presence_penalty", -1, "0")]],
    # stop strings and stop token ids, on plain lines and in OpenAI bodies
    ('{"prompt": "a", "stop": ""}', "stop is empty: a stop string needs at least one character"),
    ('{"prompt": "a", "stop": ["x", ""]}', "stop[1] is empty"),
    ('{"prompt": "a", "stop": ["1", "2", "3", "4", "5"]}', "stop has 5 strings: at most 4"),
    ('{"prompt": "a", "stop": ["x", 3]}', "stop[1] must be a string, got int"),
    ('{"prompt": "a", "stop": {"x": 1}}', "stop must be a string or a list of strings, got dict"),
    ('{"prompt": "a", "stop": null}', "stop must be a string or a list of strings, got NoneType"),
    ('{"prompt": "a", "stop": "\ufffd"}', "stop holds U+FFFD"),
    ('{"prompt": "a", "stop_token_ids": [5, 9999]}', "stop_token_ids holds 9999: token ids must be integers in "
                                                     "[0, 259)"),
    ('{"prompt": "a", "stop_token_ids": [-1]}', "stop_token_ids holds -1: token ids are integers >= 0"),
    ('{"prompt": "a", "stop_token_ids": [1.0]}', "stop_token_ids holds 1.0"),
    ('{"prompt": "a", "stop_token_ids": 5}', "stop_token_ids must be a list of integers, got int"),
    (_oa({"prompt": "a", "stop": ""}), "stop is empty"),
    (_oa({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}), "stop has 5 strings: at most 4"),
    (_oa({"prompt": "a", "stop": 7}), "stop must be a string or a list of strings, got int"),
    (_oa({"prompt": "a", "stop_token_ids": [300]}), "stop_token_ids holds 300"),
]


@pytest.mark.parametrize("line,reason", BAD_LINES, ids=[f"{i}:{ln[:40]}" for i, (ln, _) in enumerate(BAD_LINES)])
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
    for lines in ([], ["", "  ", "\t\r"]):
        with pytest.raises(InputError, match="no prompts") as e:
            _read(info, _write(tmp_path, lines))
        assert e.value.problems == ["no prompts (the file is empty or has only blank lines)"]


def test_a_huge_integer_is_one_bad_line_among_the_others(info, tmp_path):
    path = _write(tmp_path, ['{"prompt": "ok"}', '{"prompt": ""}', '{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}",
                             '{"prompt": 3}'])
    with pytest.raises(InputError) as e:
        _read(info, path)
    assert e.value.total == 3
    assert [p.split(":")[0] for p in e.value.problems] == ["line 2", "line 3", "line 4"]
    assert "4300 digits" in e.value.problems[1]


def test_a_raising_chat_template_is_a_bad_line(info, tmp_path):
    tok = copy.deepcopy(info.tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
                         "{% endif %}{{ m['content'] }}{% endfor %}")
    path = _write(tmp_path, ['{"messages": [{"role": "user", "content": "a"}]}',
                             '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}'])
    with pytest.raises(InputError) as e:
        read_prompts(path, tok, info.max_context, info.vocab_size, SamplingParams())
    assert e.value.total == 1
    assert e.value.problems[0] == ("line 2: the chat template refused the messages: TemplateError: Conversation roles "
                                   "must alternate user/assistant/user/assistant")


def test_a_leading_bom_is_accepted_and_hashed(info, tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": "\\ud83d\\ude00"}\n')
    records, sha = read_prompts(path, info.tokenizer, info.max_context, info.vocab_size, SamplingParams())
    assert [(r.id, r.text) for r in records] == [("a", "hello"), ("b", "\U0001F600")]  # a surrogate pair is fine
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_over_long_line_is_reported_without_loading_it(info, tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "MAX_LINE_BYTES", 64)
    long_line = '{"prompt": "' + "x" * 200 + '"}'
    path = _write(tmp_path, ['{"prompt": "ok"}', long_line, '{"prompt": ""}', '{"prompt": "b"}'])
    with pytest.raises(InputError) as e:
        _read(info, path)
    assert e.value.problems[0].startswith("line 2: longer than 64 bytes")
    assert e.value.problems[1:] == ["line 3: prompt is empty"]


def test_unreadable_path_is_an_input_error(info, tmp_path):
    with pytest.raises(InputError, match="cannot read it: Is a directory"):
        _read(info, tmp_path)


def test_accepted_formats_and_overrides(info, tmp_path):
    tok = info.tokenizer
    path = _write(tmp_path, [
        '{"prompt": "hello", "max_tokens": 7, "temperature": 0.5, "seed": 3}',
        '{"id": "m", "messages": [{"role": "user", "content": "hi"}]}',
        '{"id": 9, "input_ids": [1, 2, 3]}',
        json.dumps({"custom_id": "oa-chat", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "repetition_penalty": 1.1}}),
        json.dumps({"custom_id": "oa-cmpl", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "hey", "top_p": 0.9}}),
    ])
    records, sha = read_prompts(path, tok, info.max_context, info.vocab_size, SamplingParams(max_tokens=20, seed=11))
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    recs = {r.id: r for r in records}
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


def test_openai_fields_at_their_neutral_value_or_null_are_accepted(info, tmp_path):
    body = {"model": "gpt-x", "user": "u", "prompt": [5, 6], "n": 1, "best_of": 1, "stream": False, "echo": False,
            "logprobs": False, "frequency_penalty": 0, "presence_penalty": 0.0, "stop": None, "logit_bias": None,
            "max_tokens": None, "seed": 4}
    recs = _read(info, _write(tmp_path, [_oa(body)]), max_tokens=9)
    assert [(r.id, r.input_ids, r.params.max_tokens, r.params.seed, r.overrides) for r in recs] == [
        ("c", (5, 6), 9, 4, {"seed": 4})]


def test_stop_and_stop_token_ids_on_lines_and_openai_bodies(info, tmp_path):
    path = _write(tmp_path, [
        '{"id": "plain", "prompt": "a", "stop": "\\n\\n"}',
        '{"id": "list", "prompt": "a", "stop": ["END", "###"], "stop_token_ids": [257, 10]}',
        '{"id": "none", "prompt": "a", "stop": []}',
        '{"id": "job", "prompt": "a"}',
        _oa({"prompt": "a", "stop": "\n"}, custom_id="oa-str"),
        _oa({"messages": [{"role": "user", "content": "hi"}], "stop": ["x", "yz"], "stop_token_ids": [3]}, CHAT,
            custom_id="oa-list"),
        _oa({"prompt": "a", "stop": None}, custom_id="oa-null"),
    ])
    recs = {r.id: r for r in _read(info, path, stop=["JOB"], stop_token_ids=[7])}
    got = {pid: (r.params.stop, r.params.stop_token_ids) for pid, r in recs.items()}
    assert got == {"plain": (("\n\n",), (7,)), "list": (("END", "###"), (257, 10)), "none": ((), (7,)),
                   "job": (("JOB",), (7,)), "oa-str": (("\n",), (7,)), "oa-list": (("x", "yz"), (3,)),
                   "oa-null": (("JOB",), (7,))}  # a line's own list replaces the job's (--stop, --stop-token-id)
    assert recs["plain"].overrides == {"stop": ["\n\n"]} and recs["job"].overrides == {}
    assert recs["oa-list"].overrides == {"stop": ["x", "yz"], "stop_token_ids": [3]}


def test_a_job_stop_token_id_outside_the_vocabulary_is_refused_once(info, tmp_path):
    path = _write(tmp_path, ['{"prompt": "a"}', '{"prompt": "b"}'])
    with pytest.raises(ValueError, match=r"^--stop-token-id holds 259: token ids must be integers in \[0, 259\)$"):
        _read(info, path, stop_token_ids=[259])


def test_derived_seeds_differ_per_id_and_are_stable():
    assert derive_seed(0, "a") == derive_seed(0, "a") != derive_seed(0, "b")
    assert derive_seed(0, "a") != derive_seed(1, "a")
    assert 0 <= derive_seed(5, "x") < 2**63


def test_cli_submit_with_bad_input_exits_nonzero_and_writes_nothing(tiny_models, tmp_path):
    path = _write(tmp_path, ['{"prompt": "ok"}', '{"prompt": ""}', "{oops", '{"prompt": "x", "max_tokens": 99999}'])
    job = tmp_path / "job"
    r = CliRunner().invoke(main, ["submit", str(path), "--max-tokens", "8", "--model", tiny_models["llama_mha"],
                                  "--job-dir", str(job)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)  # a click error, not a traceback
    for n in (2, 3, 4):
        assert f"line {n}:" in r.output
    assert not job.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


@pytest.mark.parametrize("flag,value,reason", [
    ("--top-p", "2", "top_p=2"),
    ("--temperature", "inf", "temperature=inf must be a finite number"),
    ("--penalty", "nan", "penalty=nan must be a finite number"),
    ("--checkpoint-seconds", "nan", "Invalid value for '--checkpoint-seconds': nan is not a finite number"),
    ("--checkpoint-seconds", "inf", "Invalid value for '--checkpoint-seconds': inf is not a finite number"),
    ("--gpus-per-actor", "inf", "Invalid value for '--gpus-per-actor': inf is not a finite number"),
    ("--stop", "", "stop is empty"),
    ("--stop-token-id", "-2", "stop_token_ids holds -2"),
])
def test_cli_submit_bad_flag_value_is_named(tiny_models, tmp_path, flag, value, reason):
    path = _write(tmp_path, ['{"prompt": "ok"}'])
    r = CliRunner().invoke(main, ["submit", str(path), "--max-tokens", "8", flag, value,
                                  "--model", tiny_models["llama_mha"], "--job-dir", str(tmp_path / "j")])
    assert r.exit_code == 2 and reason in r.output and not (tmp_path / "j").exists(), r.output


def test_cli_submit_stop_token_id_outside_the_vocabulary_is_named(tiny_models, tmp_path):
    path = _write(tmp_path, ['{"prompt": "ok"}'])
    r = CliRunner().invoke(main, ["submit", str(path), "--max-tokens", "8", "--stop-token-id", "9999",
                                  "--model", tiny_models["llama_mha"], "--job-dir", str(tmp_path / "j")])
    assert r.exit_code == 1 and "--stop-token-id holds 9999" in r.output and not (tmp_path / "j").exists(), r.output
