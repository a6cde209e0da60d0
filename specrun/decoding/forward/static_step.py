"""The decode and verify forward with static shapes: a bucket of rows (1, 2, 4, ... 64: an AR step or a trie padded
to a bucket) with tokens, positions and tree mask held in device tensors, attending a fixed bucket of cache slots, so
that on CUDA each (rows, slots) pair is captured once as a CUDA graph and replayed.

StaticStep(runner).forward(tokens, positions, tree) -> hidden [T, H]; what runner.forward computes for the same T new
tokens (K/V written at slots [cache.length, +T)). On CPU the same function runs eagerly: the twin the tests compare.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specrun.decoding.forward.attention import attend_lse
from specrun.decoding.forward.decoder import rows_bucket
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
    with no visible key for a row has no defined result there (the CUDA kernel returns lse 0): the caller masks it.

    # q: [N, Hkv, M, D] (M query rows a KV head), k/v: [N, Hkv, C, D], bias: [N, 1, M, C] -> o: [N, Hkv, M, D],
    # lse: [N, Hkv, M]
    """
    if q.device.type == "cuda" and q.dtype != torch.float64:
        bias = bias.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, scale=scale)[:2]
        return o.float(), lse[..., : q.shape[2]]
    return attend_lse(q, k, v, scale, torch.isfinite(bias))


