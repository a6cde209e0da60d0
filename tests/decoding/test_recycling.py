"""Behaviour tests for the Token Recycling matrix and its static tree."""

from __future__ import annotations

import pytest
import torch

from specrun.decoding.drafters.recycling import (
    LEARN_EVERY_AR,
    STATIC_TREE,
    TREE_DEPTHS,
    TREE_PARENTS,
    TREE_SIZE,
    RecyclingMatrix,
)


def test_static_tree_shape() -> None:
    assert len(STATIC_TREE) == 80 and len(set(STATIC_TREE)) == 80  # drafted nodes
    assert TREE_SIZE == 81  # with the root
    per_depth = [int((TREE_DEPTHS == d).sum()) for d in range(1, 7)]
    assert per_depth == [8, 21, 25, 15, 8, 3]
    assert int(TREE_DEPTHS.max()) == 6


def test_bfs_order_parents_before_children() -> None:
    parents, depths = TREE_PARENTS.tolist(), TREE_DEPTHS.tolist()
    assert parents[0] == -1 and depths[0] == 0
    for i in range(1, TREE_SIZE):
        assert 0 <= parents[i] < i
        assert depths[i] == depths[parents[i]] + 1
        assert depths[i] >= depths[i - 1]  # BFS: depths never decrease


def _brute_force(matrix: torch.Tensor, root: int) -> dict[tuple[int, ...], int]:
    """Token at every rank path of the static tree, expanded recursively from the path literal."""
    out: dict[tuple[int, ...], int] = {(): root}

    def expand(path: tuple[int, ...]) -> None:
        for p in STATIC_TREE:
            if len(p) == len(path) + 1 and p[:-1] == path:
                out[p] = int(matrix[out[path], p[-1]])
                expand(p)

    expand(())
    return out


def _paths(parents: list[int], ranks: list[int]) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (ranks[i],))
    return paths


@pytest.mark.parametrize("seed", range(5))
def test_draft_matches_recursive_expansion(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rm = RecyclingMatrix(vocab_size=50, k=8)
    rm.matrix = torch.randint(0, 50, (50, 8), generator=gen)
    root = int(torch.randint(0, 50, (1,), generator=gen))
    tokens, parents = rm.draft(root)
    assert tokens.shape == parents.shape == (TREE_SIZE,)
    assert tokens.dtype == parents.dtype == torch.long
    assert parents.tolist() == TREE_PARENTS.tolist()
    expected = _brute_force(rm.matrix, root)
    paths = _paths(parents.tolist(), rm.ranks.tolist())
    assert sorted(paths[1:]) == sorted(STATIC_TREE)
    assert {p: t for p, t in zip(paths, tokens.tolist())} == expected


def test_initial_rows_give_distinct_siblings() -> None:
    rm = RecyclingMatrix(vocab_size=20, k=8)
    assert rm.matrix.shape == (20, 8) and rm.matrix.dtype == torch.long
    tokens, parents = rm.draft(3)
    assert tokens[0] == 3
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents.tolist()[1:], start=1):
        children.setdefault(p, []).append(int(tokens[i]))
    for sib in children.values():
        assert len(sib) == len(set(sib))


def test_draft_does_not_expose_internal_parents() -> None:
    rm = RecyclingMatrix(vocab_size=10, k=8)
    _, parents = rm.draft(0)
    parents.fill_(7)
    assert rm.draft(0)[1].tolist() == TREE_PARENTS.tolist()


def test_update_last_write_wins() -> None:
    rm = RecyclingMatrix(vocab_size=30, k=8)
    tokens = torch.tensor([5, 7, 5, 9, 5, 7])
    topk = torch.arange(6 * 8).reshape(6, 8) % 30
    rm.update(tokens, topk)
    assert rm.matrix[5].tolist() == topk[4].tolist()
    assert rm.matrix[7].tolist() == topk[5].tolist()
    assert rm.matrix[9].tolist() == topk[3].tolist()
    assert rm.matrix[0].tolist() == list(range(8))  # untouched rows keep their value
    rm.update(torch.tensor([], dtype=torch.long), torch.empty(0, 8, dtype=torch.long))
    assert rm.matrix[5].tolist() == topk[4].tolist()
    # Random duplicates against a sequential reference.
    gen = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 6, (200,), generator=gen)
    ids = torch.randint(0, 30, (200, 8), generator=gen)
    ref = rm.matrix.clone()
    for t, row in zip(tok.tolist(), ids):
        ref[t] = row
    rm.update(tok, ids.to(torch.int32))
    assert torch.equal(rm.matrix, ref)


