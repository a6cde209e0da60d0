"""Recurrent drafter: noise-coupled drafting picks AR's token, trained drafts are accepted, output stays AR's (I1)."""

import json

import pytest
import torch

from specrun.decoding.drafters.quant_draft import quantized
from specrun.decoding.drafters.recurrent import DraftWeights, RecurrentDraft, _processed, draft_tree
from specrun.decoding.drafters.recurrent_files import builtin_drafter, load_drafter, model_signature, save_drafter
from specrun.decoding.engine import BatchConfig, Engine, EngineConfig
from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.sequence import Sequence
from specrun.decoding.verify.trie import build_trie
from specrun.train.heads import hidden_states
from specrun.train.recurrent import fit_recurrent

SAMPLED = SamplingParams(max_tokens=300, temperature=0.8, min_p=0.05, penalty=1.3, penalty_window=64, seed=11,
                         ignore_eos=True)


@pytest.fixture(scope="module")
def lm(load_fixture):
    return load_fixture("llama_gqa", dtype="float32")


@pytest.fixture(scope="module")
def trained(lm, tmp_path_factory):
    """A drafter trained on the tiny model's own sampled text, saved and loaded back."""
    prompt = lm.tokenizer.encode("the cat sat on the mat")
    ar = Engine(lm, EngineConfig(drafters=()))
    docs = [lm.tokenizer.decode(ar.generate(prompt, SamplingParams(max_tokens=400, temperature=0.8, seed=s,
                                                                    ignore_eos=True)).token_ids) for s in range(6)]
    data = tmp_path_factory.mktemp("drafter-data") / "text.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    drafter, metrics = fit_recurrent(lm, [data], seq_len=128, steps=150, batch_size=4, lr=3e-3, warmup=10,
                                     depth=3, ffn_size=64, n_vocab=200, heldout_fraction=0.2)
    out = save_drafter(drafter, tmp_path_factory.mktemp("drafter"), lm, metrics)
    return str(out), metrics


def test_training_lowers_the_heldout_loss(trained):
    _, m = trained
    assert m["heldout_loss"] < m["heldout_loss_untrained"], m
    assert 0 < m["vocab_coverage_heldout"] <= 1


def test_coupled_scores_pick_the_token_ar_samples(lm):
    """Given the target's own hidden state, the drafter's scoring (processing + the position's Gumbel row) picks
    exactly AR's sampled token: drafting shares AR's noise."""
    prompt = lm.tokenizer.encode("a b c d e f")
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, penalty=1.4, penalty_window=8, seed=5,
                            ignore_eos=True)
    eng = Engine(lm, EngineConfig(drafters=()))
    out = eng.generate(prompt, params).token_ids
    every = torch.arange(eng.vocab_size)
    w = DraftWeights(RecurrentDraft(8, 8, every), lm.model.get_input_embeddings(), lm.model.get_output_embeddings())
    for k in (0, 7, 23):  # the state after prompt + out[:k]: choose out[k]
        st = Sequence(prompt, params, out[:k], vocab_size=eng.vocab_size, eos_ids=lm.eos_ids, tokenizer=lm.tokenizer,
                      max_context=lm.max_context, spare=1, device=lm.device)
        eng.runner.runner.reset(st.capacity)  # the engine's ModelRunner
        eng.runner.runner.prefill(st.seq[: st.n - 1], 256)
        trie = build_trie(st.root, [], 1, lm.device)
        h = eng.runner.runner.forward(trie.tokens, trie.depths + st.n - 1, trie.ancestors)  # [1, H]
        ctx = st.draft_context(2, with_present=True)
        scores = _processed(w, w.logits(h), params, ctx.present[w.vocab_ids], ctx.position + 1)
        assert int(scores.argmax()) == out[k] == int(st.choose(trie, eng.runner.logits(h))[0][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_drafting_step_is_the_trained_module(lm, trained, dtype):
    """DraftWeights.step (prepacked matrices) computes the drafter module's g."""
    drafter = load_drafter(trained[0], lm).to(dtype)
    w = DraftWeights(drafter, lm.model.get_input_embeddings(), lm.model.get_output_embeddings())
    g = torch.Generator().manual_seed(1)
    for R in (1, 4):
        s, e = (torch.randn(R, drafter.hidden_size, generator=g).to(dtype) for _ in range(2))
        with torch.inference_mode():
            want, got = drafter(s, e), w.step(s, e)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert not torch.equal(want, s)  # trained: g moved the state, so the check is not vacuous


def test_draft_tree_is_best_first_and_within_budget(lm, trained):
    w = DraftWeights(load_drafter(trained[0], lm), lm.model.get_input_embeddings(), lm.model.get_output_embeddings())
    h = torch.randn(lm.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    full = draft_tree(w, h, 5, 7, SAMPLED, None, (3, 2, 1), 100)
    assert len(full[0]) <= 1 + 3 + 6 + 6 and full[1][0] == -1
    assert all(0 <= p < i for i, p in enumerate(full[1]) if i)  # parents come first
    for n in (1, 3, 10):  # a narrower draft is the wider one's first nodes (shadow tries rely on it)
        tokens, parents = draft_tree(w, h, 5, 7, SAMPLED, None, (3, 2, 1), n)
        assert len(tokens) == min(n, len(full[0]) - 1) + 1
        assert (tokens, parents) == (full[0][: len(tokens)], full[1][: len(tokens)])


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=9, temperature=1.0, min_p=0.9, penalty=1.3, seed=4),
                                    SamplingParams(max_tokens=9, temperature=1.2, seed=4)], ids=["min-p", "untruncated"])
