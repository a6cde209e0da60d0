"""Smoke tests: `specrun bench --json` on a tiny model (every run name, identical tokens) and proxy_model.py.

Benchmarks are not tests: these only check that the tools run end to end and report what they promise.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from specrun.cli import main

REPO = Path(__file__).resolve().parents[2]
BASE_RUNS = {"hf_ar", "hf_prompt_lookup", "specrun_ar", "specrun_spec", "ngram_only", "recycling_only"}


def _bench(model_dir: str, *extra: str) -> dict:
    args = ["bench", "--model", model_dir, "--prompt", "abcabc abcabc", "--max-tokens", "12", "--repeat", "1",
            "--warmup", "0", "--dtype", "float64", "--json", *extra]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_bench_json_greedy(tiny_models):
    report = _bench(tiny_models["llama_gqa"])
    runs = {r["name"]: r for r in report["runs"]}
    assert BASE_RUNS <= set(runs)
    assert report["identical"] is True and report["mismatches"] == [] and report["lossless"] is True
    assert all(r["identical"] is True and r["first_diff"] is None and r["near_tie"] is None
               for r in runs.values() if r["kind"] == "specrun")
    for r in runs.values():
        assert r["tokens"] == 12 and r["tokens_per_s"] > 0
    assert runs["specrun_ar"]["ratio_to_specrun_ar"] == 1.0
    assert runs["specrun_spec"]["mean_accepted"] >= 1.0
    assert abs(sum(runs["specrun_spec"]["phase_fraction"].values()) - 1.0) < 1e-6
    assert any("heads_partial skipped" in n for n in report["notes"])  # no --heads given


def test_bench_sampled_lengths_and_run_filter(tiny_models):
    report = _bench(tiny_models["llama_mha"], "--temperature", "1", "--min-p", "0.1", "--penalty", "1.2",
                    "--penalty-window", "4", "--lengths", "4,12", "--runs", "hf_ar,specrun_ar,specrun_spec")
    assert [r["name"] for r in report["runs"]] == ["hf_ar", "specrun_ar", "specrun_spec"]
    assert report["identical"] is True
    assert [b["length"] for b in report["lengths"]] == [4, 12]
    assert any("not comparable" in n for n in report["notes"])  # windowed penalty vs HF's whole-context one


def test_bench_says_when_torchs_4bit_draft_ran_uncompiled(tiny_models):
    """A float32 model drafts on torch's int4 kernels; a short run under auto builds no package: the note says how."""
    flags = ("--dtype", "float32", "--runs", "specrun_ar,specrun_spec", "--draft", "quant")
    report = _bench(tiny_models["llama_gqa"], *flags)
    runs = {r["name"]: r for r in report["runs"]}
    assert runs["specrun_spec"]["draft_eager"] and not runs["specrun_ar"]["draft_eager"]
    assert any("--compile-draft on builds it" in n for n in report["notes"])
    quiet = _bench(tiny_models["llama_gqa"], *flags, "--compile-draft", "off")  # asked for: nothing to say
    assert not any("--compile-draft on builds it" in n for n in quiet["notes"])
    chosen = _bench(tiny_models["llama_gqa"], *flags[:2], "--runs", "eager_draft_spec", "--draft", "quant")
    assert chosen["runs"][0]["draft_eager"]  # eager_draft_spec's own choice: nothing to say either
    assert not any("--compile-draft on builds it" in n for n in chosen["notes"])


def test_bench_rejects_bad_flags(tiny_models):
    res = CliRunner().invoke(main, ["bench", "--model", tiny_models["llama_mha"], "--prompt", "x", "--runs", "nope"])
    assert res.exit_code != 0 and "nope" in res.output
    res = CliRunner().invoke(main, ["bench", "--model", tiny_models["llama_mha"], "--prompt", "x", "--lengths", "a,2"])
    assert res.exit_code != 0 and "a,2" in res.output


