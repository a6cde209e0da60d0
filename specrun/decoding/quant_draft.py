"""The quantized self-drafter: the target itself, its weights in 4 bits (quant.py), drafts a chain of AR's own choices
(its sampling rules, penalty and Gumbel noise at each position) over the target's KV cache, one token a forward.

Its drafted tokens' K/V go in the slots after the committed ones, where the verify forward then writes its own: the
draft attends an int8 copy of the target's K/V of every committed token (KVCodes, synced a step's new slots at a time;
verification decides, I1).
"""

from __future__ import annotations

import math

import torch

from specrun.decoding.cpu_kernels import cpu_kernels
from specrun.decoding.cpu_layers import CpuLayers
from specrun.decoding.kv_codes import KVCodes
from specrun.decoding.ngram import SuffixCopy
from specrun.decoding.quant import quantizable, quantize
from specrun.decoding.runner import ModelRunner
from specrun.decoding.sampling import SamplingParams, ar_choice
from specrun.decoding.trie import Draft, DraftContext

# the LM head in 4 bits finds the candidates (the tokens min-p could keep, HEAD_MARGIN wide for its error) and the
# model's own bf16 rows score them (rescore_bf16): AR's head for what can be drafted, the 8-bit head's 0.87 ms a
# draft down to 0.39 (smollm2). (The 4-bit head alone moved AR's sampled token: 2.77 tokens a width-4 step against 3.68
# with an 8-bit head, 3.78 so.)
HEAD_MARGIN = 2.5  # logits: the 4-bit head errs by up to 1.75 on smollm2's 200 best (median 1.2); 1.5-5.0 drafted alike
GUMBEL_SPAN = 12.0  # no min-p: tokens this far (x temperature) below the best are drafted never (odds ~e^-12)
MAX_CHAIN = 15  # drafted tokens a step at most: each is a forward (the tuner picks the width below this)


def quantized(decoder) -> tuple[CpuLayers, torch.Tensor] | None:
    """The 4-bit layers and LM head (quantize's packs) of a FusedDecoder, built once per decoder, where the quantized
    self-drafter runs (a CPU bf16 model our kernels take, its LM head's inputs in groups of 32); else None."""
    if not hasattr(decoder, "_specrun_q4"):
        head = decoder.lm_head.weight  # [V, H]
        layers = None
        rows = head.device.type == "cpu" and head.dtype == torch.bfloat16 and head.is_contiguous()  # rescore's
        if rows and quantizable(head):
            layers = CpuLayers.quantized(decoder, cpu_kernels())
        decoder._specrun_q4 = None if layers is None else (layers, quantize(head)[0])
    return decoder._specrun_q4


def pick(logits: torch.Tensor, counts: torch.Tensor | None, params: SamplingParams, position: int) -> int:
    """AR's token from these logits at `position`, the penalty on the tokens counted (counts > 0).

    # logits: [1, V] float32, counts: [V] int32 or None
    """
    choice, _ = ar_choice(logits, params, torch.tensor([position]), lambda: (counts, None),
                          lambda: None if counts is None else (counts > 0)[None])
    return int(choice[0])


class QuantDrafter:
    name = "quant"

    def __init__(self, runner: ModelRunner, weights: tuple[CpuLayers, torch.Tensor]):
        self.runner = runner
        self.layers, self.head = weights
        dec = runner.decoder
        # the embedding's rows as they are (a plain nn.Embedding), and the final norm in one kernel call: a draft's
        # torch modules cost ~0.2 ms of its ~6
        self.embed_rows = dec.embed.weight if type(dec.embed) is torch.nn.Embedding else None
        self.norm_weight, self.norm_eps = dec.norm.weight, float(dec.norm.variance_epsilon)
        self.rows = dec.lm_head.weight  # [V, H] bf16: rescore's
        self.copy: SuffixCopy | None = None  # the n-gram drafter's copy, where it drafts beside this one
        # the draft's attention reads int8 K/V: half the bytes of bf16, 4 products an instruction (smollm2, 30 layers
        # at 2,048 keys: 2.8 ms against 6.3 for a bf16 attention split as this one; sampled, 5.24 tokens a width-6
        # step against 5.51 with bf16 K/V, for 5.0 ms a draft against 6.4)
        self.codes: KVCodes | None = None

    def start(self, seq: list[int]) -> None:
        if self.codes is not None:
            self.codes.upto = 0  # a new sequence: its cache is refilled from slot 0

    def observe(self, v) -> None:
        pass

    def commit(self, tokens: list[int]) -> None:
        pass

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, source: int) -> list[Draft]:
        """The root and up to budget - 1 (at most MAX_CHAIN) tokens after it, each AR's pick under the 4-bit model;
        the penalty window is the committed one plus the drafted tokens (a token leaving it is not tracked)."""
        k = min(ctx.budget - 1, MAX_CHAIN)
        dec, cache, params = self.runner.decoder, self.runner.cache, ctx.params
        if k < 1 or (params.greedy and self.copy is not None and self.copy.follow(1)):
            # greedy, and the last 3 tokens occurred before: the n-gram copy drafts the whole width at no forward's
            # cost (smollm2, 2,048 tokens: 3.45x AR so, 1.39x with this chain leading). Sampled text rarely repeats
            # what its 3-gram matches say, and steps that skip the chain made wide widths look cheap to the tuner
            return []
        counts = None if ctx.present is None or not params.uses_penalty else ctx.present.to(torch.int32)
        tokens, kernels = [ctx.root], self.layers.kernels
        theta = params.penalty if counts is not None else 1.0
        below = HEAD_MARGIN + (0.0 if params.greedy else params.temperature * (
            -math.log(params.min_p) if params.min_p > 0 else GUMBEL_SPAN))
        codes = self._codes(cache)
        x = self._embed(ctx.root)  # [1, H]
        cos, sin = dec.rotary(x[None], torch.arange(ctx.position, ctx.position + k)[None])  # [1, k, D] each
        tally = None if counts is None else counts.numpy()  # counts' memory: a tensor op a token cost ~15 us
        for i, (cos_i, sin_i) in enumerate(zip(cos[0].split(1), sin[0].split(1))):  # [1, D] each
            if i:
                x = self._embed(tokens[-1])
            h = self.layers(x, cos_i, sin_i, cache, cache.length + i, None, q8=codes)  # [1, H]
            h = kernels.rms_norm(h, self.norm_weight, self.norm_eps)
            coarse = kernels.gemv_q4(h, self.head, self.rows.shape[0])  # [1, V]
            logits, _ = kernels.rescore(coarse, counts, h, self.rows, theta, below)  # [1, V]
            token = pick(logits, counts, params, ctx.position + i + 1)
            tokens.append(token)
            if tally is not None:
                tally[token] += 1
        return [Draft(tokens, list(range(-1, k)), source)]

    def _codes(self, cache) -> KVCodes:
        """The int8 copy of cache's committed slots (a new one where the runner replaced its cache)."""
        L, Hkv, cap, D = cache.k.shape
        if self.codes is None or self.codes.cap < cap or self.codes.data.shape[0] != L:
            self.codes = KVCodes(L, Hkv, cap, D)
        self.codes.sync(self.layers.kernels, cache.k, cache.v, cache.length)
        return self.codes

    def _embed(self, token: int) -> torch.Tensor:
        """# -> [1, H]"""
        if self.embed_rows is None:
            return self.runner.decoder.embed(torch.tensor([token]))
        return self.embed_rows[token : token + 1]
