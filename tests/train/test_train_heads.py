"""`train-heads` on a tiny frozen model: held-out loss drops, reload gives identical drafts, data errors, the CLI."""

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from specrun.cli import main
from specrun.decoding.drafters.heads import CONFIG_FILE, WEIGHTS_FILE, DraftHeads, load_heads, save_heads
from specrun.train import fit_heads, train_heads
from specrun.train.data import pack_sequences
from specrun.train.heads import hidden_states, loss_and_backward, lr_factor

WORDS = ["apple", "banana", "cherry", "dragon", "eagle", "falcon", "guitar", "harbor"]
FAST = dict(seq_len=64, warmup=5, batch_size=4)


def structured_text(n_lines: int, seed: int) -> str:
    """Deterministic pseudo-text: a small word set where each word is usually followed by a fixed partner."""
    rng = random.Random(seed)
    partner = {w: WORDS[(3 * i + 1) % len(WORDS)] for i, w in enumerate(WORDS)}
    w, lines = rng.choice(WORDS), []
    for _ in range(n_lines):
        sent = []
        for _ in range(6):
            sent.append(w)
            w = partner[w] if rng.random() < 0.8 else rng.choice(WORDS)
        lines.append(" ".join(sent) + ".")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("heads-data") / "train.txt"
    p.write_text(structured_text(250, seed=0))
    return p


@pytest.fixture(scope="module")
def lm32(load_fixture):
    return load_fixture("llama_gqa", dtype="float32")


@pytest.fixture(scope="module")
def trained(lm32, data_file):
    return fit_heads(lm32, [data_file], steps=40, seed=0, **FAST)


def test_heldout_loss_goes_down(trained):
    _, m = trained
    assert m["heldout_loss"] < 0.85 * m["heldout_loss_untrained"], m
    assert m["top1_accuracy"]["l0"] == m["top1_accuracy_untrained"]["l0"]  # the model's own head is untouched
    assert sum(m["top1_accuracy"][f"head{i}"] for i in (1, 2, 3)) > sum(
        m["top1_accuracy_untrained"][f"head{i}"] for i in (1, 2, 3))
    assert m["train_sequences"] >= 1 and m["heldout_sequences"] >= 1 and len(m["heldout_loss_per_head"]) == 3


def test_model_stays_frozen(lm32, data_file):
    before = {k: v.clone() for k, v in lm32.model.state_dict().items()}
    fit_heads(lm32, [data_file], steps=3, seed=1, **FAST)
    after = lm32.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(p.requires_grad for p in lm32.model.parameters())


def test_reloaded_heads_give_identical_drafts(trained, lm32, tmp_path):
    heads, m = trained
    save_heads(heads, tmp_path, lm32, m)
    loaded = load_heads(tmp_path, lm32)
    ids = torch.tensor([lm32.tokenizer.encode(structured_text(3, seed=9))])
    h0 = hidden_states(lm32.model, ids)[0]
    lm_head = lm32.model.get_output_embeddings()
    a, b = heads.logits(h0, lm_head), loaded.logits(h0, lm_head)  # [3, T, V]
    assert torch.equal(a.topk(3, dim=-1).indices, b.topk(3, dim=-1).indices)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["metrics"]["top1_accuracy"] == m["top1_accuracy"]


def test_deterministic_given_seed(lm32, data_file, tmp_path):
    metrics = [train_heads(lm32, [data_file], tmp_path / str(i), steps=4, seed=7, **FAST) for i in range(2)]
    assert (tmp_path / "0" / WEIGHTS_FILE).read_bytes() == (tmp_path / "1" / WEIGHTS_FILE).read_bytes()
    assert {k: v for k, v in metrics[0].items() if k != "seconds"} == {k: v for k, v in metrics[1].items()
                                                                       if k != "seconds"}


def test_loss_targets_chunking_and_grad_accum():
    torch.manual_seed(0)
    H, V, B, T = 8, 11, 2, 9
    lm_head = torch.nn.Linear(H, V, bias=False).double().requires_grad_(False)
    h0, ids = torch.randn(B, T, H, dtype=torch.float64), torch.randint(0, V, (B, T))
    heads = DraftHeads(H, gamma=3).double()
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    ref = sum(F.cross_entropy(lm_head(heads(h0)[i - 1][:, :T - i - 1]).flatten(0, 1), ids[:, i + 1:].flatten())
              for i in (1, 2, 3))  # head i at t predicts token t + i + 1
    ref.backward()
    ref_grads = [p.grad.clone() for p in heads.parameters()]
    for chunk, micro in ((10_000, 1), (3, 1), (10_000, 2)):
        heads.zero_grad()
        loss = sum(loss_and_backward(heads, h0[s::micro], ids[s::micro], lm_head, 1.0 / micro, chunk) / micro
                   for s in range(micro))
        assert loss == pytest.approx(float(ref.detach()), rel=1e-12)
        for p, g in zip(heads.parameters(), ref_grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)


