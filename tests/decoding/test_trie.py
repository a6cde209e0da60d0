"""Trie merge, budget, tree mask, positions and the walk."""

import random

import torch

from specrun.decoding.verify.trie import Draft, build_trie, merge_drafts, walk, walk_levels


def chain(root, toks, source=0):
    return Draft([root, *toks], list(range(-1, len(toks))), source)


def test_identical_prefixes_merge_into_one_node():
    tok, par, dep, src = merge_drafts(9, [chain(9, [1, 2, 3]), chain(9, [1, 2, 4], 1), chain(9, [5])], budget=100)
    assert tok == [9, 1, 2, 3, 4, 5]
    assert par == [-1, 0, 1, 2, 2, 0]
    assert dep == [0, 1, 2, 3, 3, 1]
    assert src == [-1, 0, 0, 0, 1, 0]  # a shared node keeps the drafter that proposed it first


def test_budget_cuts_nodes_and_their_descendants():
    tree = Draft([9, 1, 2, 3, 4], [-1, 0, 0, 1, 2], 0)
    tok, par, _, _ = merge_drafts(9, [tree], budget=3)
    assert tok == [9, 1, 2] and par == [-1, 0, 0]
    tok, par, _, _ = merge_drafts(9, [chain(9, [1, 2, 3]), chain(9, [7, 8])], budget=5)
    assert tok == [9, 1, 2, 3, 7]  # 8's parent made it, 8 itself is over budget


def test_mask_is_ancestor_or_self_and_paths_match():
    trie = build_trie(9, [chain(9, [1, 2, 3]), chain(9, [1, 5]), chain(9, [6])], 100, torch.device("cpu"))
    # nodes: 0:9 1:1 2:2 3:3 4:5 5:6
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(trie.ancestors, expected)
    assert trie.depths.tolist() == [0, 1, 2, 3, 2, 1]
    assert trie.path_tokens.tolist() == [[-1, -1, -1], [1, -1, -1], [1, 2, -1], [1, 2, 3], [1, 5, -1], [6, -1, -1]]


def test_walk_follows_target_choices_and_stops_at_first_miss():
    trie = build_trie(9, [chain(9, [1, 2, 3]), chain(9, [1, 5]), chain(9, [6])], 100, torch.device("cpu"))
    # target says: after 9 -> 1, after 1 -> 5, after 5 -> 77 (no child): path 9,1,5
    choice = torch.tensor([1, 5, 0, 0, 77, 0])
    assert walk(trie, choice).tolist() == [0, 1, 4]
    choice = torch.tensor([42, 2, 3, 8, 0, 0])  # the root's choice matches no child
    assert walk(trie, choice).tolist() == [0]
    choice = torch.tensor([1, 2, 3, 8, 0, 0])
    assert walk(trie, choice).tolist() == [0, 1, 2, 3]


def test_walk_in_python_equals_the_walk_by_levels():
    """The CPU's walk (Python integers) and the accelerators' (tensor ops a depth) accept the same nodes."""
    rng = random.Random(3)
    for _ in range(200):
        drafts = [chain(9, [rng.randrange(4) for _ in range(rng.randrange(1, 6))]) for _ in range(rng.randrange(1, 5))]
        trie = build_trie(9, drafts, rng.randrange(1, 20), torch.device("cpu"))
        choice = torch.tensor([rng.randrange(4) for _ in range(trie.size)])
        assert walk(trie, choice).tolist() == walk_levels(trie, choice).tolist()


def test_root_only_trie_is_plain_ar():
    trie = build_trie(4, [], 64, torch.device("cpu"))
    assert trie.size == 1 and trie.path_tokens.shape == (1, 0)
    assert walk(trie, torch.tensor([3])).tolist() == [0]
