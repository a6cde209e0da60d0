"""The quantized self-drafter: the target itself, its weights in 4 bits (quant.py), drafts a chain of AR's own choices
(its sampling rules, penalty and Gumbel noise at each position) over the target's KV cache, one token a forward.

Its drafted tokens' K/V go after the committed ones (on our kernels in the draft's own window of the cache, else in
the target's slots that the verify forward then writes), and verification decides (I1). The forward runs on our C
kernels (KernelForward) or torch's (quant_torch.TorchForward).
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass

import torch

from specrun.decoding.drafters.kernel_window import DraftWindow
from specrun.decoding.drafters.ngram import SuffixCopy
from specrun.decoding.drafters.quant_ring import RingForward, ring_forward, ring_of
from specrun.decoding.drafters.quant_static import StaticDraft
from specrun.decoding.drafters.quant_torch import TorchForward
from specrun.decoding.forward.cpu_layers import CpuLayers
from specrun.decoding.forward.quant import quantizable, quantize
from specrun.decoding.kernels.cpu_kernels import cpu_kernels
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.sampling import ar_choice, kernel_group, kernel_sampling, sample_rows_in_kernel
from specrun.decoding.verify.trie import Draft, DraftContext

# the LM head in 4 bits, on int8 inputs, finds the candidates (the tokens min-p could keep, HEAD_MARGIN wide for its
# error) and the model's own bf16 rows score them (rescore_bf16): AR's head for what can be drafted at a fraction of its
# cost (the 4-bit head's own logits moved AR's sampled token: docs/benchmarks.md)
HEAD_MARGIN = 2.5  # logits: the coarse head errs by up to ~2.2 on smollm2's 200 best (a row's worst: median 1.28);
# margins of 1.5-5.0 drafted alike
GUMBEL_SPAN = 12.0  # no min-p: tokens this far (x temperature) below the best are drafted never (odds ~e^-12)
MAX_CHAIN = 15  # drafted tokens a step at most: each is a forward (the tuner picks the width below this)


class KernelForward:
    """The 4-bit layers and LM head on our C kernels (AVX-512 BF16 CPUs, a bf16 model): the draft attends an int8
    copy of the target's first and recent committed K/V (kernel_window.DraftWindow, synced a step's new slots at a
    time). TorchForward (quant_torch.py) keeps the same contract on torch's kernels."""

    def __init__(self, decoder, layers: CpuLayers, head: torch.Tensor):
        self.dec, self.layers, self.head = decoder, layers, head
        # the embedding's rows as they are (a plain nn.Embedding), and the final norm in one kernel call: a draft's
        # torch modules cost ~0.2 ms of its ~6
        self.embed_rows = decoder.embed.weight if type(decoder.embed) is torch.nn.Embedding else None
        self.norm_weight, self.norm_eps = decoder.norm.weight, float(decoder.norm.variance_epsilon)
        self.rows = decoder.lm_head.weight  # [V, H] bf16: rescore's
        # the draft's attention reads int8 K/V: half the bytes of bf16, 4 products an instruction (smollm2, 30 layers
        # at 2,048 keys: 2.8 ms against 6.3 for a bf16 attention split as this one; sampled, 5.24 tokens a width-6
        # step against 5.51 with bf16 K/V, for 5.0 ms a draft against 6.4)
        self.windows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # each sequence's, by its drafter
        self.active: list[DraftWindow] = []  # this draft's sequences'
        self.cos = self.sin = None  # [B, k, D] of the draft's positions

    @classmethod
    def of(cls, decoder) -> KernelForward | None:
        """Where our kernels take the model (a CPU bf16 model, its LM head's inputs in groups of 32); else None."""
        head = decoder.lm_head.weight  # [V, H]
        rows = head.device.type == "cpu" and head.dtype == torch.bfloat16 and head.is_contiguous()  # rescore's
        layers = CpuLayers.quantized(decoder, cpu_kernels()) if rows and quantizable(head) else None
        return None if layers is None else cls(decoder, layers, quantize(head)[0])

    def begin(self, caches: list, positions: list[int], k: int, owners: list | None = None) -> None:
        """A draft of k tokens for each sequence: its root at positions[b], over caches[b] (anything with k, v
        [Lyr, Hkv, S, D] and length), in the window of owners[b] (default: the cache itself; freed with its owner)."""
        self.active = [self._window(o, c) for o, c in zip(owners or caches, caches)]
        for window, cache in zip(self.active, caches):
            window.sync(self.layers.kernels, cache.k, cache.v, cache.length)
        like = self.head.new_empty((1, 1, self.dec.head_dim), dtype=torch.bfloat16)
        pos = torch.tensor(positions)[:, None] + torch.arange(k)  # [B, k]
        self.cos, self.sin = self.dec.rotary(like, pos)  # [B, k, D] each

    def _window(self, owner, cache) -> DraftWindow:
        L, Hkv, S, D = cache.k.shape
        return self.windows.get(owner) or self.windows.setdefault(owner, DraftWindow(L, Hkv, D, S))

    @torch.inference_mode()
    def follow(self, owner, cache) -> None:
        """A step committed slots of owner's sequence: its window takes them now, so a draft after a run of plain AR
        steps pays no catch-up copy (which made drafting look dearer than it is to the width tuner)."""
        window = self.windows.get(owner)
        if window is not None:
            window.sync(self.layers.kernels, cache.k, cache.v, cache.length)

    def logits(self, i: int, tokens: list[int], counts: list, thetas: list[float], belows: list[float]
               ) -> torch.Tensor:
        """# counts[b]: [V] int32 or None -> [B, V] float32, each sequence's draft logits after its i-th token (-inf
        outside its candidates)"""
        kernels, ids = self.layers.kernels, torch.tensor(tokens)
        x = self.dec.embed(ids) if self.embed_rows is None else self.embed_rows[ids]  # [B, H]
        queries = [] if i == 0 else None  # the root's: what the windows' next rebuild ranks their slots by
        h = self.layers.rows(x, self.cos[:, i], self.sin[:, i], self.active, [w.length + i for w in self.active],
                             [w.codes for w in self.active], queries)  # [B, H]
        for b, window in enumerate(self.active if queries else ()):
            window.note_query(queries[0][:, b])
        h = kernels.rms_norm(h, self.norm_weight, self.norm_eps)
        coarse = kernels.gemv_q4(h, self.head, self.rows.shape[0], int8_inputs=True)  # [B, V]
        return kernels.rescore(coarse, counts, h, self.rows, thetas, belows)[0]


