"""Path-aware contextual penalty window against a brute-force recount."""

import random

import pytest
import torch

from specrun.decoding.verify import penalty
from specrun.decoding.verify.penalty import PenaltyWindow
from specrun.decoding.verify.trie import Draft, build_trie


def brute_presence(seq, path, window, vocab):
    ctx = (seq + path)[-window:] if window else []
    out = torch.zeros(vocab, dtype=torch.bool)
    out[list(set(ctx))] = True
    return out


def random_trie(rng, root, vocab, n_paths):
    drafts = []
    for _ in range(n_paths):
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        drafts.append(Draft([root, *toks], list(range(-1, len(toks))), 0))
    return build_trie(root, drafts, 64, torch.device("cpu"))


@pytest.mark.parametrize("few", [0, 10**6])  # every trie's patches by torch's ops, or in Python integers
def test_presence_matches_brute_force_with_incremental_advance(monkeypatch, few):
    monkeypatch.setattr(penalty, "FEW_PATCHES", few)
    rng = random.Random(0)
    vocab = 12
    for window in (1, 3, 7, 50):
        seq_list = [rng.randrange(vocab) for _ in range(5)]
        seq = torch.zeros(400, dtype=torch.long)
        seq[: len(seq_list)] = torch.tensor(seq_list)
        win = PenaltyWindow(vocab, window, torch.device("cpu"))
        win.reset(seq, len(seq_list))
        for _ in range(40):
            n = len(seq_list)
            trie = random_trie(rng, seq_list[-1], vocab, 4)
            got = win.presence(seq, n, trie)
            for i in range(trie.size):
                path = [t for t in trie.path_tokens[i].tolist() if t >= 0]
                assert torch.equal(got[i], brute_presence(seq_list, path, window, vocab)), (window, i, path)
            new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
            seq[n : n + len(new)] = torch.tensor(new)
            win.advance(seq, n, n + len(new))
            seq_list += new
