"""One generation in flight: committed tokens, the target's choice per trie node, stop rules, the penalty window.

One per sequence of the engine's step: AR's token at each position depends only on this state.
"""

from __future__ import annotations

import torch

from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.penalty import PenaltyWindow
from specrun.decoding.verify.sampling import ar_choice, kernel_group, kernel_sampling, sample_rows_in_kernel
from specrun.decoding.verify.stops import StopMatcher
from specrun.decoding.verify.trie import DraftContext, Trie


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, resumed: list[int], *, vocab_size: int,
                 eos_ids, tokenizer, max_context: int, spare: int, device):
        """spare: slots beyond prompt + max_tokens that a verify forward may fill (the widest trie)."""
        if not prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [t for t in (*prompt_ids, *resumed, *params.stop_token_ids) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model vocabulary [0, {vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > max_context:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                             f"the model context of {max_context}")
        self.params = params
        self.eos_ids = eos_ids
        self.capacity = total + spare + 1
        self.stops = StopMatcher(tokenizer, params.stop) if params.stop else None
        hit = self.stops.seed(resumed) if self.stops is not None else None  # resumed text may end in a stop's start
        self.stop_hit = hit is not None
        if self.stop_hit:  # a stop completed at the last checkpointed token: nothing more to generate
            resumed = resumed[: hit + 1]
        known = [*prompt_ids, *resumed]
        self.seq = torch.zeros(self.capacity, dtype=torch.long, device=device)  # seq[:n] committed, seq[n-1] = root
        self.seq[: len(known)] = torch.tensor(known, dtype=torch.long)
        self.n = len(known)
        self.prompt_len = len(prompt_ids)
        self.out = list(resumed)  # generated tokens (appended, never rescanned)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.window = None
        if params.uses_penalty:
            self.window = PenaltyWindow(vocab_size, params.penalty_window, device)
            self.window.reset(self.seq, self.n)

    def draft_context(self, budget: int, with_present: bool = False) -> DraftContext:
        """What drafters see this step: the root at its position, the trie budget, AR's sampling rules, and (for
        drafters that imitate AR's processing) the committed penalty window's tokens."""
        present = self.window.counts > 0 if self.window is not None and with_present else None
        return DraftContext(self.root, self.n - 1, budget=budget, params=self.params, present=present)

    @property
    def known(self) -> list[int]:
        return self.seq[: self.n].tolist()

    @property
    def root(self) -> int:
        return int(self.seq[self.n - 1])

    def choose(self, trie: Trie, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's token after every node, exactly as AR would pick it there. -> [T] long, processed [T, V]"""
        # the token after a depth-d node is generated token len(out)+d at absolute position n+d
        w = self.window
        return ar_choice(logits, self.params, trie.depths + self.n, lambda: self.penalty_inputs(trie),
                         lambda: w.presence(self.seq, self.n, trie) if w is not None else None)

    def penalty_inputs(self, trie: Trie) -> tuple[torch.Tensor | None, tuple | None]:
        """Our sampling kernel's view of the window for the trie's rows: its counts and the nodes' patches (None, None
        without a penalty)."""
        w = self.window
        return (None, None) if w is None else (w.counts, w.patches(self.seq, self.n, trie))

    def stop_rules(self, tokens: list[int]) -> list[int]:
        """The accepted tokens AR would have emitted: cut after max_tokens, or the first that ends the generation."""
        tokens = tokens[: self.left]
        for i, t in enumerate(tokens):
            if self._ends(t):
                return tokens[: i + 1]
        return tokens

    def _ends(self, token: int) -> bool:
        """Does this next token end the generation: EOS, a stop token, or the last piece of a stop string?"""
        if (not self.params.ignore_eos and token in self.eos_ids) or token in self.stop_ids:
            return True
        if self.stops is not None and self.stops.feed(token):
            self.stop_hit = True
        return self.stop_hit

    def advance(self, emitted: list[int]) -> None:
        """Commit the emitted tokens; the last one is the next root."""
        k = len(emitted)
        self.seq[self.n : self.n + k] = torch.tensor(emitted, dtype=torch.long)
        if self.window:
            self.window.advance(self.seq, self.n, self.n + k)
        self.n += k
        self.out.extend(emitted)

    @property
    def left(self) -> int:
        """New tokens still to come at most (max_tokens less those emitted)."""
        return self.params.max_tokens - len(self.out)

    def finished(self) -> str | None:
        out, params = self.out, self.params
        if out and not params.ignore_eos and out[-1] in self.eos_ids:
            return "eos"
        if out and (out[-1] in self.stop_ids or self.stop_hit):
            return "stop"
        if len(out) >= params.max_tokens:
            return "length"
        return None


def choose_together(seqs: list[Sequence], tries: list[Trie], logits: torch.Tensor) -> list[tuple | None]:
    """Sequence.choose for several sequences whose tries' rows follow each other in logits: the rows our sampling
    kernel takes in one call for every sequence of a kernel_group; None for a sequence left to its own choose (other
    settings, alone in its group, or a NaN row). The same tokens and processed rows as choose, sequence by sequence.

    # logits: [N, V] (tries[0]'s rows first) -> per sequence (choice [T] long, processed [T, V]) or None
    """
    offsets, groups = [0], {}
    for i, (st, trie) in enumerate(zip(seqs, tries)):
        offsets.append(offsets[-1] + trie.size)
        if kernel_sampling(st.params, logits):
            groups.setdefault(kernel_group(st.params), []).append(i)
    out: list[tuple | None] = [None] * len(seqs)
    for members in (m for m in groups.values() if len(m) > 1):
        rows = [r for i in members for r in range(offsets[i], offsets[i + 1])]
        counts, params, positions, patches, done = [], [], [], [], 0
        for i in members:
            st, trie = seqs[i], tries[i]
            n, patch = st.penalty_inputs(trie)
            counts += [n] * trie.size
            params += [st.params] * trie.size
            positions.append(trie.depths + st.n)
            if patch is not None:
                patches.append((patch[0] + done, patch[1], patch[2]))
            done += trie.size
        merged = tuple(torch.cat(part) for part in zip(*patches)) if patches else None
        got = sample_rows_in_kernel(logits if len(rows) == logits.shape[0] else logits[rows], counts, merged, params,
                                    torch.cat(positions))
        if got is not None:
            at = 0
            for i in members:
                T = tries[i].size
                out[i] = got[0][at : at + T], got[1][at : at + T]
                at += T
    return out