def quantized(decoder) -> KernelForward | TorchForward | None:
    """The 4-bit draft forward of a FusedDecoder, built once per decoder: our kernels where they take it, else torch's
    int4 kernels (any CPU, CUDA GPUs of compute capability 8.0+; on CUDA one sequence's depth a CUDA graph); None
    where neither takes it. compiled_draft makes torch's CPU draft one graph a token."""
    if not hasattr(decoder, "_specrun_q4"):
        forward = KernelForward.of(decoder) or TorchForward.of(decoder)
        if isinstance(forward, TorchForward) and forward.device.type == "cuda":
            forward.static = StaticDraft(forward)  # one sequence's depth as a CUDA graph
        decoder._specrun_q4 = forward
    return decoder._specrun_q4


def compilable(forward) -> bool:
    """Whether forward is torch's eager 4-bit draft on the CPU whose compile has not failed: what compiled_draft
    compiles (its package is a CPU library; on CUDA the draft runs eager)."""
    return isinstance(forward, TorchForward) and forward.device.type == "cpu" \
        and not getattr(forward, "_specrun_compile_failed", False)


def compiled_draft(forward, batched: bool = False):
    """forward as one compiled graph a token (quant_ring.py: loaded from the cache, else compiled now; for several
    sequences a call too with `batched`) where it is torch's eager draft; any other forward as it is. Where the compile
    fails (no C++ compiler, an inductor error) a warning, and the eager draft from then on: drafting changes the speed
    only."""
    if not compilable(forward):
        return forward
    try:
        return ring_forward(forward, batched)
    except Exception as e:  # noqa: BLE001 (export and inductor raise many kinds; the eager draft serves)
        forward._specrun_compile_failed = f"{type(e).__name__}: {str(e)[:200]}"  # why (a worker reports it)
        print(f"specrun: warning: compiling the quantized self-draft failed ({forward._specrun_compile_failed}); "
              f"drafting with the eager one", file=sys.stderr, flush=True)
        return forward


