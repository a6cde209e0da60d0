"""The bench's optional llama.cpp row: run through a stand-in Llama (llama-cpp-python is not a test dependency), skipped
with a note naming why where the module or a GGUF file is missing."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

from click.testing import CliRunner

from specrun.bench.clock import LengthClock as _LengthClock
from specrun.bench.llama_cpp import find_gguf, run_llama_cpp
from specrun.cli import main
from specrun.decoding.verify.params import SamplingParams


class FakeLlama:
    """llama_cpp.Llama's surface the bench uses: generate() yields tokens for ever (EOS is the caller's business)."""

    made: list[dict] = []

    def __init__(self, **kw):
        self.kw = kw
        FakeLlama.made.append(kw)
        self.closed = False
        self.calls = []

    def generate(self, tokens, **kw):
        self.calls.append((list(tokens), kw))

        def gen():
            i = 0
            try:
                while True:
                    yield 7 + i % 3
                    i += 1
            finally:
                self.closed = True

        return gen()


def test_run_takes_n_tokens_times_each_length_and_passes_the_sampling():
    llama = FakeLlama()
    clock = _LengthClock((2, 5))
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, penalty=1.2)
    toks, seconds = run_llama_cpp(llama, [1, 2, 3], p, 5, clock)
    assert toks == [7, 8, 9, 7, 8] and seconds > 0
    assert sorted(clock.at) == [2, 5] and clock.at[2] <= clock.at[5] <= seconds
    assert llama.closed  # the generator is closed once n tokens came, not drained
    prompt, kw = llama.calls[0]
    assert prompt == [1, 2, 3]
    assert kw == dict(top_k=5, top_p=0.9, min_p=0.1, temp=0.7, repeat_penalty=1.2, reset=True)


def _bench(model_dir, *extra):
    res = CliRunner().invoke(main, ["bench", "--model", model_dir, "--prompt", "abcabc abcabc", "--max-tokens", "6",
                                    "--repeat", "1", "--warmup", "0", "--dtype", "float64", "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_bench_runs_the_llama_cpp_row_on_the_gguf_given(tiny_models, tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    FakeLlama.made.clear()
    report = _bench(tiny_models["llama_mha"], "--runs", "llama_cpp,specrun_ar", "--gguf", str(gguf),
                    "--penalty-window", "32")
    runs = {r["name"]: r for r in report["runs"]}
    assert runs["llama_cpp"]["kind"] == "llama_cpp" and runs["llama_cpp"]["tokens"] == 6
    assert runs["llama_cpp"]["ratio_to_specrun_ar"] > 0
    assert report["identical"] is True  # its tokens are not compared with specrun's
    assert any(n.startswith("llama_cpp: llama.cpp on a GGUF file") for n in report["notes"])
    kw = FakeLlama.made[-1]
    assert kw["model_path"] == str(gguf) and kw["last_n_tokens_size"] == 32 and kw["n_ctx"] >= 6


def test_bench_skips_the_llama_cpp_row_saying_why(tiny_models, tmp_path, monkeypatch):
    report = _bench(tiny_models["llama_mha"], "--runs", "llama_cpp,specrun_ar")
    assert [r["name"] for r in report["runs"]] == ["specrun_ar"]
    assert any("llama_cpp skipped: no GGUF file of this model" in n for n in report["notes"])
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails: not installed
    report = _bench(tiny_models["llama_mha"], "--runs", "llama_cpp,specrun_ar", "--gguf", str(gguf))
    assert [r["name"] for r in report["runs"]] == ["specrun_ar"]
    assert any("llama-cpp-python is not installed" in n for n in report["notes"])


def test_finding_the_default_gguf_converts_no_model(tiny_models, tmp_path, monkeypatch):
    """Whether a model is the built-in smollm2 is asked of the cache's path: another model's bench never converts
    smollm2 (a minute, 540 MB) to compare with it."""
    from specrun.models import smollm2

    def no_convert(*a):
        raise AssertionError("smollm2 converted")

    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "_convert", no_convert)
    assert find_gguf(types.SimpleNamespace(path=tiny_models["llama_mha"]), None) is None
    assert find_gguf(types.SimpleNamespace(path="/x"), str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    converted = tmp_path / smollm2.CACHE_NAME
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    want = smollm2.gguf_file() if importlib.util.find_spec(smollm2.PACKAGE) else None
    assert find_gguf(types.SimpleNamespace(path=str(converted)), None) == want