def test_noise_on_kept_tokens_only_drafts_the_same_tree(lm, trained, params, monkeypatch):
    """Drafting computes the Gumbel noise only where truncation kept tokens (few pairs) and a whole row otherwise:
    the tree is the one a whole row gives, node for node (torch's path: our kernel takes min-p levels where it loads)."""
    import specrun.decoding.drafters.recurrent as recurrent

    monkeypatch.setattr(recurrent, "kernel_sampling", lambda p, z: False)

    w = DraftWeights(load_drafter(trained[0], lm), lm.model.get_input_embeddings(), lm.model.get_output_embeddings())
    h = torch.randn(lm.model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    present = torch.zeros(lm.vocab_size, dtype=torch.bool)
    present[::7] = True
    calls = []

    def row(w_, seed, position):
        calls.append(position)
        return recurrent.noise_row(w_, seed, position)

    got = draft_tree(w, h, 5, 40, params, present, (3, 2, 1), 12, row)
    sparse_calls = len(calls)
    monkeypatch.setattr(recurrent, "FEW_PAIRS", -1)  # every level takes the whole row
    want = draft_tree(w, h, 5, 40, params, present, (3, 2, 1), 12, row)
    assert got == want and len(got[0]) > 4
    assert (sparse_calls == 0) == (params.min_p > 0)  # min-p leaves few tokens: no whole row was computed


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=9, temperature=1.0, min_p=0.1, penalty=1.3, seed=4),
    SamplingParams(max_tokens=9, temperature=0.7, min_p=0.02, seed=2**40 + 9),
    SamplingParams(max_tokens=9, temperature=1.0, min_p=0.5, penalty=0.8, seed=1)])