def draft_cached(forward, batched: bool = False) -> bool:
    """Whether compiled_draft(forward, batched) would only load: a torch draft whose compiled graphs are loaded or
    cached (compile_draft auto takes them for any length); any other forward (a compiled one already) False."""
    if not compilable(forward):
        return False
    try:
        return ring_of(forward).cached(batched)
    except Exception:  # noqa: BLE001 (no cache directory, no sources to hash: it is not cached, and drafting goes on)
        return False


@dataclass
class KVView:
    """A sequence's K/V as the draft forwards read and write them: [Lyr, Hkv, S, D] each, slots [0, length) committed."""

    k: torch.Tensor
    v: torch.Tensor
    length: int

    @classmethod
    def of(cls, kv) -> KVView | None:
        """A sequence's K/V (a KVCache or its SeqPages) where one store holds them all (the CPU's layout); else None."""
        view = kv.page_view()
        return None if view is None else cls(*view, kv.length)


def pick(logits: torch.Tensor, counts: list, params: list[SamplingParams], positions: list[int],
         ids: torch.Tensor | None = None) -> list[int]:
    """Each row's AR token from these logits at its position, the penalty on the tokens its counts count (> 0); ids:
    the token of each column, ascending (a compiled draft's candidates: ar_choice's), else column j is token j. Rows our
    sampling kernel takes go through one call for every row of a kernel_group; the others through one ar_choice per
    settings (torch's ~30 small ops, not a row's each). Each row's pick is its own.

    # logits: [B, C] float32, counts[b]: [V] int32 or None, ids: [B, C] long -> B token ids
    """
    out = [0] * len(params)
    kernel: dict[tuple, list[int]] = {}  # rows our kernel takes, by kernel_group
    torch_rows: dict[tuple, list[int]] = {}  # the others, by settings
    for b, p in enumerate(params):
        if ids is None and kernel_sampling(p, logits):
            kernel.setdefault(kernel_group(p), []).append(b)
        else:
            torch_rows.setdefault((p, counts[b] is None), []).append(b)
    parts = list(torch_rows.values())
    for rows in kernel.values():
        got = sample_rows_in_kernel(logits if len(rows) == len(params) else logits[rows], [counts[b] for b in rows],
                                    None, [params[b] for b in rows], torch.tensor([positions[b] for b in rows]))
        if got is None:  # a NaN row: torch's path, row by row
            parts += [[b] for b in rows]
        else:
            for b, token in zip(rows, got[0].tolist()):
                out[b] = token
    for rows in parts:
        for b, token in zip(rows, _ar_pick(logits, counts, params, positions, ids, rows)):
            out[b] = token
    return out


def _ar_pick(logits, counts, params, positions, ids, rows: list[int]) -> list[int]:
    """ar_choice's tokens for rows of one SamplingParams (pick's torch path)."""
    at, ns = None if ids is None else ids[rows], [counts[b] for b in rows]  # [G, C], the rows' counts

    def present() -> torch.Tensor | None:  # [G, C] bool: built where torch's path runs
        if ns[0] is None:
            return None
        return torch.stack([n > 0 for n in ns] if at is None else [n[a] > 0 for n, a in zip(ns, at)])

    choice, _ = ar_choice(logits[rows], params[rows[0]], torch.tensor([positions[b] for b in rows],
                                                                      device=logits.device),
                          lambda: (ns[0], None), present, at)
    return choice.tolist()


