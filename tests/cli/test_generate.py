"""`specrun generate` through click's CliRunner: JSON output equals the engine, flags validated, demo notice."""

import json

import pytest
from click.testing import CliRunner

from specrun.cli import main
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.models.loader import load_model


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("draft, attention", [("none", "sdpa"), ("ngram", "sdpa"), ("ngram,recycling", "split")])
def test_json_output_equals_engine(tiny_models, draft, attention):
    path = tiny_models["llama_gqa"]
    res = run("generate", "--model", path, "--prompt", "abcabcabc", "--max-tokens", "60", "--json", "--attention",
              attention, "--temperature", "0.8", "--min-p", "0.05", "--seed", "4", "--ignore-eos", "--draft", draft)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    lm = load_model(path)
    ids = lm.tokenizer.encode("abcabcabc")
    ref = Engine(lm, EngineConfig(drafters=())).generate(
        ids, SamplingParams(max_tokens=60, temperature=0.8, min_p=0.05, seed=4, ignore_eos=True)
    )
    assert out["token_ids"] == ref.token_ids
    assert out["finish_reason"] == "length"
    assert out["text"] == lm.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    assert {"steps", "mean_accepted", "phase_seconds", "tokens_by_drafter", "accepted_hist"} <= set(out["stats"])


def test_streams_text_and_summary_on_demo(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path))
    res = CliRunner().invoke(main, ["generate", "--prompt", "Once upon a time", "--max-tokens", "20"])
    assert res.exit_code == 0, res.output
    assert "RANDOM-WEIGHT" in res.stderr
    assert "tok/s" in res.stderr and "accepted/step" in res.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--top-p", "0"], "top_p"),
        (["--draft", "bogus"], "bogus"),
        (["--draft", "fused"], "fused"),  # needs --heads
        (["--attention", "flash"], "flash"),
        (["--temperature", "-1"], "temperature"),
        (["--model", "/no/such/model"], "/no/such/model"),
        (["--max-tokens", "0"], "max_tokens"),
    ],
)
def test_bad_flags_name_the_value(tiny_models, args, needle):
    base = ["generate", "--prompt", "x", "--model", tiny_models["llama_mha"]]
    res = CliRunner().invoke(main, base + args)
    assert res.exit_code != 0
    assert needle in res.output


def test_prompt_and_prompt_file_are_exclusive(tmp_path, tiny_models):
    f = tmp_path / "p.txt"
    f.write_text("hello")
    res = CliRunner().invoke(main, ["generate", "--model", tiny_models["llama_mha"], "--prompt", "x", "--prompt-file", str(f)])
    assert res.exit_code != 0 and "exactly one" in res.output
    res = CliRunner().invoke(main, ["generate", "--model", tiny_models["llama_mha"], "--prompt-file", str(f),
                                    "--max-tokens", "5", "--json"])
    assert res.exit_code == 0 and len(json.loads(res.stdout)["token_ids"]) <= 5


def test_chat_flag_uses_the_chat_template(tiny_models):
    path = tiny_models["llama_gqa"]
    res = run("generate", "--model", path, "--chat", "--prompt", "hi", "--max-tokens", "8", "--json", "--draft", "none")
    assert res.exit_code == 0, res.output
    lm = load_model(path)
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                            add_generation_prompt=True)
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    ref = Engine(lm, EngineConfig(drafters=())).generate(ids, SamplingParams(max_tokens=8))
    assert json.loads(res.stdout)["token_ids"] == ref.token_ids
    res = run("generate", "--model", path, "--chat", "--prompt", "", "--max-tokens", "8")  # as without --chat
    assert res.exit_code == 1 and "prompt is empty" in res.output, res.output
