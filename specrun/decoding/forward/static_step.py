"""The AR decode step with static shapes: one token at a slot and position held in device tensors, attending a fixed
bucket of cache slots under a mask, so that on CUDA each bucket's step is captured once as a CUDA graph and replayed.

StaticStep(runner).forward(token, position) -> hidden [1, H]; the same inputs and outputs as runner.forward for one
new token (K/V written at slot cache.length). On CPU the same function runs eagerly: the twin the tests compare.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specrun.decoding.forward.attention import attend_lse
from specrun.decoding.forward.runner import SLOT_BLOCK, ModelRunner

MIN_BUCKET = 256  # slots attended by the smallest bucket; buckets double up to the cache's capacity
SPLIT_FROM = 4096  # buckets this long attend in chunks (split-KV), merged by log-sum-exp
MIN_CHUNKS = 64  # chunks a split bucket keeps where it can (a 4,096-slot bucket: 16 of SLOT_BLOCK); 64 with 8 KV
# heads make 512 blocks of work for the GPU
WARMUP = 2  # eager runs on a side stream before a capture (torch's rule: lazy initialisations happen outside it)


def bucket_of(slots: int, capacity: int) -> int:
    """The smallest bucket (MIN_BUCKET doubled, capped at capacity) holding `slots` slots."""
    b = MIN_BUCKET
    while b < slots:
        b *= 2
    return min(b, capacity)


def chunk_size(bucket: int) -> int:
    """Keys per chunk of a split bucket: doubled from SLOT_BLOCK while at least MIN_CHUNKS chunks remain."""
    c = SLOT_BLOCK
    while bucket % (2 * c) == 0 and bucket // (2 * c) >= MIN_CHUNKS:
        c *= 2
    return c


def _chunks_lse(q, k, v, bias, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each chunk alone and its log-sum-exp: the efficient kernel on CUDA in reduced precision and float32
    (its lse), matmuls in float32 or wider elsewhere (the CPU twin; CUDA float64, which that kernel lacks). A chunk
    with no visible key has no defined result here (the CUDA kernel returns lse 0): the caller masks it.

    # q: [N, Hkv, G, D], k/v: [N, Hkv, C, D], bias: [N, 1, 1, C] -> o: [N, Hkv, G, D], lse: [N, Hkv, G]
    """
    if q.device.type == "cuda" and q.dtype != torch.float64:
        bias = bias.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, scale=scale)[:2]
        return o.float(), lse[..., : q.shape[2]]
    return attend_lse(q, k, v, scale, torch.isfinite(bias))


class _StaticContext:
    """Attention for the static step: write K/V at the slot tensor, attend slots [0, bucket) where slot index <= slot.
    Buckets of SPLIT_FROM slots or more are split in chunks attended in parallel and merged by log-sum-exp (one
    query row per KV group leaves a long single pass of a whole bucket on a few of the GPU's cores)."""

    def __init__(self, runner: ModelRunner, bucket: int, slot: torch.Tensor):
        self.cache, self.bucket, self.slot = runner.cache, bucket, slot
        idx = torch.arange(bucket, device=slot.device)
        self.chunk = chunk_size(bucket) if bucket >= SPLIT_FROM else 0
        if not self.chunk:
            self.visible = (idx <= slot)[None, None, None, :]  # [1, 1, 1, bucket] bool, computed in the step
        else:  # [N, 1, 1, C] float: 0 where visible, -inf elsewhere; live: [N, 1, 1] chunks with a key seen
            n = bucket // self.chunk
            self.bias = torch.zeros(bucket, device=slot.device).masked_fill_(idx > slot, float("-inf"))
            self.bias = self.bias.view(n, 1, 1, self.chunk)
            self.live = (torch.arange(n, device=slot.device) * self.chunk <= slot)[:, None, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling):
        """# q: [1, Hq, 1, D], k/v: [1, Hkv, 1, D] -> [1, 1, Hq, D]"""
        _, Hq, _, D = q.shape
        Hkv = k.shape[1]
        ck, cv = self.cache.k[layer], self.cache.v[layer]  # [Hkv, S, D]
        ck.index_copy_(1, self.slot, k[0])
        cv.index_copy_(1, self.slot, v[0])
        qg = q.reshape(1, Hkv, Hq // Hkv, D)  # query head h = kv_head * G + g
        if not self.chunk:
            out = F.scaled_dot_product_attention(qg, ck[None, :, : self.bucket], cv[None, :, : self.bucket],
                                                 attn_mask=self.visible, scale=scaling)  # [1, Hkv, G, D]
            return out.reshape(1, 1, Hq, D)
        n, C = self.bucket // self.chunk, self.chunk
        keys = ck[:, : self.bucket].view(Hkv, n, C, D).transpose(0, 1)  # [N, Hkv, C, D]
        values = cv[:, : self.bucket].view(Hkv, n, C, D).transpose(0, 1)
        scale = D**-0.5 if scaling is None else scaling
        o, lse = _chunks_lse(qg.expand(n, -1, -1, -1).contiguous(), keys, values, self.bias, scale)
        lse = lse.masked_fill(~self.live, float("-inf"))  # a chunk of masked keys weighs 0, whatever its kernel said
        w = torch.exp(lse - lse.amax(dim=0))  # [N, Hkv, G]
        o = torch.where(self.live[..., None], o, 0.0) * w[..., None]
        out = o.sum(dim=0) / w.sum(dim=0)[..., None]  # [Hkv, G, D]
        return out.to(q.dtype).reshape(1, 1, Hq, D)


class StaticStep:
    """Per bucket a static-shape AR step over the runner's cache: a CUDA graph on CUDA (captured at first use of the
    bucket, replayed after), the same function run eagerly elsewhere. Rebuilt when the runner's cache is replaced."""

    def __init__(self, runner: ModelRunner, graphs: bool | None = None):
        self.runner = runner
        self.decoder = runner.decoder
        dev = runner.lm.device
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self._cache = None
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.calls = 0  # steps taken (tests check the engine used it)

    def _body(self, bucket: int) -> torch.Tensor:
        """# -> hidden [1, H] for self.token at self.position, its K/V at self.slot"""
        dec = self.decoder
        x, cos, sin = dec.embed_rope(self.token, self.position)
        return dec.norm(dec.layer_stack(x, cos, sin, _StaticContext(self.runner, bucket, self.slot)))

    @torch.inference_mode()
    def forward(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One new token after the committed slots, as runner.forward(token, position, ones [1, 1]) computes it.

        # token, position: [1] long (on the model's device) -> hidden: [1, H]
        """
        cache = self.runner.cache
        if cache is not self._cache:  # a new cache (reset grew it): graphs read the old tensors
            # a fresh memory pool too: capturing into the pool of freed graphs trips the CUDA allocator (torch 2.11)
            self._cache, self._captured, self._pool = cache, {}, None
        slot = cache.length
        if slot >= cache.capacity:
            raise RuntimeError(f"KV cache overflow: need {slot + 1} slots, have {cache.capacity}")
        self.token.copy_(token)
        self.position.copy_(position)
        self.slot.fill_(slot)
        self.calls += 1
        bucket = bucket_of(slot + 1, cache.capacity)
        if not self.graphs:
            return self._body(bucket)
        if bucket not in self._captured:
            self._captured[bucket] = self._capture(bucket)
        graph, out = self._captured[bucket]
        graph.replay()
        return out.clone()  # the graph's output buffer is rewritten by the next replay; drafters keep hidden rows

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (it runs the step for the current inputs: the same K/V written to the same slot,
        so no harm), then capture; every graph shares one memory pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP):
                self._body(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._body(bucket)
        return graph, out