@pytest.mark.parametrize("extra, fault", [
    (["--prompt", "x", "--runs", "llama_cpp"], "nothing to run: llama_cpp skipped"),  # no GGUF: was a ZeroDivisionError
    (["--prompt", "x", "--runs", "recurrent_only"], "nothing to run: recurrent_only skipped"),
    (["--prompt", "x", "--concurrency", ""], "names no value"),
    (["--prompt", "x", "--concurrency", "2", "--batch-attention", "flashinfer"], "flashinfer runs on CUDA"),
    (["--prompt", "x", "--concurrency", "2", "--lengths", "8"], "does not combine with --concurrency"),
    (["--prompt", "x", "--batch-attention", "dense"], "give --concurrency"),
    (["--prompt-file", "{bin}"], "is not valid UTF-8"),
])
def test_bench_says_which_input_is_wrong_never_an_internal_error(tiny_models, tmp_path, extra, fault):
    (tmp_path / "bin.txt").write_bytes(bytes([0xD3, 0x28, 0xFF, 0x00, 0x81]))
    args = [a.replace("{bin}", str(tmp_path / "bin.txt")) for a in extra]
    res = CliRunner().invoke(main, ["bench", "--model", tiny_models["llama_mha"], "--max-tokens", "4", *args])
    assert res.exit_code != 0 and fault in res.output and "internal error" not in res.output, res.output


def test_rows_that_compile_or_only_ablate_compiling_run_only_by_name():
    from specrun.bench.runner import DEFAULT_RUNS, select_runs

    default = {r.name for r in select_runs(None)}
    by_name = {"compiled_ar", "compiled_spec", "eager_draft_spec"}
    assert "specrun_ar" in default and not default & by_name
    assert {r.name for r in DEFAULT_RUNS} - default == by_name
    from specrun.bench.runner import plan
    from specrun.decoding.engine import EngineConfig

    (_, config), = plan(EngineConfig(), None, select_runs("eager_draft_spec"))[0]
    assert config.compile_draft == "off" and config == EngineConfig(compile_draft="off")
    assert [r.name for r in select_runs("compiled_ar, specrun_ar")] == ["specrun_ar", "compiled_ar"]
    with pytest.raises(ValueError, match="'nope'"):
        select_runs("specrun_ar,nope")


