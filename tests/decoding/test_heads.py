"""Draft heads: shapes, zero-init heads repeat l_0, save/load round trip, mismatches refused with clear messages."""

import json

import pytest
import torch

from specrun.decoding.drafters.heads import CONFIG_FILE, WEIGHTS_FILE, DraftHeads, load_heads, save_heads
from specrun.train.heads import hidden_states


def _randomize(heads: DraftHeads, seed: int = 0) -> DraftHeads:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.1)
    return heads


def _h0(lm, text="hello heads, hello heads"):
    ids = torch.tensor([lm.tokenizer.encode(text)])
    return ids, hidden_states(lm.model, ids)[0]  # [1, T], [T, H]


@pytest.mark.parametrize("branch_norm", [False, True])
def test_shapes(branch_norm):
    heads = DraftHeads(16, gamma=3, branch_norm=branch_norm)
    assert heads(torch.randn(5, 16)).shape == (3, 5, 16)
    assert heads(torch.randn(2, 5, 16)).shape == (3, 2, 5, 16)
    lm_head = torch.nn.Linear(16, 40, bias=False)
    assert heads.logits(torch.randn(5, 16), lm_head).shape == (3, 5, 40)
    assert DraftHeads(16, gamma=1)(torch.randn(4, 16)).shape == (1, 4, 16)
    with pytest.raises(ValueError, match="gamma"):
        DraftHeads(16, gamma=0)


def test_chained_residual_definition():
    heads = _randomize(DraftHeads(8, gamma=3).double())
    h = torch.randn(4, 8, dtype=torch.float64)
    hs = heads(h)
    prev = h
    for i, lin in enumerate(heads.linears):
        prev = lin(prev) + prev
        torch.testing.assert_close(hs[i], prev, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llama_mha", "qwen2", "llama_bigvocab"])
@pytest.mark.parametrize("branch_norm", [False, True])
def test_zero_init_heads_repeat_l0(load_fixture, name, branch_norm):
    lm = load_fixture(name)
    ids, h0 = _h0(lm)
    heads = DraftHeads(h0.shape[-1], gamma=3, branch_norm=branch_norm).to(torch.float64)
    logits = heads.logits(h0, lm.model.get_output_embeddings())
    l0 = lm.model(input_ids=ids).logits[0]  # [T, V]
    assert logits.shape == (3, ids.shape[1], lm.vocab_size)
    for i in range(3):
        torch.testing.assert_close(logits[i], l0, rtol=0, atol=1e-12)


def test_save_load_round_trip_identical_logits(load_fixture, tmp_path):
    lm = load_fixture("llama_gqa")
    _, h0 = _h0(lm)
    heads = _randomize(DraftHeads(h0.shape[-1], gamma=3, branch_norm=True).to(torch.float64), seed=3)
    save_heads(heads, tmp_path / "h", lm, metrics={"top1_accuracy": {"l0": 0.5}})
    meta = json.loads((tmp_path / "h" / CONFIG_FILE).read_text())
    assert meta["model_fingerprint"] == lm.fingerprint and meta["gamma"] == 3 and meta["branch_norm"] is True
    assert meta["hidden_size"] == h0.shape[-1] and meta["vocab_size"] == lm.vocab_size
    assert meta["metrics"]["top1_accuracy"]["l0"] == 0.5
    loaded = load_heads(tmp_path / "h", lm)
    assert loaded.gamma == 3 and loaded.branch_norm and not loaded.training
    assert all(p.dtype == lm.dtype and p.device == lm.device and not p.requires_grad for p in loaded.parameters())
    lm_head = lm.model.get_output_embeddings()
    torch.testing.assert_close(loaded.logits(h0, lm_head), heads.logits(h0, lm_head), rtol=0, atol=0)
    # a path to heads.json itself is accepted too
    assert load_heads(tmp_path / "h" / CONFIG_FILE, lm).gamma == 3


def test_heads_cast_to_model_dtype(load_fixture, tmp_path):
    lm64, lm32 = load_fixture("llama_mha"), load_fixture("llama_mha", dtype="float32")
    save_heads(_randomize(DraftHeads(64, gamma=2).double()), tmp_path, lm64)
    assert all(p.dtype == torch.float32 for p in load_heads(tmp_path, lm32).parameters())


def _edit(d, **changes):
    meta = json.loads((d / CONFIG_FILE).read_text())
    meta.update(changes)
    (d / CONFIG_FILE).write_text(json.dumps(meta))


def test_mismatches_refused_with_clear_messages(load_fixture, tmp_path):
    lm, other = load_fixture("llama_mha"), load_fixture("qwen3")  # same hidden size and vocab, different model
    d = save_heads(_randomize(DraftHeads(64, gamma=3).double()), tmp_path / "h", lm)
    with pytest.raises(ValueError, match=rf"model fingerprint mismatch, the model has '{other.fingerprint}' "
                                         rf"but the heads were trained for '{lm.fingerprint}'"):
        load_heads(d, other)
    _edit(d, hidden_size=32)
    with pytest.raises(ValueError, match="hidden size mismatch, the model has 64 but the heads were trained for 32"):
        load_heads(d, lm)
    _edit(d, hidden_size=64, vocab_size=300)
    with pytest.raises(ValueError, match=f"vocab size mismatch, the model has {lm.vocab_size} but the heads were "
                                         "trained for 300"):
        load_heads(d, lm)
    _edit(d, vocab_size=lm.vocab_size, gamma=2)
    with pytest.raises(ValueError, match="heads.safetensors does not match heads.json"):
        load_heads(d, lm)
    _edit(d, gamma=3, format_version=99)
    with pytest.raises(ValueError, match="unsupported format_version 99"):
        load_heads(d, lm)
    _edit(d, format_version=1)
    assert load_heads(d, lm).gamma == 3


def test_bigger_output_vocab_checked(load_fixture, tmp_path):
    big = load_fixture("llama_bigvocab")
    d = save_heads(DraftHeads(64, gamma=3), tmp_path / "big", big)
    assert json.loads((d / CONFIG_FILE).read_text())["vocab_size"] == big.vocab_size == 259 + 37


def test_missing_files_refused(load_fixture, tmp_path):
    lm = load_fixture("llama_mha")
    with pytest.raises(ValueError, match="does not exist"):
        load_heads(tmp_path / "nope", lm)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        load_heads(tmp_path / "f", lm)
    d = save_heads(DraftHeads(64, gamma=3), tmp_path / "h", lm)
    (d / WEIGHTS_FILE).unlink()
    with pytest.raises(ValueError, match="has no heads.safetensors"):
        load_heads(d, lm)
    (d / CONFIG_FILE).unlink()
    with pytest.raises(ValueError, match="has no heads.json"):
        load_heads(d, lm)
