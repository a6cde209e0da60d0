"""Tiny random-weight HF causal LMs with a byte-level tokenizer, built offline and deterministically.

build_tiny_model(out_dir, ...) -> Path writes a loadable model directory; demo_model_dir() -> Path returns the cached demo.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from specrun.models.cache import cached_dir

# Token ids: byte b has id b (0..255); the special tokens follow.
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
TOKENIZER_SIZE = 259
ARCHS = ("llama", "qwen2", "qwen3", "mistral")
DEMO_NAME = "demo-v1"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@contextmanager
def quiet_progress_bars():
    """Hide transformers' per-load/save progress bars for the duration (restores the previous setting)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char map (what the ByteLevel pre-tokenizer/decoder use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _save_tokenizer(out_dir: Path, max_len: int) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json for a byte-level BPE with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers import AddedToken

    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    assert tok.get_vocab_size() == TOKENIZER_SIZE
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,  # else Qwen2Tokenizer (forced for qwen2 by transformers 5) adds a 260th token <|endoftext|>
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,  # "<s>" typed in a prompt is 3 bytes, never the special token: text round-trips
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n"
    )


def _make_config(arch: str, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 tie_embeddings: bool, max_position_embeddings: int, initializer_range: float):
    """The transformers config object for `arch` (head_dim = hidden // heads, no sliding window)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        rms_norm_eps=1e-6, initializer_range=initializer_range,
    )
    if arch == "llama":
        return LlamaConfig(**common, head_dim=hidden // heads)
    if arch == "mistral":
        return MistralConfig(**common, head_dim=hidden // heads, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False, sliding_window=None)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=hidden // heads, use_sliding_window=False, sliding_window=None)
    raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")


def build_tiny_model(out_dir, *, arch: str = "llama", hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 4, tie_embeddings: bool = True, extra_vocab: int = 0, seed: int = 0,
                     max_position_embeddings: int = 4096, initializer_range: float = 0.02) -> Path:
    """Write a random-weight `arch` causal LM (float32 safetensors) + byte-level tokenizer into out_dir; return it.

    Same arguments -> byte-identical weight files. extra_vocab > 0 makes the model's vocab larger than the tokenizer.
    initializer_range is the init std: 0.02 (HF default) gives near-uniform next-token distributions whose greedy
    output soon loops; larger values (e.g. 1.0) give peaked, chaotic outputs.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden} must divide by heads={heads}, and heads by kv_heads={kv_heads}")
    if extra_vocab < 0:
        raise ValueError(f"extra_vocab must be >= 0, got {extra_vocab}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _make_config(arch, vocab=TOKENIZER_SIZE + extra_vocab, hidden=hidden, layers=layers, heads=heads,
                          kv_heads=kv_heads, tie_embeddings=tie_embeddings,
                          max_position_embeddings=max_position_embeddings, initializer_range=initializer_range)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    with quiet_progress_bars():
        model.save_pretrained(out)
    _save_tokenizer(out, max_position_embeddings)
    return out


def demo_model_dir() -> Path:
    """The demo model's directory (demo-v1 in the specrun cache), built once if missing."""
    return cached_dir(DEMO_NAME, lambda tmp: build_tiny_model(
        tmp, arch="llama", hidden=128, layers=4, heads=4, kv_heads=2, tie_embeddings=False, seed=20240601,
        max_position_embeddings=131072))