def _load_proxy_script():
    spec = importlib.util.spec_from_file_location("proxy_model", REPO / "bench" / "proxy_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_proxy_model_script_smoke(tmp_path, capsys):
    out = tmp_path / "proxy"
    argv = ["--out", str(out), "--steps", "3", "--max-files", "12", "--vocab", "300", "--hidden", "32", "--layers", "1",
            "--heads", "2", "--kv-heads", "1", "--seq-len", "32", "--batch-size", "2", "--eval-windows", "2",
            "--heads-steps", "2", "--threads", str(torch.get_num_threads())]
    assert _load_proxy_script().main(argv) == 0
    assert "held-out loss" in capsys.readouterr().out
    from specrun.models.loader import load_model

    lm = load_model(str(out))
    text = "def f(x):\n    return x"
    assert lm.tokenizer.decode(lm.tokenizer.encode(text), skip_special_tokens=True) == text
    info = json.loads((out / "proxy_info.json").read_text())
    assert info["steps"] == 3 and info["heldout_loss"] > 0
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary directories left behind
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    # the heads it trained plug into the bench's heads ablation
    report = _bench(str(out), "--heads", str(out / "heads"), "--runs", "specrun_ar,heads_partial")
    assert [r["name"] for r in report["runs"]] == ["specrun_ar", "heads_partial"] and report["identical"] is True


def test_lockstep_runs_match_runs_alone_and_time_only_their_own_steps(load_fixture):
    from specrun.bench.runner import run_lockstep
    from specrun.decoding.engine import Engine, EngineConfig
    from specrun.decoding.verify.params import SamplingParams

    lm = load_fixture("llama_gqa")
    prompt = lm.tokenizer.encode("abcabc abcabc")
    params = SamplingParams(max_tokens=24, temperature=1.0, min_p=0.1, seed=1, ignore_eos=True)
    configs = [EngineConfig(drafters=()), EngineConfig(), EngineConfig(drafters=("ngram",))]
    t0 = time.perf_counter()
    together = run_lockstep(lm, configs, prompt, params, lengths=(5, 24))
    wall = time.perf_counter() - t0
    alone = [Engine(lm, c).generate(prompt, params).token_ids for c in configs]
    for (toks, seconds, at, stats), toks1 in zip(together, alone):
        assert toks == toks1 and len(toks) == 24 and stats["new_tokens"] == 24
        assert 0 < at[5] <= at[24] <= seconds == stats["seconds"]
    assert sum(seconds for _, seconds, _, _ in together) <= wall  # each counts its own steps, none the others'


@pytest.mark.parametrize("lockstep", [True, False])
def test_run_bench_steps_its_specrun_runs_together_only_in_lockstep(load_fixture, monkeypatch, lockstep):
    from specrun.bench import runner
    from specrun.decoding.engine import EngineConfig
    from specrun.decoding.verify.params import SamplingParams

    lm = load_fixture("llama_gqa")
    groups = []
    real = runner.run_lockstep
    monkeypatch.setattr(runner, "run_lockstep", lambda lm, configs, *a, **k: groups.append(len(configs)) or real(
        lm, configs, *a, **k))
    planned, _ = runner.plan(EngineConfig(), None, [r for r in runner.DEFAULT_RUNS
                                                    if r.name in ("specrun_ar", "specrun_spec", "ngram_only")])
    settings = runner.BenchSettings(max_tokens=8, repeat=2, warmup=0, lockstep=lockstep)
    ms = runner.run_bench(lm, None, lm.tokenizer.encode("abc abc"), SamplingParams(), planned, settings)
    assert groups == ([3, 3] if lockstep else [1] * 6)  # one-by-one: each run alone
    assert len(ms) == 6 and all(len(m.token_ids) == 8 for m in ms)


def test_bench_one_by_one_runs_the_same_table(tiny_models):
    report = _bench(tiny_models["llama_gqa"], "--runs", "specrun_ar,specrun_spec", "--one-by-one")
    assert report["lockstep"] is False and report["identical"] is True
    assert [r["name"] for r in report["runs"]] == ["specrun_ar", "specrun_spec"]
    assert _bench(tiny_models["llama_gqa"], "--runs", "specrun_ar,specrun_spec")["lockstep"] is True


def _ar_and_a_real_divergence(load_fixture):
    """-> lm, prompt, params, AR's 10 tokens, and those tokens with the 5th replaced by AR's runner-up there"""
    from specrun.bench.neartie import ar_scores
    from specrun.decoding.engine import Engine, EngineConfig
    from specrun.decoding.verify.params import SamplingParams

    lm = load_fixture("llama_gqa")
    prompt = lm.tokenizer.encode("abc abc")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    runner_up = int(ar_scores(lm, prompt, ref[:4], params).topk(2).indices[1])
    return lm, prompt, params, ref, [*ref[:4], runner_up, *ref[5:]]


def test_divergent_run_gets_first_diff_gap_and_verdict(load_fixture):
    from specrun.bench.neartie import check_divergence
    from specrun.bench.report import annotate_divergences, summarize
    from specrun.bench.runner import Measurement

    lm, prompt, params, ref, other = _ar_and_a_real_divergence(load_fixture)
    ms = [Measurement("specrun_ar", 0, ref, 1.0, stats={"mean_accepted": 1.0}),
          Measurement("specrun_spec", 0, other, 0.5, stats={"mean_accepted": 2.0})]
    report = summarize(ms, {"specrun_ar": "specrun", "specrun_spec": "specrun"})
    annotate_divergences(report, ms, lambda r, t: check_divergence(lm, prompt, params, r, t))
    spec = next(r for r in report["runs"] if r["name"] == "specrun_spec")
    assert spec["identical"] is False and spec["first_diff"] == 4 and spec["gap"] > 0
    assert spec["near_tie"] is False and report["lossless"] is False  # float64: a real gap is no tie


def test_concurrency_rows_report_each_divergence_from_ar_with_its_gap(load_fixture):
    from specrun.bench.concurrency import _check_against_ar

    lm, prompt, params, ref, other = _ar_and_a_real_divergence(load_fixture)
    rows = [{"name": "specrun_spec", "concurrency": 4}, {"name": "specrun_ar", "concurrency": 1},
            {"name": "specrun_ar", "concurrency": 4}]
    asked = []
    _check_against_ar(lm, [prompt, prompt], params, rows, [{0: other, 1: ref}, {0: ref}, {0: ref, 1: other}],
                      alone=lambda i: asked.append(i) or (ref, False))
    assert asked == [1]  # prompt 1 never ran alone: its reference is made once
    (d,) = rows[0]["divergences"]
    assert d["prompt"] == 0 and d["first_diff"] == 4 and d["other_token"] == other[4] and d["gap"] > 0
    assert rows[0]["identical_to_ar"] is False and rows[0]["lossless"] is False  # a real gap in float32 is no tie
    assert rows[1]["identical_to_ar"] and rows[1]["lossless"] and rows[1]["divergences"] == []
    assert [d["prompt"] for d in rows[2]["divergences"]] == [1] and rows[2]["lossless"] is False


def test_bench_concurrency_json(tiny_models):
    report = _bench(tiny_models["llama_gqa"], "--concurrency", "1,3", "--batch-attention", "paged")
    rows = {(r["name"], r["concurrency"]) for r in report["runs"]}
    assert rows == {(n, c) for n in ("specrun_ar", "specrun_spec") for c in (1, 3)}
    for r in report["runs"]:
        assert r["tokens"] == 12 * r["concurrency"] and r["tokens_per_s"] > 0
        assert r["identical_to_ar"] is True and r["divergences"] == [] and r["lossless"] is True
    assert {t["name"] for t in report["table"] if t["vs_ar"] == 1.0} == {"specrun_ar"}
    assert all(r["quant_draft"] in (None, "eager", "compiled", "kernels") and "layers_compiled" in r
               for r in report["runs"])
    assert {r["quant_draft"] for r in report["runs"] if r["name"] == "specrun_ar"} == {None}  # no drafter: no draft
    # 12 tokens a prompt compile nothing: a spec run of 3 sequences whose draft is torch's is said to have run without
    eager = any(r["quant_draft"] == "eager" and r["concurrency"] == 3 for r in report["runs"])
    assert eager == any("specrun_spec ran without the quantized self-draft" in n for n in report["notes"]), report


def test_a_concurrency_run_without_its_compiled_draft_or_layers_says_so():
    """Under compile_draft auto several sequences draft with the quantized self-draft only compiled: a run whose draft
    stayed uncompiled (nothing cached, too few tokens asked to build) ran without it, and the notes say so and how to
    build it; likewise layers that could compile and ran eagerly. One sequence drafts eagerly: nothing to say."""
    from specrun.bench.concurrency import compile_notes
    from specrun.decoding.engine import EngineConfig

    configs = {"specrun_ar": EngineConfig(drafters=()), "specrun_spec": EngineConfig()}

    def row(name, c, draft, layers):
        return {"name": name, "concurrency": c, "quant_draft": draft, "layers_compiled": layers}

    rows = [row("specrun_ar", 1, None, True), row("specrun_spec", 1, "eager", True), row("specrun_ar", 4, None, False),
            row("specrun_spec", 4, "eager", False)]
    draft, layers = compile_notes(rows, configs)
    assert draft.startswith("specrun_spec ran without the quantized self-draft") and "--compile-draft on" in draft
    assert layers.startswith("specrun_ar, specrun_spec ran the layers uncompiled") and "--compile-layers on" in layers
    assert compile_notes(rows[:2], configs) == []  # alone, the eager draft drafts; the layers compiled
    off = {**configs, "specrun_spec": EngineConfig(compile_draft="off")}  # asked for: drafts eagerly, not a surprise
    assert compile_notes([row("specrun_spec", 4, "eager", None)], off) == []
    compiled = [row("specrun_spec", 4, "compiled", True), row("specrun_spec", 4, "kernels", None)]
    assert compile_notes(compiled, configs) == []


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "one by one"])
def test_a_levels_runs_take_turns_a_step_each_in_lockstep_else_run_whole_one_after_another(load_fixture, monkeypatch,
                                                                                         lockstep):
    """--concurrency with --lockstep (the default): a level's engines step in turn, so a slow spell of the host falls
    on every run alike; --one-by-one: each run whole, then the next. Either way each run's tokens are AR's."""
    from specrun.bench.concurrency import run_concurrency
    from specrun.decoding.engine import Engine, EngineConfig
    from specrun.decoding.verify.params import SamplingParams

    lm = load_fixture("llama_gqa", "float32")
    order, real = [], Engine.step  # the timed steps (the AR references after them run one prompt a time)
    monkeypatch.setattr(Engine, "step", lambda self, *a: (self.batch.concurrency == 2 and order.append(
        bool(self.config.drafters))) or real(self, *a))
    configs = {"specrun_ar": EngineConfig(drafters=()), "specrun_spec": EngineConfig(drafters=("ngram",))}
    rows = run_concurrency(lm, [[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_tokens=10, temperature=1.0), (2,),
                           configs, lockstep=lockstep)
    turns = sum(1 for a, b in zip(order, order[1:]) if a != b)
    both = 2 * min(order.count(False), order.count(True))  # steps while both runs had sequences left
    assert turns >= both - 1 if lockstep else turns == 1, order
    assert [(r["name"], r["tokens"]) for r in rows] == [("specrun_ar", 20), ("specrun_spec", 20)]
    assert all(r["identical_to_ar"] for r in rows), rows


def test_concurrency_runs_are_chosen_by_name_and_each_spec_run_is_measured_against_its_own_ar():
    from specrun.bench.concurrency import summarize_concurrency
    from specrun.cli.bench_concurrency import concurrency_configs
    from specrun.decoding.engine import EngineConfig

    base = EngineConfig(drafters=("ngram", "quant"))
    assert list(concurrency_configs(base, None)) == ["specrun_ar", "specrun_spec"]
    configs = concurrency_configs(base, "compiled_ar, compiled_spec")
    assert configs["compiled_ar"] == EngineConfig(drafters=(), compile_layers="on")
    assert configs["compiled_spec"] == EngineConfig(drafters=("ngram", "quant"), compile_layers="on")
    with pytest.raises(click.BadParameter, match="hf_ar: with --concurrency the runs are"):
        concurrency_configs(base, "specrun_ar,hf_ar")
    rows = [{"name": n, "concurrency": 4, "tokens_per_s": tps, "mean_accepted": 1.0}
            for n, tps in (("specrun_ar", 10.0), ("specrun_spec", 15.0), ("compiled_ar", 20.0),
                           ("compiled_spec", 30.0))]
    vs_ar = {t["name"]: t["vs_ar"] for t in summarize_concurrency(rows)}
    assert vs_ar == {"specrun_ar": 1.0, "specrun_spec": 1.5, "compiled_ar": 1.0, "compiled_spec": 1.5}


def test_bench_concurrency_rejects_bad_levels(tiny_models):
    res = CliRunner().invoke(main, ["bench", "--model", tiny_models["llama_gqa"], "--prompt", "x", "--concurrency",
                                    "0,2"])
    assert res.exit_code == 2 and "--concurrency" in res.output


def test_bench_reports_the_memory_roofline_per_repeat_between_probes(tiny_models, monkeypatch):
    """A probe before the first repeat and after each; each repeat's AR share against the mean of the two around it,
    the reported share their median, the bandwidth the probes' median."""
    import specrun.bench.roofline as roofline

    readings = iter([10e9, 30e9, 20e9, 50e9])  # the host's bandwidth moving between repeats
    monkeypatch.setattr(roofline, "read_bandwidth", lambda device, **k: next(readings))
    report = _bench(tiny_models["llama_gqa"], "--runs", "specrun_ar,specrun_spec", "--repeat", "3")
    roof = report["roofline"]
    assert roof["bandwidth_probes"] == [10e9, 30e9, 20e9, 50e9] and roof["bandwidth_bytes_per_s"] == 25e9
    assert roof["weight_bytes"] > 0 and roof["kv_bytes"] > 0
    per_token = roof["weight_bytes"] + roof["kv_bytes"]
    assert abs(roof["min_seconds_per_token"] - per_token / 25e9) < 1e-15
    ar = next(r for r in report["runs"] if r["name"] == "specrun_ar")
    want = [per_token / bw * t for bw, t in zip([20e9, 25e9, 35e9], ar["tokens_per_s_all"])]
    assert roof["specrun_ar_shares"] == pytest.approx(want, rel=1e-12)
    assert roof["specrun_ar_share"] == pytest.approx(sorted(want)[1], rel=1e-12)
    assert "specrun_spec_share" not in roof  # a share of the roofline means something for one token a step only


def test_the_roofline_without_bracketing_probes_is_the_median_runs_against_one_probe(tiny_models):
    from specrun.bench.report import add_roofline
    from specrun.bench.roofline import roofline
    from specrun.models.loader import load_model

    roof = roofline(load_model(tiny_models["llama_gqa"], dtype="float32"), 10, [40e9])  # one probe, two repeats
    report = {"runs": [{"name": "specrun_ar", "tokens_per_s": 100.0, "tokens_per_s_all": [90.0, 110.0]},
                       {"name": "compiled_ar", "tokens_per_s": 150.0, "tokens_per_s_all": [150.0]},
                       {"name": "compiled_spec", "tokens_per_s": 300.0, "tokens_per_s_all": [300.0]}]}
    add_roofline(report, roof)
    assert report["roofline"]["specrun_ar_share"] == pytest.approx(roof["min_seconds_per_token"] * 100.0)
    assert report["roofline"]["compiled_ar_share"] == pytest.approx(roof["min_seconds_per_token"] * 150.0)
    assert "specrun_ar_shares" not in report["roofline"] and "compiled_spec_share" not in report["roofline"]