class _StaticContext:
    """Attention for the static forward of W rows: write their K/V at slots [slot, slot+W), attend slots [0, bucket)
    where a slot is committed (< slot) or a new one the row's tree row allows. The masks are built once a forward, for
    the G query heads of a KV head. Buckets of SPLIT_FROM slots or more are split in chunks attended in parallel and
    merged by log-sum-exp (few query rows per KV group leave a long single pass of a whole bucket on a few cores)."""

    def __init__(self, runner: ModelRunner, bucket: int, slot: torch.Tensor, tree: torch.Tensor):
        # slot: [1] long, tree: [W, W] bool (a padding row sees itself alone)
        self.cache, self.bucket = runner.cache, bucket
        W = tree.shape[0]
        G = runner.model.config.num_attention_heads // runner.n_kv_heads
        self.slots = slot + torch.arange(W, device=slot.device)  # [W]
        rel = torch.arange(bucket, device=slot.device) - slot  # [S] slot index relative to the first new row
        new = (rel >= 0) & (rel < W)
        visible = (rel < 0)[None, :] | (new[None, :] & tree[:, rel.clamp(0, W - 1)])  # [W, S]
        grouped = visible[None].expand(G, W, bucket).reshape(G * W, bucket)  # rows (g, w), as q folds them
        self.chunk = chunk_size(bucket) if bucket >= SPLIT_FROM else 0
        if not self.chunk:
            self.visible = grouped[None, None]  # [1, 1, G*W, S] bool
        else:  # bias: [N, 1, G*W, C] 0 where visible, -inf elsewhere; live: [N, 1, G*W] chunks where a row sees a key
            n, C = bucket // self.chunk, self.chunk
            bias = torch.zeros(grouped.shape, dtype=self.cache.k.dtype, device=slot.device)
            bias.masked_fill_(~grouped, float("-inf"))
            self.bias = bias.view(G * W, n, C).transpose(0, 1)[:, None].contiguous()
            self.live = grouped.view(G * W, n, C).any(dim=-1).transpose(0, 1)[:, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling):
        """# q: [1, Hq, W, D], k/v: [1, Hkv, W, D] -> [1, W, Hq, D]"""
        _, Hq, W, D = q.shape
        Hkv = k.shape[1]
        ck, cv = self.cache.k[layer], self.cache.v[layer]  # [Hkv, S, D]
        ck.index_copy_(1, self.slots, k[0])
        cv.index_copy_(1, self.slots, v[0])
        qg = q.reshape(1, Hkv, Hq // Hkv * W, D)  # query head h = kv_head * G + g; rows (g, w)
        if not self.chunk:
            out = F.scaled_dot_product_attention(qg, ck[None, :, : self.bucket], cv[None, :, : self.bucket],
                                                 attn_mask=self.visible, scale=scaling)  # [1, Hkv, G*W, D]
            return out.reshape(1, Hq, W, D).transpose(1, 2)
        n, C = self.bucket // self.chunk, self.chunk
        keys = ck[:, : self.bucket].view(Hkv, n, C, D).transpose(0, 1)  # [N, Hkv, C, D]
        values = cv[:, : self.bucket].view(Hkv, n, C, D).transpose(0, 1)
        scale = D**-0.5 if scaling is None else scaling
        o, lse = _chunks_lse(qg.expand(n, -1, -1, -1).contiguous(), keys, values, self.bias, scale)
        lse = lse.masked_fill(~self.live, float("-inf"))  # a chunk of masked keys weighs 0, whatever its kernel said
        w = torch.exp(lse - lse.amax(dim=0))  # [N, Hkv, G*W]
        o = torch.where(self.live[..., None], o, 0.0) * w[..., None]
        out = o.sum(dim=0) / w.sum(dim=0)[..., None]  # [Hkv, G*W, D]
        return out.to(q.dtype).reshape(1, Hq, W, D).transpose(1, 2)


class _Rows:
    """A row bucket's inputs, held in device tensors that its graphs read."""

    def __init__(self, W: int, device):
        self.tokens = torch.zeros(W, dtype=torch.long, device=device)
        self.positions = torch.zeros(W, dtype=torch.long, device=device)
        self.eye = torch.eye(W, dtype=torch.bool, device=device)
        self.tree = self.eye.clone()

    def fill(self, tokens: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor | None) -> None:
        T = tokens.shape[0]
        self.tokens[:T].copy_(tokens)
        self.positions[:T].copy_(positions)
        self.tree.copy_(self.eye)  # padding rows see themselves alone; real rows never see them
        self.tree[:T, :T].copy_(self.eye[:T, :T] if T == 1 else tree)


class StaticStep:
    """Per (rows, slots) bucket a static-shape forward over the runner's cache: a CUDA graph on CUDA (captured at first
    use of the bucket, replayed after), the same function run eagerly elsewhere. Rebuilt when the cache is replaced."""

    def __init__(self, runner: ModelRunner, graphs: bool | None = None):
        self.runner = runner
        self.decoder = runner.decoder
        self.device = runner.lm.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)
        self._rows: dict[int, _Rows] = {}
        self._cache = None
        self._captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.calls = 0  # forwards taken here (tests check the engine used it)

    def _body(self, rows: _Rows, bucket: int) -> torch.Tensor:
        """# -> hidden [W, H] for the bucket's rows, their K/V at slots [self.slot, +W)"""
        dec = self.decoder
        x, cos, sin = dec.embed_rope(rows.tokens, rows.positions)
        return dec.norm(dec.layer_stack(x, cos, sin, _StaticContext(self.runner, bucket, self.slot, rows.tree)))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor | None = None
                ) -> torch.Tensor:
        """T new tokens after the committed slots, as runner.forward(tokens, positions, tree) computes them (which
        runs instead where T is above the largest row bucket or the padded rows pass the cache's end).

        # tokens, positions: [T] long (on the model's device), tree: [T, T] bool (None where T is 1) -> hidden: [T, H]
        """
        cache = self.runner.cache
        if cache is not self._cache:  # a new cache (reset grew it): graphs read the old tensors
            # a fresh memory pool too: capturing into the pool of freed graphs trips the CUDA allocator (torch 2.11)
            self._cache, self._captured, self._pool = cache, {}, None
        T, slot = tokens.shape[0], cache.length
        if slot + T > cache.capacity:
            raise RuntimeError(f"KV cache overflow: need {slot + T} slots, have {cache.capacity}")
        W = rows_bucket(T)
        if W is None or slot + W > cache.capacity:
            return self.runner.forward(tokens, positions, tree)  # T > 1 here: a width-1 bucket always fits
        rows = self._rows.get(W) or self._rows.setdefault(W, _Rows(W, self.device))
        rows.fill(tokens, positions, tree)
        self.slot.fill_(slot)
        self.calls += 1
        bucket = bucket_of(slot + W, cache.capacity)
        if not self.graphs:
            return self._body(rows, bucket)[:T]
        if (W, bucket) not in self._captured:
            self._captured[W, bucket] = self._capture(rows, bucket)
        graph, out = self._captured[W, bucket]
        graph.replay()
        return out[:T].clone()  # the graph's output buffer is rewritten by the next replay; drafters keep hidden rows

    def _capture(self, rows: _Rows, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """capture_graph of the bucket's forward (its warm-up writes the current rows' K/V to the same slots: no
        harm); every graph shares one memory pool."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture_graph(lambda: self._body(rows, bucket), self._pool)


def capture_graph(body, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """body() captured as a CUDA graph -> (graph, body's output, rewritten by each replay). It runs WARMUP times first
    on a side stream (torch's rule: lazy initialisations happen outside a capture), so it must be harmless to repeat."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for _ in range(WARMUP):
                body()
    finally:  # a warm-up that raised may leave work queued there: the caller's next kernels wait for it
        torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out
