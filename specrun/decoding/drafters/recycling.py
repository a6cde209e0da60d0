"""Token Recycling: matrix [V, K] of the top-K next tokens last seen after each token, and its static draft tree.

draft(root) expands the static 80-node tree (81 with the root, depth 6) by BFS; update() overwrites rows after verify.
"""

from __future__ import annotations

import torch

from specrun.decoding.kernels.cpu_kernels import topk_rows

# Token Recycling's static imbalanced tree (the paper's "80 nodes" exclude the root; its reference template has
# exactly these 80 paths): paths of child ranks from the root, per depth 8, 21, 25, 15, 8, 3.
STATIC_TREE: tuple[tuple[int, ...], ...] = (
    # depth 1 (8)
    *((r,) for r in range(8)),
    # depth 2 (21)
    *((0, r) for r in range(8)), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (3, 0), (3, 1),
    (4, 0), (5, 0), (6, 0), (7, 0),
    # depth 3 (25)
    *((0, 0, r) for r in range(8)), (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 2, 0), (0, 2, 1), (0, 3, 0),
    (0, 4, 0), (0, 5, 0), (0, 6, 0), (0, 7, 0), (1, 0, 0), (1, 0, 1), (1, 1, 0), (2, 0, 0), (3, 0, 0),
    (4, 0, 0), (5, 0, 0),
    # depth 4 (15)
    *((0, 0, 0, r) for r in range(5)), (0, 0, 1, 0), (0, 0, 1, 1), (0, 0, 2, 0), (0, 0, 3, 0), (0, 0, 4, 0),
    (0, 1, 0, 0), (0, 2, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0), (3, 0, 0, 0),
    # depth 5 (8)
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 2), (0, 0, 0, 1, 0), (0, 0, 0, 2, 0), (0, 0, 1, 0, 0),
    (0, 1, 0, 0, 0), (1, 0, 0, 0, 0),
    # depth 6 (3)
    (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 1, 0, 0),
)


def _build_tree(paths: tuple[tuple[int, ...], ...]) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
    """BFS layout of a rank-path tree -> (parents, ranks, depths, level bounds [start, end) per depth 1..D).

    Nodes: 0 is the root (parent -1, rank 0, depth 0); within a depth, ordered by parent index then rank.
    """
    index: dict[tuple[int, ...], int] = {(): 0}
    parents, ranks, depths, bounds = [-1], [0], [0], []
    max_depth = max(len(p) for p in paths)
    for d in range(1, max_depth + 1):
        level = [p for p in paths if len(p) == d]
        for p in level:
            if p[:-1] not in index:
                raise ValueError(f"static tree path {p} has no parent path {p[:-1]}")
        level.sort(key=lambda p: (index[p[:-1]], p[-1]))
        start = len(parents)
        for p in level:
            if p in index:
                raise ValueError(f"static tree path {p} appears twice")
            index[p] = len(parents)
            parents.append(index[p[:-1]])
            ranks.append(p[-1])
            depths.append(d)
        bounds.append((start, len(parents)))
    return parents, ranks, depths, bounds


_PARENTS, _RANKS, _DEPTHS, LEVEL_BOUNDS = _build_tree(STATIC_TREE)
TREE_SIZE = len(_PARENTS)  # 81: the root + 80 drafted nodes
TREE_PARENTS = torch.tensor(_PARENTS, dtype=torch.long)  # [N], -1 at the root (read-only; copied per instance)
TREE_RANKS = torch.tensor(_RANKS, dtype=torch.long)  # [N] child rank of each node under its parent
TREE_DEPTHS = torch.tensor(_DEPTHS, dtype=torch.long)  # [N] 0 at the root
MIN_K = max(_RANKS) + 1  # the tree reads ranks 0..MIN_K-1 of each row


LEARN_EVERY_AR = 4  # plain AR steps per matrix update


