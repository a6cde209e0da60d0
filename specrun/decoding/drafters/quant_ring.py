"""The quantized self-draft's forward compiled ahead of time by inductor: one graph a drafted token, over a bf16 ring
of the draft's keys and values (the first SINKS positions and the last WINDOW, as quant_torch's draft reads).

RingForward(torch_forward) drafts as TorchForward (start, begin; candidates, each row's best few, for logits)
for one sequence or a batch, a ring each; warm() loads its packages (ring_package.py), building them where they are
not cached. A ring is synced from its sequence's cache at each begin (the committed slots it has not copied yet); the
draft's own K/V go in the ring only, never in the target's cache. Its tokens are proposals: the verify decides (I1).
"""

from __future__ import annotations

import time
import weakref

import torch

from specrun.decoding.drafters import quant_torch, ring_graph, ring_package
from specrun.decoding.drafters.quant_torch import BF16, TorchForward
from specrun.decoding.drafters.ring_graph import Graph
from specrun.decoding.forward import aot_package

RESERVE = 16  # ring slots past the window for a draft's own tokens (quant_draft.MAX_CHAIN + 1): none evicts a
# committed position the next draft's window still reads
_ROWS = {False: (1,), True: (1, 0)}  # the packages warm(batched) needs: one sequence a call, and several (rows 0)
SPAN_STEP = 128  # ring slots past the sinks come in steps of this many: a new sequence's ring holds one step, and it
# grows a step at a time (synced anew) as its text outgrows it, up to WINDOW + RESERVE. Every slot is attended (masked
# where empty), so a ring no longer than its text is a draft that reads only what it needs


