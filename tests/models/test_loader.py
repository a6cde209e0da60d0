"""Model loading: every fixture architecture loads offline with the right eos ids, vocab and dtype; the demo model is
deterministic and cached safely; bad paths, dtypes and devices fail with messages naming the value."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from specrun.models.loader import decode_tokens, load_model, model_fingerprint
from specrun.models.tiny import BOS_ID, EOS_ID, TOKENIZER_SIZE, build_tiny_model, demo_model_dir
from tests.conftest import TINY_SPECS

TEXTS = ["Once upon a time", "héllo wörld 日本語 🎉\n\ttabs  and  spaces", "literal <s> and </s> stay text", ""]


@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_fixture_loads(load_fixture, name):
    lm = load_fixture(name)
    spec = TINY_SPECS[name]
    assert lm.dtype == torch.float64 and lm.device == torch.device("cpu")
    assert next(lm.model.parameters()).dtype == torch.float64
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.model.config._attn_implementation == "sdpa"
    assert lm.eos_ids == frozenset({EOS_ID})
    assert len(lm.tokenizer) == TOKENIZER_SIZE
    assert lm.vocab_size == TOKENIZER_SIZE + spec.get("extra_vocab", 0)
    assert lm.max_context == 4096
    assert lm.model.config.num_key_value_heads == spec["kv_heads"]
    assert len(lm.fingerprint) == 16 and not lm.is_demo
    tied = lm.model.get_output_embeddings().weight.data_ptr() == lm.model.get_input_embeddings().weight.data_ptr()
    assert tied == spec["tie_embeddings"]
    ids = lm.tokenizer.encode("abc")
    assert ids == [BOS_ID, ord("a"), ord("b"), ord("c")]
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids])).logits
    assert logits.shape == (1, 4, lm.vocab_size)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_any_text(load_fixture, text):
    tok = load_fixture("llama_gqa").tokenizer
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and all(0 <= i < 256 for i in ids[1:])
    assert ids[1:] == list(text.encode("utf-8"))
    assert decode_tokens(tok, ids) == text


def test_qwen2_tokenizer_matches_the_others(load_fixture):
    # transformers forces Qwen2Tokenizer for qwen2 configs; it must still be our 259-token byte tokenizer.
    q, ll = load_fixture("qwen2").tokenizer, load_fixture("llama_mha").tokenizer
    for text in TEXTS:
        assert q.encode(text) == ll.encode(text)
    assert (q.bos_token_id, q.eos_token_id, q.pad_token_id) == (ll.bos_token_id, ll.eos_token_id, ll.pad_token_id)


def test_chat_template(load_fixture):
    tok = load_fixture("llama_mha").tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "user: hi\nassistant: "


def test_big_output_vocab_and_decode_skips_unknown_ids(load_fixture):
    lm = load_fixture("llama_bigvocab")
    assert lm.vocab_size == TOKENIZER_SIZE + 37 > len(lm.tokenizer)
    assert lm.model.get_output_embeddings().weight.shape[0] == lm.vocab_size
    ids = [ord("h"), TOKENIZER_SIZE, ord("i"), lm.vocab_size - 1, EOS_ID, ord("!")]
    assert decode_tokens(lm.tokenizer, ids) == "hi!"
    assert decode_tokens(lm.tokenizer, []) == ""
    assert decode_tokens(lm.tokenizer, [TOKENIZER_SIZE + 5]) == ""


def test_eos_ids_take_a_generation_config_list(tmp_path):
    d = build_tiny_model(tmp_path / "m")
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [10, 11]
    (d / "generation_config.json").write_text(json.dumps(gen))
    lm = load_model(str(d))
    assert lm.eos_ids == frozenset({10, 11, EOS_ID})  # tokenizer's eos is always included


def test_dtypes_load(tiny_models):
    for name, dt in [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]:
        lm = load_model(tiny_models["llama_gqa"], dtype=name)
        assert lm.dtype == dt and next(lm.model.parameters()).dtype == dt


def test_build_is_deterministic_and_seeded(tmp_path):
    a = build_tiny_model(tmp_path / "a", arch="qwen3", kv_heads=2, seed=7)
    b = build_tiny_model(tmp_path / "b", arch="qwen3", kv_heads=2, seed=7)
    c = build_tiny_model(tmp_path / "c", arch="qwen3", kv_heads=2, seed=8)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert model_fingerprint(a) == model_fingerprint(b) != model_fingerprint(c)


def test_demo_is_deterministic_and_cached(tmp_path, monkeypatch, specrun_cache):
    dirs = []
    for sub in ("one", "two"):
        monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / sub))
        dirs.append(demo_model_dir())
        assert dirs[-1] == tmp_path / sub / "demo-v1"
    assert (dirs[0] / "model.safetensors").read_bytes() == (dirs[1] / "model.safetensors").read_bytes()
    mtime = (dirs[1] / "model.safetensors").stat().st_mtime_ns
    assert demo_model_dir() == dirs[1] and (dirs[1] / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    lm = load_model("demo")
    assert lm.is_demo and lm.path == str(dirs[1]) and lm.eos_ids == frozenset({EOS_ID})
    assert load_model(str(dirs[1])).is_demo  # the cached demo directory given as a path is still the demo
    assert load_model(str(dirs[1])).fingerprint == model_fingerprint(dirs[0])


def test_demo_concurrent_builds_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path))
    results, errors = [], []

    def build():
        try:
            results.append(demo_model_dir())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert sorted(os.listdir(tmp_path)) == ["demo-v1"]  # no temporary directories left behind


def test_tests_use_a_private_cache(specrun_cache):
    assert os.environ["SPECRUN_CACHE"] == str(specrun_cache)


def test_bad_paths_are_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="does not exist") as e:
        load_model(str(missing))
    assert str(missing) in str(e.value)
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory") as e:
        load_model(str(f))
    assert str(f) in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json") as e:
        load_model(str(empty))
    assert str(empty) in str(e.value)


def test_bad_dtype_and_device_are_named(tiny_models):
    path = tiny_models["llama_mha"]
    with pytest.raises(ValueError, match="'float8'"):
        load_model(path, dtype="float8")
    with pytest.raises(ValueError, match="'tpu'"):
        load_model(path, device="tpu")
    with pytest.raises(ValueError, match="'not a device'"):
        load_model(path, device="not a device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model(path, device="cuda")


def test_fingerprint_changes_with_weights_or_config(tmp_path):
    d = build_tiny_model(tmp_path / "m")
    before = model_fingerprint(d)
    assert model_fingerprint(d) == before
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (d / "config.json").write_text(json.dumps(cfg))
    after_cfg = model_fingerprint(d)
    assert after_cfg != before
    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    assert model_fingerprint(d) != after_cfg


def test_auto_dtype_follows_the_checkpoint_and_the_cpu(tiny_models, tmp_path, monkeypatch):
    import json
    import shutil

    from specrun.models import loader

    assert loader.resolve_dtype("auto", tiny_models["llama_gqa"], "cpu") == "float32"  # float32 checkpoint
    assert loader.resolve_dtype("float64", tiny_models["llama_gqa"], "cpu") == "float64"  # explicit wins
    bf = tmp_path / "bf"
    shutil.copytree(tiny_models["llama_gqa"], bf)
    cfg = json.loads((bf / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (bf / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: True)
    assert loader.resolve_dtype("auto", str(bf), "cpu") == "bfloat16"
    assert loader.resolve_dtype("auto", str(bf), "cuda") == "bfloat16"
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: False)
    assert loader.resolve_dtype("auto", str(bf), "cpu") == "float32"  # no native bf16: float32 is faster
    with pytest.raises(ValueError, match="does not exist"):
        loader.resolve_dtype("auto", str(tmp_path / "nope"), "cpu")
