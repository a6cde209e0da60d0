"""Behaviour tests for the n-gram pool (TokenSwift token reutilization)."""

from __future__ import annotations

import random

import pytest

from specrun.decoding.ngram import NGramPool

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
