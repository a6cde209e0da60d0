"""--rope-scaling TYPE:FACTOR: the context extended at load (the files untouched), tokens equal HF generate of the
model with that config, a job records it as an output setting (its workers load with it; another value is refused).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM

from specrun.cli import main
from specrun.models.rope import parse_rope_scaling

ARGS = ["--max-tokens", "24", "--ignore-eos", "--dtype", "float32", "--json"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model with sharp attention (large init), so that its tokens depend on the rotary."""
    from specrun.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("rope") / "m", arch="llama", heads=4, kv_heads=2,
                                tie_embeddings=False, seed=7, initializer_range=0.3))


def _generate(model, *extra) -> list[int]:
    r = CliRunner().invoke(main, ["generate", "--model", model, "--prompt", "the cat sat on the mat", *ARGS, *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.splitlines()[-1])["token_ids"]


@pytest.mark.parametrize("spec", ["yarn:4", "linear:2"])
def test_generate_with_rope_scaling_equals_hf_generate_with_that_config(model, spec):
    from specrun.models.loader import load_model

    ours = _generate(model, "--rope-scaling", spec, "--draft", "none")
    assert _generate(model, "--rope-scaling", spec) == ours  # drafted == AR
    assert ours != _generate(model, "--draft", "none")  # the scaling changes the model
    kind, factor = parse_rope_scaling(spec)
    cfg = AutoConfig.from_pretrained(model)
    cfg.rope_parameters = {"rope_type": kind, "factor": factor, "rope_theta": cfg.rope_parameters["rope_theta"],
                           **({"original_max_position_embeddings": 4096} if kind == "yarn" else {})}
    hf = AutoModelForCausalLM.from_pretrained(model, config=cfg, dtype=torch.float32)
    lm = load_model(model, rope_scaling=spec)
    assert lm.max_context == int(4096 * factor)
    ids = lm.tokenizer.encode("the cat sat on the mat")
    out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert out[0, len(ids):].tolist() == ours


def test_a_job_records_it_runs_with_it_and_refuses_another(model, tmp_path):
    pytest.importorskip("ray")
    from specrun.errors import SpecrunError
    from specrun.job import prepare

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "x", "prompt": "the cat sat on the mat"}) + "\n")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"id": "y", "prompt": "hi", "max_tokens": 9000}) + "\n")
    with pytest.raises(SpecrunError, match="exceeds the model context of 4096"):
        prepare(long, tmp_path / "no", model=model, dtype="float32")
    assert prepare(long, tmp_path / "yes", model=model, dtype="float32", rope_scaling="yarn:4").created

    r = CliRunner().invoke(main, ["submit", str(p), "--model", model, "--job-dir", str(tmp_path / "job"),
                                  "--rope-scaling", "yarn:4", *ARGS[:-1], "--actors", "1", "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "job" / "job.json").read_text())["model"]["rope_scaling"] == "yarn:4"
    rows = [json.loads(x) for x in CliRunner().invoke(main, ["export", str(tmp_path / "job")]).stdout.splitlines()]
    assert rows[0]["token_ids"] == _generate(model, "--rope-scaling", "yarn:4", "--seed",
                                             str(_job_seed("x")), "--draft", "none")
    with pytest.raises(SpecrunError, match="model.rope_scaling"):
        prepare(p, tmp_path / "job", model=model, dtype="float32", sampling=_params())


def _job_seed(pid: str) -> int:
    from specrun.jobs.inputs import derive_seed

    return derive_seed(0, pid)


def _params():
    from specrun.decoding.verify.params import SamplingParams

    return SamplingParams(max_tokens=24, ignore_eos=True)


def test_bad_values_are_named():
    for bad in ("yarn", "dynamic:4", "yarn:1", "yarn:x", "linear:nan"):
        with pytest.raises(ValueError, match="--rope-scaling"):
            parse_rope_scaling(bad)
    r = CliRunner().invoke(main, ["generate", "--rope-scaling", "longrope:4", "--prompt", "x"])
    assert r.exit_code == 2 and "--rope-scaling" in r.output
