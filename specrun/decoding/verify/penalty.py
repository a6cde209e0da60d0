"""Contextual-penalty window: which tokens sit in the last W tokens of (committed sequence + a trie node's path).

Counts over the committed window are kept incrementally; per-node presence patches at most 2*depth tokens.
"""

from __future__ import annotations

import torch

from specrun.decoding.kernels.cpu_kernels import Patches
from specrun.decoding.verify.trie import Trie

FEW_PATCHES = 64  # tries of nodes x depth up to this get their patches in Python integers: ~25 torch ops cost ~0.3 ms


class PenaltyWindow:
    def __init__(self, vocab_size: int, window: int, device: torch.device):
        self.window = window
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)  # [V]

    def reset(self, seq: torch.Tensor, n: int) -> None:
        """Recount from the committed sequence seq[:n] (once per generation)."""
        self.counts.zero_()
        start = max(0, n - self.window)
        self.counts.index_add_(0, seq[start:n], torch.ones(n - start, dtype=torch.int32, device=seq.device))

    def advance(self, seq: torch.Tensor, n_old: int, n_new: int) -> None:
        """Tokens seq[n_old:n_new] were committed: add them, drop what left the window."""
        added = seq[n_old:n_new]
        self.counts.index_add_(0, added, torch.ones_like(added, dtype=torch.int32))
        gone = seq[max(0, n_old - self.window) : max(0, n_new - self.window)]
        if gone.numel():
            self.counts.index_add_(0, gone, torch.full_like(gone, -1, dtype=torch.int32))

    def presence(self, seq: torch.Tensor, n: int, trie: Trie) -> torch.Tensor:
        """Window presence per trie node: committed seq[:n] (ending at the root) plus the node's path.

        # seq: [Lmax] long, trie with T nodes -> [T, V] bool
        """
        present = (self.counts > 0).unsqueeze(0).expand(trie.size, -1).clone()
        rows, cols, vals = self.patches(seq, n, trie)
        present[rows, cols] = vals
        return present

    def patches(self, seq: torch.Tensor, n: int, trie: Trie) -> Patches:
        """Where a node's presence differs from the committed window's (counts > 0) or may: its path tokens and the
        oldest committed tokens its path pushes out of the window, with whether each is present for that node.

        # seq: [Lmax] long, trie with T nodes of depth <= Dm -> rows [P] long, cols [P] long, present [P] bool
        """
        T, Dm = trie.path_tokens.shape
        if Dm == 0:
            empty = seq.new_empty(0)
            return empty, empty, empty.bool()
        if T * Dm <= FEW_PATCHES and seq.device.type == "cpu":
            return self._few_patches(seq, n, trie)
        W, dev = self.window, seq.device
        head_start = max(0, n - W)
        # tokens that leave the window when a node adds `depth` path tokens: the oldest ones of the committed window
        head = seq.new_full((Dm,), -1)
        avail = seq[head_start : min(n, head_start + Dm)]
        head[: avail.numel()] = avail  # [Dm]
        n_gone = (n + trie.depths - W - head_start).clamp(0, n - head_start).minimum(trie.depths)  # [T]
        j = torch.arange(Dm, device=dev)
        gone = torch.where(j[None, :] < n_gone[:, None], head[None, :], -1)  # [T, Dm]
        path = trie.path_tokens  # [T, Dm], -1 padded
        cand = path.new_empty((T, 2 * Dm))  # [T, 2Dm]
        cand[:, :Dm], cand[:, Dm:] = gone, path
        valid = cand >= 0
        safe = cand.clamp(min=0)
        count = self.counts[safe].to(torch.int64)  # [T, 2Dm]
        count -= (gone[:, None, :] == cand[:, :, None]).sum(-1) * valid
        count += (path[:, None, :] == cand[:, :, None]).sum(-1) * valid
        # window shorter than the path itself: only the newest W path tokens count
        path_pos = torch.arange(Dm, device=dev)[None, :].expand(T, -1)
        too_old = (path >= 0) & (path_pos < (trie.depths[:, None] - W))
        count -= (torch.where(too_old, path, -1)[:, None, :] == cand[:, :, None]).sum(-1) * valid
        rows = torch.arange(T, device=dev)[:, None].expand_as(cand)
        return rows[valid], safe[valid], count[valid] > 0

    def _few_patches(self, seq: torch.Tensor, n: int, trie: Trie) -> Patches:
        """patches() of a small trie on the CPU, node by node in Python integers: the same entries in the same order."""
        W, Dm = self.window, trie.path_tokens.shape[1]
        head_start = max(0, n - W)
        head = seq[head_start : min(n, head_start + Dm)].tolist()  # the oldest committed tokens of the window
        counts = self.counts.numpy()
        rows, cols, vals = [], [], []
        for t, (d, path) in enumerate(zip(trie.depths.tolist(), trie.path_tokens.tolist())):
            gone = head[: min(max(n + d - W - head_start, 0), n - head_start, d)]
            too_old = [c for j, c in enumerate(path) if c >= 0 and j < d - W]
            for c in gone + [c for c in path if c >= 0]:
                rows.append(t)
                cols.append(c)
                vals.append(int(counts[c]) - gone.count(c) + path.count(c) - too_old.count(c) > 0)
        return (torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long),
                torch.tensor(vals, dtype=torch.bool))
