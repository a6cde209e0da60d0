"""The lean decoder forward: refuses architectures and config features it would silently compute wrong."""

import json
import shutil

import pytest
from transformers import Gemma2Config, GraniteConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from specrun.decoding.forward.decoder import check_supported
from specrun.models.loader import load_model


@pytest.mark.parametrize("config, fault", [
    (MistralConfig(sliding_window=16), "sliding"),
    (Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0), "sliding"),
    (Gemma2Config(), "gemma2"),
    (GraniteConfig(), "granite"),
    (LlamaConfig(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (LlamaConfig(logit_scale=0.5), "logit_scale"),
    (LlamaConfig(logits_scaling=4.0), "logits_scaling"),
])
def test_refuses_what_it_does_not_implement(config, fault):
    with pytest.raises(ValueError, match=fault):
        check_supported(config)


@pytest.mark.parametrize("config", [LlamaConfig(), MistralConfig(sliding_window=None), Qwen2Config(), Qwen3Config()])
def test_accepts_the_supported_families(config):
    check_supported(config)


def test_load_refuses_a_sliding_window_model_naming_the_feature(tiny_models, tmp_path):
    d = tmp_path / "mistral-window"
    shutil.copytree(tiny_models["mistral"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["sliding_window"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="sliding-window attention"):
        load_model(str(d))


ROPES = {  # rope_scaling as config.json spells it; the first two depend on the sequence length a forward sees
    "longrope": dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8,
                     original_max_position_embeddings=48),
    "dynamic": dict(rope_type="dynamic", factor=4.0, original_max_position_embeddings=48),
    "linear": dict(rope_type="linear", factor=2.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
}


def _rope_model(tiny_models, tmp_path, name: str) -> str:
    d = tmp_path / f"rope-{name}"
    shutil.copytree(tiny_models["llama_gqa"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = ROPES[name]
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("name", ["longrope", "dynamic"])
def test_refuses_a_rope_whose_frequencies_depend_on_the_length(tiny_models, tmp_path, name):
    """longrope switched factors past its original length by the largest position of the forward: a run resumed at
    token 60 parted from the straight run (float64, drafted or not) before this refusal."""
    with pytest.raises(ValueError, match=f"rope_type='{name}'"):
        load_model(_rope_model(tiny_models, tmp_path, name))
    with pytest.raises(ValueError, match=f"rope_type='{name}'"):
        check_supported(LlamaConfig(rope_scaling=ROPES[name]))


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn"])
def test_position_pure_ropes_draft_and_resume_as_ar(tiny_models, tmp_path, name):
    from specrun.decoding.engine import Engine, EngineConfig
    from specrun.decoding.verify.params import SamplingParams

    lm = load_model(_rope_model(tiny_models, tmp_path, name), dtype="float64")
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat sat")
    params = SamplingParams(max_tokens=120, temperature=0.8, seed=2, ignore_eos=True)
    ar = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    assert Engine(lm, EngineConfig(drafters=("ngram", "recycling"))).generate(prompt, params).token_ids == ar
    assert Engine(lm, EngineConfig(drafters=())).generate(prompt, params, resume_from=ar[:60]).token_ids == ar
