"""Per-generation statistics: steps, accepted tokens per step, tokens per drafter, seconds per phase, trie widths.

alpha: mean share of the deepest offered draft path accepted per step; beta: share of steps whose accepted path
includes an n-gram node (TokenSwift's acceptance and n-gram acceptance). Sampled steps: expected acceptance (drafted
children's probability mass) beside the observed one, per path node with children, and what drafting the likeliest
tokens would have given on this text (ORACLE_DEPTHS). Counters only, cheap every step; snapshot() copies the cumulative
ones so a checkpointer can tell what happened between two checkpoints.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from contextlib import contextmanager

PHASES = ("prefill", "draft", "trie", "forward", "walk", "commit", "update")
LENGTH_BUCKET = 512  # acceptance is also kept per bucket of generated length (drafting changes as the text grows)
# Sampled text: tokens per step of an oracle that drafts a chain this deep of AR's likeliest tokens (it is accepted
# while the text goes on with them). A reference for what good drafts give, not a ceiling: a less likely first token
# can lead to a surer continuation, and a tree drafts several
ORACLE_DEPTHS = (1, 2, 4, 8)


def rss_mb() -> float | None:
    """This process's resident memory now, in MB (None where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


class GenStats:
    def __init__(self, drafter_names: tuple[str, ...]):
        self.drafter_names = drafter_names
        self.steps = 0
        self.new_tokens = 0
        self.accepted_hist: Counter[int] = Counter()
        self.by_drafter: Counter[str] = Counter()
        self.widths: Counter[int] = Counter()  # trie width chosen (the tuner's, or the fixed budget) -> steps
        self.nodes = 0
        self.alpha_sum = 0.0
        self.ngram_steps = 0
        self.kv_rebuilds = 0
        self.expected_sum = self.observed_sum = 0.0  # sampled steps: drafted children's mass vs accepted (per node)
        self.accept_nodes = 0
        self.likeliest = 0  # sampled tokens that were their row's most likely token (of self.sampled_tokens)
        self.sampled_tokens = 0
        self.oracle = {d: [0, 0] for d in ORACLE_DEPTHS}  # depth -> [steps so far, depth reached in the open step]
        # bucket index -> [steps, tokens, Counter of tokens by drafter, trie nodes, draft seconds, RSS MB at its start]
        self.buckets: dict[int, list] = {}
        self._drafted_at = 0.0  # phase["draft"] at the last record_step: each step's draft seconds go to its bucket
        self.phase = dict.fromkeys(PHASES, 0.0)
        self.t0 = time.perf_counter()

    @contextmanager
    def time(self, phase: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phase[phase] += time.perf_counter() - t

    def record_step(self, emitted: int, trie_nodes: int, trie_depth: int, accepted_sources: list[int],
                    generated: int = 0, width: int = 1) -> None:
        """generated: tokens generated before this step (its length bucket); width: the trie width chosen for it."""
        b = generated // LENGTH_BUCKET
        bucket = self.buckets.get(b)
        if bucket is None:  # memory read once a bucket, not every step
            bucket = self.buckets[b] = [0, 0, Counter(), 0, 0.0, rss_mb()]
        bucket[0] += 1
        bucket[1] += emitted
        bucket[2].update(self.drafter_names[s] for s in accepted_sources)
        bucket[3] += trie_nodes
        bucket[4] += self.phase["draft"] - self._drafted_at
        self._drafted_at = self.phase["draft"]
        self.steps += 1
        self.new_tokens += emitted
        self.nodes += trie_nodes
        self.accepted_hist[emitted] += 1
        self.widths[width] += 1
        if trie_depth:
            self.alpha_sum += len(accepted_sources) / trie_depth
        names = [self.drafter_names[s] for s in accepted_sources]
        self.ngram_steps += "ngram" in names
        self.by_drafter.update(names)

    def record_acceptance(self, expected, observed) -> None:
        """# expected, observed: [N] per path node with drafted children (trie.drafted_mass)"""
        self.accept_nodes += int(expected.shape[0])
        if expected.shape[0]:
            self.expected_sum += float(expected.sum())
            self.observed_sum += float(observed.sum())

    def record_likeliest(self, matches: list[bool]) -> None:
        """Per sampled token in emission order: was it its row's most likely token. Steps the oracle chains."""
        for m in matches:
            self.sampled_tokens += 1
            self.likeliest += m
            for d, state in self.oracle.items():
                if state[1] == 0:  # this token opens an oracle step (its root's row sampled it)
                    state[0] += 1
                state[1] = state[1] + 1 if m and state[1] < d else 0  # a drafted likeliest token went on, or it ends

    def oracle_accepted(self) -> dict[str, float] | None:
        """Sampled text: tokens per step of the oracle chain of each depth (None when nothing was sampled)."""
        if not self.sampled_tokens:
            return None
        return {str(d): self.sampled_tokens / steps for d, (steps, _) in self.oracle.items()}

    def snapshot(self) -> dict:
        """The cumulative counters a timeline row is the difference of (O(drafters + phases + widths), not O(steps))."""
        return {"steps": self.steps, "tokens": self.new_tokens, "nodes": self.nodes,
                "by_drafter": dict(self.by_drafter),
                "phase": dict(self.phase), "widths": dict(self.widths)}

    def as_dict(self) -> dict:
        seconds = time.perf_counter() - self.t0
        return {
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "mean_accepted": self.new_tokens / self.steps if self.steps else 0.0,
            "accepted_hist": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "tokens_by_drafter": {n: self.by_drafter.get(n, 0) for n in self.drafter_names},
            "mean_trie_nodes": self.nodes / self.steps if self.steps else 0.0,
            "widths": {str(w): n for w, n in sorted(self.widths.items())},
            "alpha": self.alpha_sum / self.steps if self.steps else 0.0,
            "beta": self.ngram_steps / self.steps if self.steps else 0.0,
            "kv_rebuilds": self.kv_rebuilds,
            "by_length": [{"from": b * LENGTH_BUCKET, "steps": n, "mean_accepted": t / n,
                           "tokens_by_drafter": {d: c.get(d, 0) for d in self.drafter_names},
                           # a drafted node's cost: the bucket's draft seconds over the nodes past the steps' roots
                           # (an upper bound: the seconds include shadow drafts, never verified, at narrow widths)
                           "draft_ms_per_node": 1e3 * drafted / (nodes - n) if nodes > n else None,
                           "rss_mb": rss}
                          for b, (n, t, c, nodes, drafted, rss) in sorted(self.buckets.items())],
            "acceptance_nodes": self.accept_nodes,
            "expected_acceptance": self.expected_sum / self.accept_nodes if self.accept_nodes else None,
            "observed_acceptance": self.observed_sum / self.accept_nodes if self.accept_nodes else None,
            "likeliest_share": self.likeliest / self.sampled_tokens if self.sampled_tokens else None,
            "oracle_accepted": self.oracle_accepted(),
            "phase_seconds": {k: round(v, 6) for k, v in self.phase.items()},
            "seconds": seconds,
            "tokens_per_s": self.new_tokens / seconds if seconds > 0 else 0.0,
        }