def test_the_kernel_drafts_the_torch_paths_tree(lm, trained, params, monkeypatch):
    """A drafter level in one call of our CPU kernel (processing, min-p, the kept tokens' noise, top-k, logsumexp)
    drafts the tree torch's ops draft, node for node, with the same path probabilities."""
    import specrun.decoding.drafters.recurrent as recurrent
    from specrun.decoding.kernels.cpu_kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("our CPU kernels do not load here")
    w = DraftWeights(load_drafter(trained[0], lm), lm.model.get_input_embeddings(), lm.model.get_output_embeddings())
    present = torch.zeros(lm.vocab_size, dtype=torch.bool)
    present[::5] = True
    calls = []
    real = recurrent._top_children
    monkeypatch.setattr(recurrent, "_top_children", lambda *a: calls.append(1) or real(*a))
    for seed in range(4):
        h = torch.randn(lm.model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
        got = draft_tree(w, h, 5, 40 + seed, params, present, (4, 3, 2), 30)
        assert not calls  # every level went through the kernel
        with monkeypatch.context() as m:
            m.setattr(recurrent, "kernel_sampling", lambda p, z: False)
            want = draft_tree(w, h, 5, 40 + seed, params, present, (4, 3, 2), 30)
        calls.clear()
        assert got == want and len(got[0]) > 3
        s = w.step(h[None], w.embed(torch.tensor([5])))
        val, idx, prob = recurrent._children(w, s, params, present[w.vocab_ids], 41, 6)
        m_val, m_idx, m_prob = real(_processed(w, w.logits(s), params, present[w.vocab_ids], 41), 6)
        kept = m_val > float("-inf")
        assert torch.equal(val, m_val) and torch.equal(idx[kept], m_idx[kept])
        torch.testing.assert_close(prob, m_prob, rtol=1e-5, atol=1e-7)


def test_a_drafter_that_knows_the_model_drafts_ars_own_tokens(load_fixture):
    """A stand-in drafter that returns the model's true hidden state at every level: its noise-coupled chain is
    exactly the tokens AR sampled, at every depth (the noise at depth d is AR's at position root + d)."""
    lm = load_fixture("llama_gqa", dtype="float64")
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    prompt = lm.tokenizer.encode("a b c d e f")
    out = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    seq = prompt + out
    H = hidden_states(lm.model, torch.tensor([seq]))[0]  # [L, H]: H[i] chooses seq[i + 1]

    class Oracle:  # stands in for DraftWeights.step
        def __init__(self, at: int):
            self.at = at

        def __call__(self, s, e):
            self.at += 1
            return H[self.at][None].expand(s.shape[0], -1)

    w = DraftWeights(RecurrentDraft(8, 8, torch.arange(lm.vocab_size)), lm.model.get_input_embeddings(),
                     lm.model.get_output_embeddings())
    for root_pos in (len(prompt) - 1, len(prompt) + 9, len(prompt) + 30):
        w.step = Oracle(root_pos - 1)
        tokens, _ = draft_tree(w, H[root_pos - 1], seq[root_pos], root_pos, params, None, (1, 1, 1, 1), 4)
        assert tokens == seq[root_pos : root_pos + 5]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=300, ignore_eos=True), SAMPLED], ids=["greedy", "sampled"])
def test_recurrent_drafting_is_lossless_and_accepted(lm, trained, params):
    prompt = lm.tokenizer.encode("the cat sat on the mat")
    ar = Engine(lm, EngineConfig(drafters=())).generate(prompt, params)
    res = Engine(lm, EngineConfig(drafters=("recurrent",), drafter_path=trained[0], adaptive_budget=False,
                                  trie_budget=16)).generate(prompt, params)
    assert res.token_ids == ar.token_ids
    assert res.stats["tokens_by_drafter"].get("recurrent", 0) > 30, res.stats
    batch = Engine(lm, EngineConfig(drafters=("recurrent", "ngram"), drafter_path=trained[0]),
                   BatchConfig(concurrency=2, kv_tokens=2000, page_size=1))
    other = SamplingParams(max_tokens=200, temperature=1.0, seed=3, ignore_eos=True)
    got = batch.run([(0, prompt, params, []), (1, prompt[:3], other, [])])
    assert got[0].token_ids == ar.token_ids
    assert got[1].token_ids == Engine(lm, EngineConfig(drafters=())).generate(prompt[:3], other).token_ids


def test_drafter_files_refuse_another_model(lm, trained, load_fixture):
    other = load_fixture("qwen2", dtype="float32")
    assert model_signature(other) != model_signature(lm)
    with pytest.raises(ValueError, match="another model"):
        load_drafter(trained[0], other)
    with pytest.raises(ValueError, match="needs a trained recurrent drafter"):
        Engine(other, EngineConfig(drafters=("recurrent",)))
    assert builtin_drafter(lm) is None  # nothing ships for a tiny random model: auto drafts without it
    quant = ["quant"] if quantized(FusedDecoder.of(lm.model)) is not None else []  # the 4-bit copy where it runs
    assert list(Engine(lm, EngineConfig()).names) == [*quant, "ngram", "recycling"]