def test_lr_schedule():
    f = [lr_factor(s, 200, 50) for s in range(200)]
    assert f[0] == pytest.approx(1 / 50) and f[49] == pytest.approx(1.0) and f[50] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[50:], f[51:])) and f[-1] < 1e-3


def test_data_formats_pack_the_same(lm32, tmp_path):
    docs = ["first doc", "second, longer document", "third"]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    pq.write_table(pa.table({"text": docs + [None]}), tmp_path / "d.parquet")
    eos = lm32.tokenizer.eos_token_id
    want = [t for d in docs for t in lm32.tokenizer.encode(d, add_special_tokens=False) + [eos]]
    for name in ("d.jsonl", "d.parquet"):
        seqs = pack_sequences(lm32.tokenizer, [tmp_path / name], 5, eos)
        assert seqs.shape == (len(want) // 5, 5)
        assert seqs.flatten().tolist() == want[: seqs.numel()]


@pytest.mark.parametrize("name, content, message", [
    ("missing.txt", None, "data file .*missing.txt' does not exist"),
    ("data.csv", "text\nhello", "unsupported extension '.csv'; expected one of .txt, .jsonl, .parquet"),
    ("empty.txt", "", "empty.txt' contains no text"),
    ("blank.jsonl", '{"text": ""}\n\n', "blank.jsonl' contains no text"),
    ("bad.jsonl", '{"text": "ok"}\nnot json\n', "bad.jsonl' line 2: not valid JSON"),
    ("notext.jsonl", '{"body": "x"}\n', "notext.jsonl' line 1: expected an object with a string 'text' field"),
    ("notext.parquet", "parquet", "notext.parquet' has no 'text' column \\(columns: body\\)"),
    ("short.txt", "only a few tokens", "the data has 18 tokens but --seq-len 64 needs at least 128"),
])
def test_bad_data_errors(lm32, tmp_path, name, content, message):
    path = tmp_path / name
    if content == "parquet":
        pq.write_table(pa.table({"body": ["x"]}), path)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        train_heads(lm32, [path], tmp_path / "out", steps=2, **FAST)
    assert not (tmp_path / "out" / CONFIG_FILE).exists()


def test_bad_settings_errors(lm32, data_file, tmp_path):
    with pytest.raises(ValueError, match="no data files"):
        fit_heads(lm32, [], **FAST)
    with pytest.raises(ValueError, match="--seq-len 5000 exceeds the model's context length 4096"):
        fit_heads(lm32, [data_file], seq_len=5000)
    with pytest.raises(ValueError, match="--steps 0 is invalid"):
        fit_heads(lm32, [data_file], steps=0, seq_len=64)
    with pytest.raises(ValueError, match="--seq-len 4 is invalid: expected an integer >= 5"):
        fit_heads(lm32, [data_file], seq_len=4)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--out .* exists and is not a directory"):
        train_heads(lm32, [data_file], tmp_path / "file", **FAST)


def test_cli_trains_saves_and_reports(tiny_models, data_file, tmp_path):
    out = tmp_path / "heads"
    res = CliRunner().invoke(main, ["train-heads", "--model", tiny_models["llama_gqa"], "--data", str(data_file),
                                    "--out", str(out), "--seq-len", "64", "--steps", "6", "--warmup", "2",
                                    "--batch-size", "2", "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert "step 6/6  loss" in res.output and "held-out top-1 accuracy" in res.output and "head3" in res.output
    meta = json.loads((out / CONFIG_FILE).read_text())
    assert meta["gamma"] == 3 and set(meta["metrics"]["top1_accuracy"]) == {"l0", "head1", "head2", "head3"}
    from specrun.models.loader import load_model

    assert load_heads(out, load_model(tiny_models["llama_gqa"])).gamma == 3
    res = CliRunner().invoke(main, ["train-heads", "--model", tiny_models["llama_gqa"], "--data",
                                    str(tmp_path / "nope.txt"), "--out", str(out)])
    assert res.exit_code == 1 and "nope.txt' does not exist" in res.output
    res = CliRunner().invoke(main, ["train-heads", "--help"])
    assert res.exit_code == 0 and "Examples:" in res.output and "--seq-len" in res.output
