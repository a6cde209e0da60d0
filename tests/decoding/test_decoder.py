"""The lean decoder forward: refuses architectures and config features it would silently compute wrong."""

import json
import shutil

import pytest
from transformers import Gemma2Config, GraniteConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from specrun.decoding.decoder import check_supported
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