class RingForward:
    """TorchForward's draft through the compiled graph for one sequence or several a call, each with a ring of its
    own: attention over positions [0, SINKS) and the last WINDOW (this token's included), as TorchForward attends the
    target's cache. A ring belongs to an owner (a sequence's drafter; by default the cache passed in);
    the ring of an owner that is gone is freed and the others moved down, so the drafting rings are one slice."""

    def __init__(self, fwd: TorchForward, bits: int | None = None):
        dec = fwd.dec
        self.fwd, self.dec = fwd, dec  # fwd: the eager draft (its rotary and head rows serve the graph in any bits)
        self.bits = bits or fwd.bits  # the graph's layers' (quant_torch.compiled_bits)
        self.sinks, self.window = quant_torch.SINKS, quant_torch.WINDOW
        self.full = self.window + RESERVE  # ring positions past the sinks once the text fills the window
        self._graph: Graph | None = None
        self.fn = self.fn_rows = None  # the graph for one sequence a call, and for several
        self.calls = 0  # tokens drafted through the graph (tests check the engines take this path)
        self.compile_seconds: float | None = None  # loading (or building) the packages
        self.built = 0  # packages this forward built (not found in the cache)
        self._paths: dict = {}
        self.start()

    def _alloc(self, span: int, rings: int) -> None:
        """Empty rings of `span` positions past the sinks (each synced from slot 0 at its next begin)."""
        dec = self.dec
        self.span, R, blk = span, self._length(span), ring_graph.BLOCK
        Lyr, Hkv, D = len(dec.layers), dec.n_kv, dec.head_dim
        with torch.inference_mode():  # the drafting path records nothing for autograd
            self.k = torch.zeros((rings, Lyr, Hkv, R // blk, D, blk), dtype=BF16)  # ring_graph.Graph's layouts
            self.v = torch.zeros((rings, Lyr, Hkv, D, R), dtype=BF16)
            self.pos = torch.full((rings, R), -1, dtype=torch.long)  # the position each slot holds, -1: none
        self.upto = [0] * rings  # per ring: committed positions copied from its owner's cache
        self.owners = (self.owners + [None] * rings)[:rings]  # per ring: a weak reference to its owner, or None

    def _length(self, span: int) -> int:
        """Slots of a ring `span` positions past the sinks: whole blocks of the keys' layout, two at least
        (ring_package); the slots past sinks + span hold no position."""
        return max(2, -(-(self.sinks + span) // ring_graph.BLOCK)) * ring_graph.BLOCK

    def slot(self, p: torch.Tensor) -> torch.Tensor:
        """Ring slots of positions p (int64)."""
        return torch.where(p < self.sinks, p, self.sinks + (p - self.sinks) % self.span)

    def _put(self, rings, s: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values into slots s of `rings` (an index or a tensor of them, one a slot).

        # rings int, s: [N], k/v: [Lyr, Hkv, N, D]; or rings/s: [B], k/v: [B, Lyr, Hkv, D]
        """
        blk = ring_graph.BLOCK
        self.k.transpose(-1, -2)[rings, :, :, s // blk, s % blk] = k  # [C, Lyr, Hkv, R / BLOCK, BLOCK, D] view
        self.v.transpose(-1, -2)[rings, :, :, s] = v  # [C, Lyr, Hkv, R, D] view

    def kv(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring r's keys and values slot by slot. # -> k, v: [Lyr, Hkv, R, D] bf16 (copies)"""
        k = self.k[r].transpose(-1, -2)  # [Lyr, Hkv, R / BLOCK, BLOCK, D]
        return k.reshape(*k.shape[:2], -1, k.shape[-1]), self.v[r].transpose(-1, -2).clone()

    def warm(self, batched: bool = False) -> None:
        """The graph for one sequence a call, and with `batched` for several: loaded from the cache, else built (progress
        on stderr)."""
        for rows in _ROWS[batched]:
            if self._fn(rows) is None:
                t0 = time.perf_counter()
                setattr(self, "fn" if rows == 1 else "fn_rows", self._package(rows))
                self.compile_seconds = (self.compile_seconds or 0.0) + time.perf_counter() - t0

    @property
    def batched(self) -> bool:
        """Warmed for several sequences a call too."""
        return self.fn_rows is not None

    def cached(self, batched: bool = False) -> bool:
        """Whether warm(batched) needs no build: each graph it needs is loaded, or its package is in the cache."""
        return all(self._fn(rows) is not None or self._path(rows).is_file() for rows in _ROWS[batched])

    def _fn(self, rows: int):
        return self.fn if rows == 1 else self.fn_rows

    @property
    def graph(self) -> Graph:
        """The graph a package is built from: its layers in self.bits, a copy of the model's where fwd's differ (made
        only to build, never to name or load a package)."""
        if self._graph is None:
            self._graph = Graph(self.fwd if self.bits == self.fwd.bits else TorchForward(self.dec, self.bits)).eval()
        return self._graph

    def _path(self, rows: int):
        if rows not in self._paths:  # the name hashes the weights: once a forward
            self._paths[rows] = ring_package.path(self.fwd, self.bits, rows, self._length(self.full))
        return self._paths[rows]

    def _package(self, rows: int):
        where = self._path(rows)
        fn = aot_package.load(where)
        if fn is None:  # ring_package.build says so on stderr
            example = self._example(1 if rows == 1 else 2)
            fn = ring_package.build(self.graph, example, rows, self._length(self.full), where)
            self.built += 1
            if self.bits != self.fwd.bits:  # the package holds its own copy of the layers: drop ours
                self._graph = None
        return fn

    def _example(self, B: int) -> tuple:
        """Inputs of the graph's shapes for B sequences, its rings the longest (zeros: the export traces shapes, not
        values; inductor sizes its loops' threads by these, so a short ring would leave the softmax on one)."""
        H, D = self.dec.layers[0].o.weight.shape[0], self.dec.head_dim
        head = self.fwd.rows  # [V, H]
        R = self._length(self.full)
        with torch.inference_mode():
            k = torch.zeros((B, *self.k.shape[1:3], R // ring_graph.BLOCK, D, ring_graph.BLOCK), dtype=BF16)
            v = torch.zeros((B, *self.v.shape[1:4], R), dtype=BF16)
            cos = torch.ones((B, 1, D), dtype=BF16)
            return (torch.zeros((B, H), dtype=BF16), cos, torch.zeros_like(cos), k, v,
                    torch.zeros((B, v.shape[-1])), torch.zeros((B, head.shape[0]), dtype=torch.int32),
                    torch.ones((B, 1)), torch.ones((B, 1)), head)

    def start(self) -> None:
        """Forget every sequence: one empty ring of the first size."""
        self.owners: list = []
        self._alloc(min(SPAN_STEP, self.full), 1)

    @torch.inference_mode()
    def begin(self, caches: list, positions: list[int], k: int, owners: list | None = None) -> None:
        """A draft of k tokens for each sequence: its root at positions[b], over caches[b] (anything with k, v
        [Lyr, Hkv, S, D] and length), in the ring of owners[b] (default: the cache itself)."""
        owners = caches if owners is None else owners
        self._free()
        rows = [self._ring(o, c) for o, c in zip(owners, caches)]
        need, span = max(c.length for c in caches) + k, self.span
        if span < self.full and need > self.sinks + span:  # a draft would wrap: longer rings, synced anew
            span = min(-(-(need - self.sinks) // SPAN_STEP) * SPAN_STEP, self.full)
        if span != self.span:
            self._alloc(span, len(self.owners))
        for r, c in zip(rows, caches):
            self._sync(r, c)
        self.rows = torch.tensor(rows)
        self.whole = rows == list(range(len(self.owners)))  # the drafting rings are the buffer as it is: no gather
        self.lengths = torch.tensor([c.length for c in caches])
        self.fwd.begin(caches, positions, k)  # cos/sin of the draft's positions

    def _ring(self, owner, cache) -> int:
        """The ring of `owner` (a new or emptied one for a new sequence: a new owner, or its cache refilled)."""
        for r, ref in enumerate(self.owners):
            if ref is not None and ref() is owner:
                if cache.length < self.upto[r]:  # the cache was emptied and refilled: a new sequence
                    self._clear(r)
                return r
        r = next((r for r, ref in enumerate(self.owners) if ref is None), None)
        if r is None:
            r = len(self.owners)
            self._alloc(self.span, r + 1)  # one ring more (every ring synced anew)
        self.owners[r] = weakref.ref(owner)
        self._clear(r)
        return r

    def _clear(self, r: int) -> None:
        self.pos[r] = -1
        self.upto[r] = 0

    def _free(self) -> None:
        """Drop the rings whose owners are gone, moving the last rings into their places (one slice stays in use); none
        left: start()."""
        live = [r for r, ref in enumerate(self.owners) if ref is not None and ref() is not None]
        if len(live) == len(self.owners):
            return
        if not live:  # a new sequence starts short: the rings' first size (every call attends over the whole span)
            self.start()
            return
        for dst, src in enumerate(live):
            if dst != src:
                self.k[dst], self.v[dst], self.pos[dst] = self.k[src], self.v[src], self.pos[src]
                self.upto[dst], self.owners[dst] = self.upto[src], self.owners[src]
        n = len(live)
        self.k, self.v, self.pos = self.k[:n].clone(), self.v[:n].clone(), self.pos[:n].clone()
        self.upto, self.owners = self.upto[:n], self.owners[:n]

    def _sync(self, r: int, cache) -> None:
        """Copy the committed positions ring r lacks (the sinks and those the window can still read)."""
        n = cache.length
        lo = max(self.upto[r], n - self.window)
        head, tail = (self.upto[r], min(self.sinks, n)), (max(lo, self.sinks), n)
        p = torch.cat([torch.arange(a, b) for a, b in (head, tail) if a < b] or [torch.zeros(0, dtype=torch.long)])
        if p.numel():
            s = self.slot(p)
            self._put(r, s, cache.k[:, :, p].to(BF16), cache.v[:, :, p].to(BF16))
            self.pos[r, s] = p
        self.upto[r] = n

    def visible(self, r: int, n: int) -> torch.Tensor:
        """# -> [R] bool: the slots of ring r the token at position n attends besides itself (TorchForward's: the
        sinks and the positions of the last WINDOW before it)"""
        return self._visible(self.pos[r], torch.tensor(n))

    def _visible(self, p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return (p >= 0) & (p < n) & ((p < self.sinks) | (p >= n + 1 - self.window))

    @torch.inference_mode()
    def candidates(self, i: int, tokens: list[int], counts: list, thetas: list[float], belows: list[float]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's draft candidates after its i-th token (quant_torch.rescore's rule on ring_graph.CANDIDATES).

        # counts[b]: [V] int32 or None -> logits [B, C] float32 (-inf: not a candidate), ids [B, C] long ascending
        """
        B, rows = len(tokens), self.rows
        n = self.lengths + i  # [B] these tokens' positions
        K, V = (self.k, self.v) if self.whole else (self.k[rows], self.v[rows])  # ring_graph.Graph's layouts
        mask = torch.zeros(B, V.shape[-1]).masked_fill_(~self._visible(self.pos[rows], n[:, None]), float("-inf"))
        x = self.dec.embed(torch.tensor(tokens)).to(BF16)  # [B, H]
        cos, sin = (t[:, i].contiguous() for t in (self.fwd.cos, self.fwd.sin))  # [B, 1, D]
        head = self.fwd.rows  # [V, H]
        table = torch.stack([head.new_zeros(head.shape[0], dtype=torch.int32) if c is None else c for c in counts])
        theta, below = (torch.tensor(t, dtype=torch.float32)[:, None] for t in (thetas, belows))  # [B, 1]
        logits, ids, k, v = self._call((x, cos, sin, K, V, mask, table, theta, below), head)
        s = self.slot(n)
        self._put(rows, s, k, v)
        self.pos[rows, s] = n
        self.calls += B
        return logits, ids

    def _call(self, args: tuple, head: torch.Tensor) -> tuple:
        """The graph over these inputs' B sequences (and the model's head rows): the one-sequence graph for one, else
        the several-rows one, in calls of at most MAX_ROWS."""
        if args[0].shape[0] == 1:
            return self.fn(*args, head)
        if self.fn_rows is None:  # the one-sequence package takes one row, and does not check
            raise RuntimeError("the compiled draft was warmed for one sequence a call, not several")
        outs = []
        for a in range(0, args[0].shape[0], ring_package.MAX_ROWS):
            part = tuple(t[a : a + ring_package.MAX_ROWS] for t in args)
            outs.append(self._fn(1 if part[0].shape[0] == 1 else 0)(*part, head))
        return outs[0] if len(outs) == 1 else tuple(torch.cat(parts) for parts in zip(*outs))


def ring_of(fwd: TorchForward) -> RingForward:
    """The compiled draft of a TorchForward (in quant_torch.compiled_bits), built once per forward; not warmed."""
    if not hasattr(fwd, "_specrun_ring"):
        fwd._specrun_ring = RingForward(fwd, quant_torch.compiled_bits(fwd))
    return fwd._specrun_ring


def ring_forward(fwd: TorchForward, batched: bool = False) -> RingForward:
    """ring_of(fwd) warmed for one sequence a call, and with `batched` for several."""
    ring = ring_of(fwd)
    ring.warm(batched)
    return ring
