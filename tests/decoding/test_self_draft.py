"""Heads drafting: tree template; self-drafting lossless in every KV mode; fused drafting on the verify hidden state."""

import pytest
import torch

from specrun.decoding.drafters.heads import DraftHeads
from specrun.decoding.drafters.quant_draft import quantized
from specrun.decoding.drafters.self_draft import FusedDrafter, TreeTemplate
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.trie import DraftContext

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


def test_tree_template_is_cartesian_per_level():
    t = TreeTemplate((1, 3, 3, 3))
    assert len(t.parents) == 1 + 1 + 3 + 9 + 27
    logits = torch.zeros(4, 50)
    for row in range(4):
        logits[row, [10 * row + 1, 10 * row + 2, 10 * row + 3]] = torch.tensor([3.0, 2.0, 1.0])
    tokens = t.fill(99, logits)
    assert tokens[:5] == [99, 1, 11, 12, 13]
    assert tokens[5:8] == [21, 22, 23] and tokens[-1] == 33
    assert t.parents[:5] == [-1, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="tree"):
        TreeTemplate((1, 0))


def heads_for(lm, trained: bool):
    heads = DraftHeads(lm.model.config.hidden_size, 3).to(lm.dtype)
    if trained:  # weights that make the heads disagree with l_0 (a stand-in for training; real training: test_train_heads)
        g = torch.Generator().manual_seed(0)
        for lin in heads.linears:
            lin.weight.data = torch.randn(lin.weight.shape, generator=g, dtype=lm.dtype) * 0.3
    return heads


def hf_greedy(lm, prompt, n):
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


SAMPLED = SamplingParams(max_tokens=200, temperature=0.9, min_p=0.05, penalty=1.2, penalty_window=40, seed=2,
                         ignore_eos=True)


def references(load_fixture, trained: bool):
    """-> lm, prompt, heads, HF greedy 300 tokens, SAMPLED, our AR's SAMPLED tokens"""
    lm = load_fixture("qwen2")
    prompt = lm.tokenizer.encode(PROMPT)
    sampled_ref = Engine(lm, EngineConfig(drafters=())).generate(prompt, SAMPLED).token_ids
    return lm, prompt, heads_for(lm, trained), hf_greedy(lm, prompt, 300), SAMPLED, sampled_ref


@pytest.mark.parametrize("trained", [False, True])
def test_lossless_in_every_kv_mode(load_fixture, trained):
    lm, prompt, heads, greedy_ref, sampled, sampled_ref = references(load_fixture, trained)
    for mode in ("full", "partial", "dynamic"):
        for drafters in (("heads",), ("heads", "ngram", "recycling")):  # alone, and led by nothing else
            # a budget below the prompt length puts the partial cache to work from the first step
            cfg = EngineConfig(drafters=drafters, kv_mode=mode, kv_budget=24, kv_sinks=4, adaptive_budget=False)
            res = Engine(lm, cfg, heads=heads).generate(prompt, SamplingParams(max_tokens=300, ignore_eos=True))
            assert res.token_ids == greedy_ref, (mode, drafters)
            assert res.stats["tokens_by_drafter"]["heads"] > 0
            if mode == "dynamic":
                assert res.stats["kv_rebuilds"] > 1
            assert Engine(lm, cfg, heads=heads).generate(prompt, sampled).token_ids == sampled_ref, (mode, drafters)


def test_full_cache_draft_predicts_the_next_greedy_token(load_fixture):
    """With the full cache, l_0 of the draft forward is the model's own next-token distribution: its top-1 is
    always accepted under greedy decoding, so untrained heads give at least 2 tokens per step."""
    lm = load_fixture("llama_mha")
    prompt = lm.tokenizer.encode("a b c d e f")
    engine = Engine(lm, EngineConfig(drafters=("heads",), kv_mode="full", adaptive_budget=False), heads=heads_for(lm, False))
    per_step = []
    engine.generate(prompt, SamplingParams(max_tokens=101, ignore_eos=True), on_step=lambda t: per_step.append(len(t)))
    assert min(per_step[:-1]) >= 2  # the last step may be cut by max_tokens


def test_heads_drafter_needs_heads(load_fixture):
    lm = load_fixture("llama_mha")
    for name in ("heads", "fused"):
        with pytest.raises(ValueError, match=name):
            Engine(lm, EngineConfig(drafters=(name,)))
    quant = ["quant"] if quantized(FusedDecoder.of(lm.model)) is not None else []  # the 4-bit copy where it runs
    assert list(Engine(lm, EngineConfig()).names) == [*quant, "ngram", "recycling"]


@pytest.mark.parametrize("trained", [False, True])
def test_fused_drafting_is_lossless(load_fixture, trained):
    lm, prompt, heads, greedy_ref, sampled, sampled_ref = references(load_fixture, trained)
    for drafters in (("fused",), ("fused", "ngram", "recycling")):
        cfg = EngineConfig(drafters=drafters, adaptive_budget=False)
        res = Engine(lm, cfg, heads=heads).generate(prompt, SamplingParams(max_tokens=300, ignore_eos=True))
        assert res.token_ids == greedy_ref, drafters
        if not trained:  # zero heads guess l_0 of the node before the root: right on this repetitive text
            assert res.stats["tokens_by_drafter"]["fused"] > 0
        assert Engine(lm, cfg, heads=heads).generate(prompt, sampled).token_ids == sampled_ref, drafters


def test_fused_draft_reads_the_hidden_state_of_the_token_before_the_root(load_fixture):
    """After any step, the fused proposal is the heads' top-k on the model's hidden state at the second-to-last
    committed token, which is what a plain forward over the whole sequence gives there."""
    lm = load_fixture("qwen2")
    heads = heads_for(lm, True)
    prompt = lm.tokenizer.encode(PROMPT)
    engine = Engine(lm, EngineConfig(drafters=("fused", "ngram"), adaptive_budget=False), heads=heads)
    steps = []
    # stop right after a step that accepted a draft, so the node before the root is not the trie's root
    res = engine.generate(prompt, SamplingParams(max_tokens=300, ignore_eos=True),
                          on_step=lambda t: steps.append(len(t)) or (len(t) > 1 and len(steps) > 2))
    assert res.finish_reason == "stopped" and steps[-1] > 1
    seq = prompt + res.token_ids
    with torch.inference_mode():
        h = lm.model.get_decoder()(input_ids=torch.tensor([seq])).last_hidden_state[0, -2]
        want = torch.topk(heads.logits(h[None], lm.model.get_output_embeddings())[:, 0], 3, dim=-1).indices
    fused = next(d for d in engine.drafters if isinstance(d, FusedDrafter))
    ctx = DraftContext(seq[-1], len(seq) - 1)
    (draft,) = fused.propose(ctx, 0)
    assert draft.tokens[:4] == [seq[-1], *want[0].tolist()]  # level 1: top-3 of l_1
    assert draft.tokens[4:7] == want[1, :3].tolist()  # first children: top-3 of l_2
    assert ctx.guess is None  # n-grams stay keyed by the root
    with pytest.raises(ValueError, match="two or more levels"):
        FusedDrafter(heads, lm.model.get_output_embeddings(), (3,))
