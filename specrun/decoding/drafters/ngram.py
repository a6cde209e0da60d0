"""N-gram pool (TokenSwift token reutilization): counts every n-gram of the committed sequence.

query(first) -> the top-k (n-1)-token continuations seen after `first`, by count desc then recency desc.
"""

from __future__ import annotations

from typing import Sequence


class _Entry:
    """Continuations seen after one first token: counts, recency and an incrementally ordered top list."""

    __slots__ = ("stats", "top")

    def __init__(self) -> None:
        self.stats: dict[tuple[int, ...], tuple[int, int]] = {}  # continuation -> (count, last_seen)
        self.top: list[tuple[int, ...]] = []  # best first; every continuation outside ranks below every one inside


class NGramPool:
    """Incremental n-gram statistics; each added token costs O(topk) (docs/design.md I5), queries O(k).

    Counts are kept per distinct continuation. Recency is the order of the last increment (a global counter),
    so among equal counts the continuation seen most recently ranks first.
    """

    def __init__(self, n: int = 4, topk: int = 20) -> None:
        if n < 2:
            raise ValueError(f"n-gram size n must be >= 2, got {n}")
        if topk < 1:
            raise ValueError(f"n-gram topk must be >= 1, got {topk}")
        self.n = n
        self.topk = topk
        self.reset()

    def reset(self) -> None:
        """Forget everything (a new sequence starts)."""
        self._entries: dict[int, _Entry] = {}
        self._tail: list[int] = []  # last n-1 committed tokens, so n-grams spanning extend() calls count
        self._clock = 0  # increments so far: the recency stamp

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens and count every n-gram they complete."""
        new = [int(t) for t in tokens]
        if not new:
            return
        buf = self._tail + new
        n = self.n
        for i in range(len(buf) - n + 1):
            self._count(buf[i], tuple(buf[i + 1 : i + n]))
        self._tail = buf[-(n - 1) :]

    def query(self, first: int, k: int | None = None) -> list[tuple[int, ...]]:
        """Up to k (default topk, at most topk) continuations seen after `first`, best first."""
        if k is None:
            k = self.topk
        elif k < 0:
            raise ValueError(f"query k must be >= 0, got {k}")
        entry = self._entries.get(int(first))
        if entry is None:
            return []
        return entry.top[:k]

    def _count(self, first: int, cont: tuple[int, ...]) -> None:
        entry = self._entries.get(first)
        if entry is None:
            entry = self._entries[first] = _Entry()
        self._clock += 1
        count, _ = entry.stats.get(cont, (0, 0))
        key = (count + 1, self._clock)
        entry.stats[cont] = key
        top, stats = entry.top, entry.stats
        try:
            pos = top.index(cont)
        except ValueError:
            if len(top) < self.topk:
                top.append(cont)
            elif stats[top[-1]] < key:
                # Outside the list: it enters only by beating the worst item; keys only grow, so the evicted item
                # still ranks above every other outsider and the invariant holds.
                top[-1] = cont
            else:
                return
            pos = len(top) - 1
        # Bubble up: the incremented item's key grew, everything else is unchanged.
        while pos > 0 and stats[top[pos - 1]] < key:
            top[pos] = top[pos - 1]
            pos -= 1
        top[pos] = cont


class SuffixCopy:
    """Prompt-lookup drafting without rescans: where each `key`-token context last occurred in the committed sequence.

    follow(limit) -> the tokens that came after the previous occurrence of the sequence's last `key` tokens, continued
    periodically past the sequence's end (a loop repeats); [] if those tokens never occurred before. Each added token
    costs O(key) (docs/design.md I5), a follow O(limit).
    """

    def __init__(self, key: int = 3) -> None:
        if key < 1:
            raise ValueError(f"suffix key length must be >= 1, got {key}")
        self.key = key
        self.reset()

    def reset(self) -> None:
        self.seq: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # context -> index of the token after its latest occurrence

    def extend(self, tokens: Sequence[int]) -> None:
        seq, k = self.seq, self.key
        for t in tokens:
            seq.append(int(t))
            i = len(seq) - 1  # the context ending just before token i is indexed once i exists: the sequence's own
            if i >= k:  # last context stays out, so follow() finds the one before it
                self._after[tuple(seq[i - k : i])] = i

    def follow(self, limit: int) -> list[int]:
        seq, n = self.seq, len(self.seq)
        start = self._after.get(tuple(seq[n - self.key :])) if n >= self.key else None
        if start is None or limit <= 0:
            return []
        period = n - start  # the match ends `period` tokens before the sequence does: past the end, the copy repeats
        return [seq[start + j % period] for j in range(limit)]
