"""specrun.submit / Job / resume and Ray Data on one local Ray: the API's job equals the CLI's job token for token
(the API's from a Parquet file, the CLI's from the same prompts as JSON lines), LLM.generate of the lines equals
both, and a Ray Data run over the same rows equals the job's outputs.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import specrun
from specrun.cli import main

ray = pytest.importorskip("ray")
LINES = [{"id": "a", "prompt": "Once upon a time"}, {"id": "b", "prompt": "abcabcabc"},
         {"id": "c", "prompt": "The end.", "seed": 7, "max_tokens": 24}]  # c: overrides, a prompts-file line only
PARAMS = {"max_tokens": 32, "temperature": 1.0, "seed": 42, "ignore_eos": True}


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    from specrun.actors.pool import init_ray

    init_ray(None, num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_mha"]


@pytest.fixture(scope="module")
def cli_job(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in LINES))
    res = CliRunner().invoke(main, ["submit", str(d / "p.jsonl"), "--job-dir", str(d / "job"), "--model", model,
                                    "--max-tokens", "32", "--temperature", "1.0", "--seed", "42", "--ignore-eos",
                                    "--quiet"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["export", str(d / "job")])
    return {r["id"]: r for r in map(json.loads, res.stdout.splitlines())}


def test_submit_from_parquet_equals_cli_job(model, cli_job, tmp_path):
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"key": [x["id"] for x in LINES], "text": [x["prompt"] for x in LINES]}), data)
    overrides = [{k: v for k, v in x.items() if k not in ("id", "prompt")} for x in LINES]
    # per-prompt overrides are not columns here: give the API the lines for those, the Parquet file for the rest
    plain = [i for i, o in enumerate(overrides) if not o]
    job = specrun.submit(data, tmp_path / "job", model=model, sampling=specrun.SamplingParams(**PARAMS),
                         columns=specrun.Columns(prompt="text", id="key"), concurrency=2)
    assert job.created and not job.summary.failed
    rows = {r["id"]: r for r in job.outputs(rows=True)}
    for i in plain:
        pid = LINES[i]["id"]
        assert rows[pid]["token_ids"] == cli_job[pid]["token_ids"]
        assert rows[pid]["text"] == cli_job[pid]["text"]
    assert job.outputs().column("id").to_pylist() == ["a", "b", "c"]
    st = job.wait(timeout=5)
    assert st["totals"]["done"] == 3 == job.status()["totals"]["done"]
    # the same submit again finds the job done; resume runs nothing
    again = specrun.submit(data, tmp_path / "job", model=model, sampling=specrun.SamplingParams(**PARAMS),
                           columns=specrun.Columns(prompt="text", id="key"))
    assert not again.created and again.summary.done == []
    assert specrun.resume(tmp_path / "job").summary.done == []
    with pytest.raises(specrun.JobError, match="different settings"):
        specrun.submit(data, tmp_path / "job", model=model, sampling=specrun.SamplingParams(**{**PARAMS, "seed": 1}),
                       columns=specrun.Columns(prompt="text", id="key"))


def test_llm_generate_of_the_lines_equals_cli_job(model, cli_job):
    outs = specrun.LLM(model).generate(LINES, specrun.SamplingParams(**PARAMS))  # dict prompts: a job's lines
    for line, out in zip(LINES, outs):
        want = cli_job[line["id"]]
        assert out.token_ids == want["token_ids"]
        assert (out.text, out.finish_reason, out.id) == (want["text"], want["finish_reason"], line["id"])


def test_ray_data_equals_job_outputs(model, cli_job):
    ds = ray.data.from_items([{"id": x["id"], "text": x["prompt"]} for x in LINES if len(x) == 2])
    proc = specrun.ray_data.processor(model, specrun.SamplingParams(**PARAMS), prompt_column="text", batch_size=2)
    got = {r["id"]: r for r in proc(ds).take_all()}
    assert set(got) == {"a", "b"}
    for pid, r in got.items():
        assert list(r["generated_token_ids"]) == cli_job[pid]["token_ids"]
        assert r["generated_text"] == cli_job[pid]["text"]
        assert r["finish_reason"] == cli_job[pid]["finish_reason"]


def test_ray_data_actors_take_this_machines_cores_between_them(model):
    """Ray runs an actor's torch on as many threads as it has CPUs: 1 by Ray Data's default, half of 2 cores idle."""
    import os

    cores = os.cpu_count() or 1
    assert specrun.ray_data.processor(model).map_batches_kwargs["num_cpus"] == cores
    assert specrun.ray_data.processor(model, concurrency=2).map_batches_kwargs["num_cpus"] == max(1, cores // 2)
    assert specrun.ray_data.processor(model, num_cpus=0.5).map_batches_kwargs["num_cpus"] == 0.5
    env = specrun.ray_data.processor(model).map_batches_kwargs["runtime_env"]["env_vars"]
    assert env["MALLOC_ARENA_MAX"] == os.environ.get("MALLOC_ARENA_MAX", "2")  # as job workers start
    for bad in ({"concurrency": 0}, {"batch_size": -1}, {"concurrency": True}):
        with pytest.raises(specrun.SpecrunError, match=next(iter(bad))):
            specrun.ray_data.processor(model, **bad)


def test_the_same_list_of_prompts_submitted_again_finds_its_job(model, tmp_path, monkeypatch):
    """A list of prompts without a job_dir names its job by the prompts (specrun-jobs/prompts-HASH): submitting the
    same list again resumes that job (here: finds it done), another list makes another."""
    monkeypatch.chdir(tmp_path)
    params = specrun.SamplingParams(max_tokens=4)
    first = specrun.submit(["hello", "world"], model=model, sampling=params, quiet=True)
    again = specrun.submit(["hello", "world"], model=model, sampling=params, quiet=True)
    assert first.created and not again.created and again.root == first.root
    assert first.root.parent.name == "specrun-jobs" and first.root.name.startswith("prompts-")
    from specrun.job import prepare  # what submit writes before it runs

    assert prepare(["hello", "world!"], model=model, sampling=params).root != first.root
    with pytest.raises(specrun.PromptError, match="prompt 1: invalid unicode"):
        prepare(["fine", "a\ud800"], model=model, sampling=params)


@pytest.mark.parametrize("kw, fault", [
    ({"dtype": "fp8"}, "dtype='fp8'"), ({"device": "tpu"}, "device='tpu'"), ({"device": 5}, "device=5"),
    ({"trust_remote_code": "no"}, "trust_remote_code='no'"), ({"checkpoint_every": 0}, "checkpoint_every=0"),
    ({"actors": "2"}, "actors='2'"), ({"actors": 0}, "actors=0"), ({"address": 5}, "address=5"),
    ({"max_attempts": 0}, "max_attempts=0"), ({"poll_s": 0}, "poll_s=0"), ({"gpus_per_actor": -1}, "gpus_per_actor"),
    ({"engine": specrun.EngineConfig()}, "drafting="), ({"model_path": "/elsewhere"}, "model_path"),
    ({"hot_start": ["/no/such/job"]}, "not a specrun job"),
])
def test_a_setting_no_run_could_use_is_refused_before_the_job_is_written(model, tmp_path, kw, fault):
    """Not a job that fails at every resume and refuses the corrected submit ("exists with different settings")."""
    with pytest.raises(specrun.ConfigError, match=fault):
        specrun.submit(["hello"], tmp_path / "job", model=model, sampling=specrun.SamplingParams(max_tokens=2), **kw)
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("kw, fault", [
    ({"model": None}, "model=None"), ({"dtype": "bogus"}, "dtype='bogus'"), ({"device": "tpu"}, "device='tpu'"),
    ({"drafting": "bogus"}, "bogus"), ({"sampling": {"max_tokens": 2}}, "must be a SamplingParams"),
    ({"num_gpus": -1}, "num_gpus=-1"), ({"num_cpus": "x"}, "num_cpus='x'"),
])
def test_a_ray_data_processor_refuses_what_its_actors_could_not_load_with(kw, fault):
    with pytest.raises(specrun.ConfigError, match=fault):
        specrun.ray_data.processor(**kw)
    with pytest.raises(specrun.ConfigError, match="runs over a ray.data.Dataset"):
        specrun.ray_data.processor("demo")([{"prompt": "x"}])


def test_resume_checks_its_run_options_before_it_runs(model, tmp_path):
    from specrun.job import prepare

    job = prepare(["hello"], tmp_path / "job", model=model, sampling=specrun.SamplingParams(max_tokens=2))
    for kw, fault in (({"actors": 0}, "actors=0"), ({"hot_start": [str(tmp_path)]}, "not a specrun job"),
                      ({"trust_remote_code": "yes"}, "trust_remote_code='yes'")):
        with pytest.raises(specrun.ConfigError, match=fault):
            specrun.resume(job.root, **kw)
    assert not (job.root / "attempts").exists() or not list((job.root / "attempts").iterdir())