def draft_chains(forward: KernelForward | TorchForward | RingForward, rows: list[tuple[object, DraftContext]], k: int,
                 owners: list | None = None) -> list[list[int]]:
    """Each row's root and k tokens after it, each AR's pick under the 4-bit model, every row through one forward a
    depth; rows: (its KV: a KVCache or a page's view, its context); owners: each row's drafter, default its KV (the
    compiled draft keeps a ring, our kernels' draft a window per owner). The penalty window is the committed one plus
    the drafted tokens (a token leaving it is not tracked)."""
    ctxs = [ctx for _, ctx in rows]
    counts = [None if c.present is None or not c.params.uses_penalty else c.present.to(torch.int32) for c in ctxs]
    thetas = [c.params.penalty if n is not None else 1.0 for c, n in zip(ctxs, counts)]
    belows = [HEAD_MARGIN + (0.0 if c.params.greedy else c.params.temperature * (
        -math.log(c.params.min_p) if c.params.min_p > 0 else GUMBEL_SPAN)) for c in ctxs]
    # counts' memory where it is the CPU's (a tensor op a token cost ~15 us there), else the tensor itself
    tallies = [n.numpy() if n is not None and n.device.type == "cpu" else n for n in counts]
    forward.begin([kv for kv, _ in rows], [c.position for c in ctxs], k, owners)
    chains = [[c.root] for c in ctxs]
    params = [c.params for c in ctxs]
    for i in range(k):
        # a compiled draft's candidates [B, C] at token ids [B, C]; the others' logits [B, V], every column its token
        args = (i, [chain[-1] for chain in chains], counts, thetas, belows)
        logits, ids = forward.candidates(*args) if isinstance(forward, RingForward) else (forward.logits(*args), None)
        picks = pick(logits, counts, params, [c.position + i + 1 for c in ctxs], ids)
        for b, (chain, token) in enumerate(zip(chains, picks)):
            chain.append(token)
            if tallies[b] is not None:
                tallies[b][token] += 1
    return chains


def leaves_to_copy(ctx: DraftContext, copy: SuffixCopy | None) -> bool:
    """Greedy, and the last 3 tokens occurred before: the n-gram copy drafts the whole width at no forward's cost
    (smollm2, 2,048 tokens: 3.45x AR so, 1.39x with this chain leading). Sampled text rarely repeats what its 3-gram
    matches say, and steps that skip the chain made wide widths look cheap to the tuner."""
    return ctx.params.greedy and copy is not None and bool(copy.follow(1))


class QuantDrafter:
    """One sequence's quantized self-drafter: draft_batch runs every drafting sequence's chain through one 4-bit
    forward a depth and hands each its own; propose returns it."""

    name = "quant"

    def __init__(self, forward: KernelForward | TorchForward | RingForward, kv):
        self.forward = forward  # the engine's, shared by its sequences
        self.kv = kv  # its sequence's K/V (a KVCache or its SeqPages)
        self.chain: list[int] | None = None  # this step's, from draft_batch
        self.copy: SuffixCopy | None = None  # the n-gram drafter's copy, where it drafts beside this one

    def start(self, seq: list[int]) -> None:
        self.chain = None

    def observe(self, v) -> None:
        pass

    def commit(self, tokens: list[int]) -> None:
        view = KVView.of(self.kv) if isinstance(self.forward, KernelForward) else None
        if view is not None:
            self.forward.follow(self, view)

    def wants(self, ctx: DraftContext) -> bool:
        return ctx.budget > 1 and not leaves_to_copy(ctx, self.copy)

    def propose(self, ctx: DraftContext, source: int) -> list[Draft]:
        chain, self.chain = self.chain, None
        return [] if chain is None else [Draft(chain, list(range(-1, len(chain) - 1)), source)]


@torch.inference_mode()
def draft_batch(forward: KernelForward | TorchForward | RingForward,
                entries: list[tuple[object, QuantDrafter, DraftContext]]) -> None:
    """Every entry's chain of min(budget - 1, MAX_CHAIN) tokens, the largest budget's, through one forward a depth (a
    trie keeps what its own budget takes); entries: (its KV: its store's view, with k, v and length; its drafter; its
    context)."""
    if not entries:
        return
    k = min(max(ctx.budget for _, _, ctx in entries) - 1, MAX_CHAIN)
    chains = draft_chains(forward, [(kv, ctx) for kv, _, ctx in entries], k, [d for _, d, _ in entries])
    for (_, drafter, _), chain in zip(entries, chains):
        drafter.chain = chain