def test_one_learn_over_a_batch_equals_learning_each_sequence_in_turn() -> None:
    """An engine of several sequences teaches the worker's matrix once per step with every sequence's nodes, in their
    order."""
    g = torch.Generator().manual_seed(0)
    parts = [(torch.tensor(t), torch.randn(len(t), 50, generator=g)) for t in ([3, 7, 3], [7, 9], [1, 3])]
    each, once = RecyclingMatrix(50, k=8), RecyclingMatrix(50, k=8)
    for tokens, logits in parts:
        each.learn(tokens, logits)
    once.learn(torch.cat([t for t, _ in parts]), torch.cat([lg for _, lg in parts]))
    assert torch.equal(once.matrix, each.matrix)
    assert torch.equal(once.matrix[3], torch.topk(parts[2][1][1], 8).indices)  # the last sequence's row for 3


def test_plain_ar_steps_teach_the_matrix_every_nth_time_wide_steps_always() -> None:
    g = torch.Generator().manual_seed(1)
    rm = RecyclingMatrix(50, k=8)
    learned = []
    for step in range(3 * LEARN_EVERY_AR):
        token = torch.tensor([step])
        logits = torch.randn(1, 50, generator=g)
        rm.learn_step(token, logits, plain=True)
        if torch.equal(rm.matrix[step], torch.topk(logits[0], 8).indices):
            learned.append(step)
    assert learned == list(range(0, 3 * LEARN_EVERY_AR, LEARN_EVERY_AR))
    tokens, logits = torch.tensor([40, 41]), torch.randn(2, 50, generator=g)
    rm.learn_step(tokens, logits, plain=False)  # a wide step (drafts verified) always teaches
    assert torch.equal(rm.matrix[tokens], torch.topk(logits, 8).indices)


def test_update_refuses_bad_shapes() -> None:
    rm = RecyclingMatrix(vocab_size=30, k=8)
    with pytest.raises(ValueError, match=r"\(3, 8\)"):
        rm.update(torch.tensor([1, 2, 3]), torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="1-D"):
        rm.update(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))


def test_state_dict_round_trip(tmp_path) -> None:
    rm = RecyclingMatrix(vocab_size=40, k=8)
    rm.update(torch.tensor([1, 2]), torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1)))
    path = tmp_path / "rec.pt"
    torch.save(rm.state_dict(), path)
    other = RecyclingMatrix(vocab_size=40, k=8)
    other.load_state_dict(torch.load(path))
    assert torch.equal(other.matrix, rm.matrix)
    assert torch.equal(other.draft(1)[0], rm.draft(1)[0])
    sd = rm.state_dict()
    sd["matrix"][1, 0] = 39 - int(sd["matrix"][1, 0])  # the state is a copy
    assert not torch.equal(sd["matrix"], rm.matrix)


def test_load_refuses_wrong_state() -> None:
    rm = RecyclingMatrix(vocab_size=40, k=8)
    with pytest.raises(ValueError, match=r"expected \(40, 8\).*got \(41, 8\)"):
        rm.load_state_dict(RecyclingMatrix(vocab_size=41, k=8).state_dict())
    with pytest.raises(ValueError, match=r"got \(40, 9\)"):
        rm.load_state_dict({"matrix": torch.zeros(40, 9, dtype=torch.long)})
    with pytest.raises(ValueError, match="matrix"):
        rm.load_state_dict({})
    with pytest.raises(ValueError, match="float32"):
        rm.load_state_dict({"matrix": torch.zeros(40, 8)})
    with pytest.raises(ValueError, match="40"):
        rm.load_state_dict({"matrix": torch.full((40, 8), 40, dtype=torch.long)})
    assert rm.matrix[0].tolist() == list(range(8))  # unchanged after refusals


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="7"):
        RecyclingMatrix(vocab_size=100, k=7)
    with pytest.raises(ValueError, match="5"):
        RecyclingMatrix(vocab_size=5, k=8)
    rm = RecyclingMatrix(vocab_size=100, k=10)
    assert rm.matrix.shape == (100, 10)
    assert rm.draft(99)[0].shape == (TREE_SIZE,)
