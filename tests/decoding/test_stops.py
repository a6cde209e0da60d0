"""Stop strings and stop token ids: the incremental matcher against a brute-force "decode everything and search"
reference on three tokenizer kinds; the engine ends exactly where AR does, also inside an accepted run of drafted
tokens and across a resume; the returned text is cut before the stop; bounded per-token cost (I5); params checks."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest

from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify import stops as stops_mod
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.stops import MAX_HELD, StopMatcher, first_stop
from specrun.models.loader import decode_tokens, output_text

PROMPT = "abc abc abc abc abc"  # repetitive: n-gram and recycling drafts are accepted on the tiny models
POOL = "abc xyz.!é€😀日本ɒ "  # ASCII, 2-, 3- and 4-byte characters
CORPUS = ["the cat sat on the mat. héllo wörld € 100 naïve café 😀 日本語のテキスト ɒɒɒ " * 3,
          "stop here. STOP there! end of text; ½ ¾ ☃ snowman ünïcödé ∑∫ 𝔘𝔫𝔦"] * 20
DRAFT = EngineConfig(drafters=("ngram", "recycling"), adaptive_budget=False)
PLAIN = EngineConfig(drafters=())


# -- tokenizers ---------------------------------------------------------------------------------------------------
def _bpe_bytelevel():
    """GPT-2 style byte-level BPE with merges: tokens of several bytes, some holding part of a UTF-8 character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"],
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _sentencepiece_like():
    """Llama-2 style: "▁" for spaces, byte-fallback tokens <0xNN>, the first token's leading space stripped."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE())
    base.normalizer = norm
    ascii_corpus = [t.encode("ascii", "ignore").decode() for t in CORPUS]  # every other character: byte fallback
    base.train_from_iterator(ascii_corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    trained = json.loads(base.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for t in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = norm
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers(tiny_models):
    from transformers import AutoTokenizer

    sp = _sentencepiece_like()
    assert sp.decode(sp.encode("a €", add_special_tokens=False)) == "a €"  # byte fallback round-trips
    assert any(sp.convert_ids_to_tokens(i).startswith("<0x") for i in sp.encode("€", add_special_tokens=False))
    return {"bytes": AutoTokenizer.from_pretrained(tiny_models["llama_mha"]), "bpe": _bpe_bytelevel(), "sp": sp}


# -- brute force --------------------------------------------------------------------------------------------------
def _texts(tok, ids) -> list[str]:
    """Text after each prefix of ids, decoded whole, less an incomplete (U+FFFD) ending."""
    return [decode_tokens(tok, ids[:k]).rstrip("\ufffd") for k in range(len(ids) + 1)]


def _first_completion(texts: list[str], stops) -> int | None:
    """Index of the token after which the whole-decoded text first holds a stop string."""
    return next((k - 1 for k in range(1, len(texts)) if any(s in texts[k] for s in stops)), None)


def _random_case(rng: random.Random, tok, garbage: float):
    """A token sequence mixing encoded text (characters split over tokens) with random ids (undecodable bytes,
    specials, ids beyond the tokenizer), and 1-4 stop strings, mostly taken from its second half."""
    vocab = len(tok) + 3
    ids: list[int] = []
    n = rng.randint(20, 200)
    while len(ids) < n:
        if rng.random() > garbage:
            ids += tok.encode("".join(rng.choice(POOL) for _ in range(rng.randint(1, 6))), add_special_tokens=False)
        else:
            ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
    full = decode_tokens(tok, ids).rstrip("\ufffd")
    stops = []
    for _ in range(rng.randint(1, 4)):
        if full and rng.random() < 0.85:
            i = rng.randrange(len(full) // 2, len(full))
            s = full[i: i + rng.randint(1, 8)].replace("\ufffd", "")
        else:
            s = "".join(rng.choice(POOL) for _ in range(rng.randint(1, 4)))
        if s:
            stops.append(s)
    return ids, stops or ["never"]


@pytest.mark.parametrize("kind", ["bytes", "bpe", "sp"])
def test_matcher_equals_brute_force_on_random_sequences(tokenizers, kind):
    tok = tokenizers[kind]
    rng = random.Random(kind)
    hits = late = 0
    for trial in range(150):
        ids, stops = _random_case(rng, tok, garbage=(0.1, 0.5, 0.9)[trial % 3])
        expected = _first_completion(_texts(tok, ids), stops)
        m = StopMatcher(tok, stops)
        got = next((i for i, t in enumerate(ids) if m.feed(t)), None)
        assert got == expected, (kind, trial, stops, ids)
        hits += expected is not None
        late += expected is not None and expected >= 10
        # a resume: seeded with the tokens before a split, fed the rest; a split right after the completing token
        # is found by the seeding itself
        end = expected if expected is not None else len(ids) - 1
        for split in {rng.randint(0, end), end + 1}:
            m = StopMatcher(tok, stops)
            got = m.seed(ids[:split])
            if got is None:
                got = next((split + i for i, t in enumerate(ids[split:]) if m.feed(t)), None)
            assert got == expected, (kind, trial, split, stops, ids)
    assert hits > 100 and late > 50  # the comparison is not vacuous


def test_incomplete_characters_and_special_tokens(tokenizers):
    tok = tokenizers["bytes"]
    eos = tok.eos_token_id
    ids = [*"x €".encode(), eos, eos, *"😀y".encode()]  # 3- and 4-byte characters, one byte per token
    m = StopMatcher(tok, ["€😀"])
    assert [m.feed(t) for t in ids].index(True) == len(ids) - 2  # specials decode to nothing: € and 😀 are adjacent
    m = StopMatcher(tok, ["x"])
    assert m.feed(ord("x"))  # a one-character stop completes at its own token
    # a stop ending in a character completed by the same token that starts an incomplete one
    bpe = tokenizers["bpe"]
    for text, stop in (("ab€", "ab"), ("x😀😀", "x😀")):
        ids = bpe.encode(text, add_special_tokens=False)
        texts = _texts(bpe, ids)
        m = StopMatcher(bpe, [stop])
        assert next(i for i, t in enumerate(ids) if m.feed(t)) == _first_completion(texts, [stop])


def test_sentencepiece_leading_space_is_that_of_the_whole_text(tokenizers):
    sp = tokenizers["sp"]
    ids = sp.encode("the cat sat", add_special_tokens=False)
    assert decode_tokens(sp, ids).startswith("the")  # no leading space at the very start
    m = StopMatcher(sp, [" the"])
    assert not any(m.feed(t) for t in ids)
    m = StopMatcher(sp, [" sat"])
    assert [m.feed(t) for t in ids].index(True) == len(ids) - 1


def test_per_token_cost_is_bounded(tokenizers, monkeypatch):
    """I5: each token decodes a bounded window (never the output) and the tail searched stays short."""
    tok = tokenizers["bytes"]
    sizes: list[int] = []
    real = stops_mod.StopMatcher.__init__

    def counting_init(self, tokenizer, stops):
        real(self, tokenizer, stops)
        inner = self._decode
        self._decode = lambda ids: sizes.append(len(ids)) or inner(ids)

    monkeypatch.setattr(stops_mod.StopMatcher, "__init__", counting_init)
    rng = random.Random(1)
    ids = [rng.randrange(len(tok)) for _ in range(3000)] + [tok.eos_token_id] * 100 + list("ok".encode()) * 500
    m = StopMatcher(tok, ["never here", "zz"])
    assert not any(m.feed(t) for t in ids)
    assert len(sizes) <= 2 * len(ids) and max(sizes) <= 2 * MAX_HELD + 1
    assert len(m.tail) <= len("never here") - 1
    sizes.clear()
    m = StopMatcher(tok, ["never here"])
    m.seed(ids * 10)  # a resume replays a bounded tail, not the whole output
    assert len(sizes) <= 2 * (4 * len("never here") + 2 * MAX_HELD)


# -- text and params ----------------------------------------------------------------------------------------------
def test_output_text_cuts_before_the_stop(tokenizers):
    tok = tokenizers["bytes"]
    ids = list("one two. three".encode())
    p = SamplingParams(stop=["three", "o. t"], stop_token_ids=[ord("!")])
    assert first_stop("one two. three", p.stop) == 6
    assert output_text(tok, ids, "stop", p) == "one tw"  # the earliest of the stops present
    assert output_text(tok, ids, "length", p) == "one two. three"  # only a stop finish is cut
    assert output_text(tok, [*b"hi", ord("!")], "stop", p) == "hi"  # a stop token is not part of the text
    assert output_text(tok, [], "stop", p) == ""


def test_params_normalise_validate_and_round_trip_json():
    p = SamplingParams(stop="\n\n", stop_token_ids=[5, 7])
    assert p.stop == ("\n\n",) and p.stop_token_ids == (5, 7)
    again = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p))))
    assert again == p and hash(again) == hash(p)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b") and SamplingParams().stop == ()
    for kw, needle in [(dict(stop=""), "stop is empty"), (dict(stop=["a", ""]), "stop[1] is empty"),
                       (dict(stop=["a"] * 5), "at most 4"), (dict(stop=[1]), "stop must be a string"),
                       (dict(stop=5), "stop must be a string or a list"), (dict(stop="a\ufffd"), "U+FFFD"),
                       (dict(stop="x" * 1001), "at most 1000"), (dict(stop_token_ids=[-1]), "holds -1"),
                       (dict(stop_token_ids=[True]), "holds True"), (dict(stop_token_ids=3), "list of integers")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            SamplingParams(**kw)


# -- the engine ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm(load_fixture):
    return load_fixture("qwen2")


def _generate(lm, config, params, resume_from=()):
    steps: list[list[int]] = []
    res = Engine(lm, config).generate(lm.tokenizer.encode(PROMPT), params, resume_from=resume_from,
                                      on_step=lambda e: steps.append(list(e)) and False)
    return res, steps


def _inside_steps(steps: list[list[int]]) -> set[int]:
    """Output indices emitted by a step that emitted more tokens after them (accepted drafts follow)."""
    inside, i = set(), 0
    for s in steps:
        inside.update(range(i, i + len(s) - 1))
        i += len(s)
    return inside


@pytest.fixture(scope="module")
def reference(lm):
    """AR output with no stop, the drafted run's steps, and stop strings that first complete inside an accepted run
    of several drafted tokens, each spanning at least three tokens."""
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    ar, _ = _generate(lm, PLAIN, params)
    drafted, steps = _generate(lm, DRAFT, params)
    assert drafted.token_ids == ar.token_ids and drafted.stats["mean_accepted"] > 2
    out = ar.token_ids
    texts = _texts(lm.tokenizer, out)
    cands = []
    for k in sorted(_inside_steps(steps)):
        end = len(texts[k + 1])
        for n in range(3, 9):
            s = texts[k + 1][-n:]
            start_token = next(j for j in range(k + 1) if len(texts[j + 1]) > end - n)
            if (k >= 10 and len(s) == n and "\ufffd" not in s and k - start_token >= 2
                    and _first_completion(texts, [s]) == k):
                cands.append((k, s))
                break
    assert len(cands) >= 2, cands
    return out, steps, [cands[0], cands[len(cands) // 2], cands[-1]]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_stop_string_inside_an_accepted_run_ends_where_ar_does(lm, reference, which):
    out, steps, cands = reference
    k, stop = cands[which]
    params = SamplingParams(max_tokens=120, ignore_eos=True, stop=[stop, "no such text"])
    cut = output_text(lm.tokenizer, out[: k + 1], "stop", params)
    assert cut == decode_tokens(lm.tokenizer, out[: k + 1])[:-len(stop)]
    for config in (DRAFT, PLAIN):
        res, got_steps = _generate(lm, config, params)
        assert res.token_ids == out[: k + 1], (config.drafters, stop)
        assert res.finish_reason == "stop"
        assert output_text(lm.tokenizer, res.token_ids, res.finish_reason, params) == cut
        if config is DRAFT:
            drafted_steps = got_steps
    # drafted: the last step was cut short of the run the verifier accepted without the stop
    got_steps = drafted_steps
    first = sum(len(s) for s in got_steps[:-1])
    assert got_steps[:-1] == steps[: len(got_steps) - 1] and len(steps[len(got_steps) - 1]) > k + 1 - first


def test_stop_token_id_inside_an_accepted_run_ends_where_ar_does(lm, reference):
    out, steps, _ = reference
    k = next(k for k in sorted(_inside_steps(steps)) if k >= 10 and out[k] not in out[:k])
    unused = next(t for t in range(256) if t not in out)
    params = SamplingParams(max_tokens=120, ignore_eos=True, stop_token_ids=[unused, out[k]])
    for config in (DRAFT, PLAIN):
        res, _ = _generate(lm, config, params)
        assert res.token_ids == out[: k + 1] and res.finish_reason == "stop", config.drafters
        assert output_text(lm.tokenizer, res.token_ids, "stop", params) == decode_tokens(lm.tokenizer, out[:k])
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        Engine(lm, PLAIN).generate([1, 2], SamplingParams(stop_token_ids=[10**6]))


def test_resume_at_every_point_around_the_stop_ends_identically(lm, reference):
    """A checkpoint before the stop string, inside it, or right after the token that completed it (resumed runs
    re-seed the matcher from the resumed tail)."""
    out, _, cands = reference
    k, stop = cands[1]
    params = SamplingParams(max_tokens=120, ignore_eos=True, stop=stop)
    span = len(stop.encode())  # byte-level: one token per byte
    for split in range(max(0, k - span - 3), k + 2):
        res, steps = _generate(lm, DRAFT, params, resume_from=out[:split])
        assert res.token_ids == out[: k + 1] and res.finish_reason == "stop", split
        assert (steps == []) == (split == k + 1)  # resumed after the completing token: nothing generated
    # resumed tokens that run past a stop (a stop added to a job that had already run) end at the stop
    res, _ = _generate(lm, DRAFT, params, resume_from=out[: k + 6])
    assert res.token_ids == out[: k + 1] and res.finish_reason == "stop"


def test_sampled_with_a_stop_is_lossless(lm):
    params = SamplingParams(max_tokens=80, temperature=0.9, seed=5, ignore_eos=True)
    ar, _ = _generate(lm, PLAIN, params)
    texts = _texts(lm.tokenizer, ar.token_ids)
    k, stop = next((k, texts[k + 1][-3:]) for k in range(40, 80)
                   if "\ufffd" not in texts[k + 1][-3:] and _first_completion(texts, [texts[k + 1][-3:]]) == k)
    stopped = dataclasses.replace(params, stop=[stop])
    for config in (DRAFT, PLAIN):
        res, _ = _generate(lm, config, stopped)
        assert res.token_ids == ar.token_ids[: k + 1] and res.finish_reason == "stop"


def test_a_stop_on_the_last_allowed_token_is_a_stop_and_one_beyond_is_length(lm, reference):
    out, _, cands = reference
    fresh = [(k, s) for k, s in cands if out[k] not in out[:k]]  # the stop token must not occur before k
    assert fresh, (out, cands)
    k, stop = fresh[0]
    params = SamplingParams(max_tokens=k + 1, ignore_eos=True, stop_token_ids=[out[k]], stop=stop)
    res, _ = _generate(lm, PLAIN, params)
    assert res.token_ids == out[: k + 1] and res.finish_reason == "stop"  # a stop on the last allowed token
    res, _ = _generate(lm, PLAIN, dataclasses.replace(params, max_tokens=k))
    assert res.token_ids == out[:k] and res.finish_reason == "length"
