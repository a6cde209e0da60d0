"""Behaviour tests for the n-gram pool (TokenSwift token reutilization)."""

from __future__ import annotations

import random

import pytest

from specrun.decoding.drafters.ngram import NGramPool, SuffixCopy
from specrun.decoding.drafters.protocol import NGramDrafter
from specrun.decoding.verify.trie import DraftContext

A, B = (1, 2, 3), (4, 5, 6)


def _feed(pool: NGramPool, first: int, conts: list[tuple[int, ...]]) -> None:
    for c in conts:
        pool.extend([first, *c])


def test_distinct_continuations_abbaa() -> None:
    # After A, B, B, A, A the reference table returns A twice and loses B; ours keeps both.
    pool = NGramPool(n=4, topk=20)
    _feed(pool, 9, [A, B, B, A, A])
    assert pool.query(9)[:2] == [A, B]
    assert len(set(pool.query(9))) == len(pool.query(9))


def test_recency_breaks_ties() -> None:
    pool = NGramPool(n=4, topk=20)
    pool.extend([9, *A])
    pool.extend([9, *B])
    assert pool.query(9)[:2] == [B, A]  # same count, B seen last
    pool.extend([9, *A])
    assert pool.query(9)[0] == A  # A now counts 2
    pool.extend([9, *B])
    assert pool.query(9)[:2] == [B, A]  # 2 each, B more recent


def test_continuations_across_extend_boundaries() -> None:
    one = NGramPool(n=4, topk=20)
    seq = [7, 8, 9, 10, 7, 8, 9, 11, 7, 8]
    one.extend(seq)
    split = NGramPool(n=4, topk=20)
    for tok in seq:
        split.extend([tok])
    assert split.query(7) == one.query(7) == [(8, 9, 11), (8, 9, 10)]
    assert split.query(8) == one.query(8)
    chunked = NGramPool(n=4, topk=20)
    chunked.extend(seq[:2])
    chunked.extend([])
    chunked.extend(seq[2:5])
    chunked.extend(seq[5:])
    assert chunked.query(7) == one.query(7)


def test_topk_cut_and_query_k() -> None:
    pool = NGramPool(n=4, topk=3)
    conts = [(i, i, i) for i in range(10, 16)]
    _feed(pool, 0, conts)
    assert pool.query(0) == [(15, 15, 15), (14, 14, 14), (13, 13, 13)]
    _feed(pool, 0, [(10, 10, 10)])  # count 2: enters from outside, ranks first
    assert pool.query(0) == [(10, 10, 10), (15, 15, 15), (14, 14, 14)]
    assert pool.query(0, k=1) == [(10, 10, 10)]
    assert pool.query(0, k=0) == []
    assert pool.query(12345) == []


def test_reset_and_validation() -> None:
    pool = NGramPool(n=4, topk=2)
    pool.extend([1, 2, 3])
    pool.reset()
    pool.extend([4, 5])  # no n-gram spans the reset
    assert pool.query(1) == [] and pool.query(2) == []
    with pytest.raises(ValueError, match="1"):
        NGramPool(n=1)
    with pytest.raises(ValueError, match="0"):
        NGramPool(topk=0)
    with pytest.raises(ValueError, match="-1"):
        pool.query(4, k=-1)


def _brute_force(seq: list[int], n: int, first: int, k: int) -> list[tuple[int, ...]]:
    stats: dict[tuple[int, ...], tuple[int, int]] = {}
    for i in range(len(seq) - n + 1):
        if seq[i] == first:
            cont = tuple(seq[i + 1 : i + n])
            stats[cont] = (stats.get(cont, (0, -1))[0] + 1, i)
    return sorted(stats, key=lambda c: stats[c], reverse=True)[:k]


@pytest.mark.parametrize("n,topk,vocab", [(4, 20, 3), (4, 3, 4), (3, 2, 3), (2, 1, 5), (4, 5, 2)])
def test_matches_brute_force(n: int, topk: int, vocab: int) -> None:
    rng = random.Random(n * 100 + topk * 10 + vocab)
    for _ in range(40):
        pool = NGramPool(n=n, topk=topk)
        seq: list[int] = []
        while len(seq) < 300:
            chunk = [rng.randrange(vocab) for _ in range(rng.randrange(0, 7))]
            pool.extend(chunk)
            seq.extend(chunk)
            for first in range(vocab):
                assert pool.query(first) == _brute_force(seq, n, first, topk), (seq, first)
        for first in range(vocab):
            k = rng.randrange(0, topk + 2)
            assert pool.query(first, k=k) == _brute_force(seq, n, first, min(k, topk))


def _copy_brute_force(seq: list[int], key: int, limit: int) -> list[int]:
    """Rescan: the latest earlier occurrence of the last `key` tokens, and what followed it, read on past the end as
    the repetition it would be."""
    n = len(seq)
    for start in range(n - 1, key - 1, -1):  # start: index of the token after an occurrence ending before n - 1
        if start < n and seq[start - key : start] == seq[n - key :]:
            out = []
            for j in range(limit):
                out.append(seq[start + j] if start + j < n else out[j - (n - start)])
            return out
    return []


def test_copy_follows_the_previous_occurrence_and_repeats_a_loop() -> None:
    copy = SuffixCopy(key=3)
    copy.extend([1, 2, 3, 4, 5, 1, 2, 3])
    assert copy.follow(8) == [4, 5, 1, 2, 3, 4, 5, 1]  # a 5-token loop read on past the end
    assert copy.follow(2) == [4, 5] and copy.follow(0) == []
    copy.extend([9])
    assert copy.follow(4) == []  # (2, 3, 9) never occurred before
    copy.reset()
    copy.extend([7, 7, 7])
    assert copy.follow(3) == []  # the sequence's own last context is not an earlier occurrence
    copy.extend([7])
    assert copy.follow(3) == [7, 7, 7]
    with pytest.raises(ValueError, match="key length"):
        SuffixCopy(key=0)


@pytest.mark.parametrize("key,vocab", [(3, 3), (2, 4), (1, 5), (3, 2)])
def test_copy_matches_a_rescan_whatever_the_chunks(key: int, vocab: int) -> None:
    rng = random.Random(key * 10 + vocab)
    for _ in range(20):
        copy, seq = SuffixCopy(key=key), []
        while len(seq) < 200:
            chunk = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
            copy.extend(chunk)
            seq.extend(chunk)
            limit = rng.randrange(0, 12)
            assert copy.follow(limit) == _copy_brute_force(seq, key, limit), (seq, limit)


def test_ngram_drafter_leads_with_the_copy_as_long_as_the_budget() -> None:
    d = NGramDrafter(topk=5)
    d.start([5, 6, 7, 8, 9, 5, 6])
    d.commit([7])  # the committed sequence ends 5 6 7: last seen before 8 9 5 6 7 ...
    drafts = d.propose(DraftContext(root=7, position=7, budget=6), source=0)
    assert drafts[0].tokens == [7, 8, 9, 5, 6, 7] and drafts[0].parents == [-1, 0, 1, 2, 3, 4]
    assert [dr.tokens for dr in drafts[1:]] == [[7, 8, 9, 5]]  # then the 4-gram continuations of the root
    assert len(d.propose(DraftContext(root=7, position=7, budget=1 << 30), source=0)[0].tokens) == 64  # COPY_NODES
    assert NGramDrafter(topk=0).propose(DraftContext(root=7, position=7, budget=6), source=0) == []