class RecyclingMatrix:
    """Top-K next-token matrix [V, K] (long) with hot-start state and the static tree expanded from it."""

    def __init__(self, vocab_size: int, k: int = 8, device: str | torch.device = "cpu") -> None:
        if k < MIN_K:
            raise ValueError(f"recycling k must be >= {MIN_K} (the static tree uses ranks up to {MIN_K - 1}), got {k}")
        if vocab_size < k:
            raise ValueError(f"recycling vocab_size must be >= k={k} so rows hold distinct ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.k = k
        self.device = torch.device(device)
        # Row v starts as [0..K-1]: distinct ids, so siblings in the drafted tree are distinct.
        self.matrix = torch.arange(k, dtype=torch.long, device=self.device).repeat(vocab_size, 1)  # [V, K]
        self.parents = TREE_PARENTS.to(self.device)  # [N]
        self.depths = TREE_DEPTHS.to(self.device)  # [N]
        self.ranks = TREE_RANKS.to(self.device)  # [N]
        self.level_bounds = LEVEL_BOUNDS  # [(start, end)] node index ranges of depths 1..6
        self._plain_steps = 0  # plain AR steps seen by learn_step

    def draft(self, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expand the static tree from `root` -> (tokens [N], parents [N]); node 0 = root, BFS order."""
        tokens = torch.empty(TREE_SIZE, dtype=torch.long, device=self.device)  # [N]
        tokens[0] = int(root)
        for start, end in self.level_bounds:  # one gather per depth
            tokens[start:end] = self.matrix[tokens[self.parents[start:end]], self.ranks[start:end]]
        return tokens, self.parents.clone()

    def update(self, tokens: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Rows M[tokens[i]] = topk_ids[i]; with repeated tokens the last occurrence wins.

        tokens [T] int, topk_ids [T, K] int.
        """
        if tokens.dim() != 1:
            raise ValueError(f"recycling update tokens must be 1-D [T], got shape {tuple(tokens.shape)}")
        t = tokens.shape[0]
        if tuple(topk_ids.shape) != (t, self.k):
            raise ValueError(
                f"recycling update topk_ids must have shape {(t, self.k)} (T, K), got {tuple(topk_ids.shape)}"
            )
        if t == 0:
            return
        tokens = tokens.to(device=self.device, dtype=torch.long)
        topk_ids = topk_ids.to(device=self.device, dtype=torch.long)
        # Keep only the last occurrence of each token: index_put with duplicate indices has no defined order.
        order = torch.argsort(tokens, stable=True)  # [T]
        ordered = tokens[order]
        last = torch.ones_like(ordered, dtype=torch.bool)
        last[:-1] = ordered[:-1] != ordered[1:]
        keep = order[last]  # [U] positions of last occurrences
        self.matrix[tokens[keep]] = topk_ids[keep]

    def learn(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Every verified node's top-k next tokens become its token's row (Token Recycling); later rows win.

        # tokens: [T] long, logits: [T, V]"""
        self.update(tokens, topk_rows(logits, self.k))

    def learn_step(self, tokens: torch.Tensor, logits: torch.Tensor, plain: bool) -> None:
        """learn() a verify step's nodes; a plain AR step (roots only, while drafts are not paying: a top-k over the
        whole vocabulary for one row) only every LEARN_EVERY_AR-th time (a row is "last seen": sampling loses little).

        # tokens: [T] long, logits: [T, V]"""
        if not plain or self._plain_steps % LEARN_EVERY_AR == 0:
            self.learn(tokens, logits)
        self._plain_steps += plain

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Hot-start state (a CPU copy)."""
        return {"matrix": self.matrix.detach().to("cpu", copy=True)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a state_dict; refuses a matrix of another shape or with ids outside the vocabulary."""
        if "matrix" not in state:
            raise ValueError(f"recycling state has no 'matrix' entry (keys: {sorted(state)})")
        m = state["matrix"]
        expected = (self.vocab_size, self.k)
        if not isinstance(m, torch.Tensor) or tuple(m.shape) != expected:
            got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"recycling matrix shape: expected {expected} (vocab_size, k), got {got}")
        if m.dtype.is_floating_point or m.dtype.is_complex or m.dtype == torch.bool:
            raise ValueError(f"recycling matrix dtype: expected an integer dtype, got {m.dtype}")
        if m.numel() and (int(m.min()) < 0 or int(m.max()) >= self.vocab_size):
            raise ValueError(
                f"recycling matrix ids: expected in [0, {self.vocab_size}), got range [{int(m.min())}, {int(m.max())}]"
            )
        self.matrix = m.to(device=self.device, dtype=torch.long).clone()
