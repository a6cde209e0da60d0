"""The compiled draft's graph (ring_graph.Graph) as an AOTInductor package in the specrun cache (aot_package.py):
built once per machine and model (1-3 minutes for smollm2: 3 where its layers are 8-bit, autotuned), then loaded by
any later process in about a second.

path(fwd, bits, rows) names the package of a draft's graph for one sequence a call (rows 1) or several (rows
0) without making its low-bit copy; build() exports and compiles it. A package is a proposal-maker only (I1): a wrong
one would cost speed, never output; its name covers the weights, the code that traces it, torch, the CPU and its
threads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from specrun.decoding.drafters import ring_graph
from specrun.decoding.forward import aot_package
from specrun.models.cache import cache_root

MAX_ROWS = 1024  # sequences in one call of the several-rows package (an engine's concurrency; more: split)
PREFIX = "draft"
# the modules whose code the graph runs: a change to any of them names a new package
SOURCES = ("quant_ring.py", "ring_graph.py", "quant_torch.py", "../forward/decoder.py", "../forward/quant.py",
           "ring_package.py", "../forward/aot_package.py")


class _Source(torch.nn.Module):
    """The model weights a draft package's low-bit copy is made from, as buffers (no copies): what its name hashes,
    so a cache check needs no copy of the model in the package's bits."""

    def __init__(self, dec):
        super().__init__()
        for i, L in enumerate(dec.layers):
            for part in ("qkv", "o", "gate_up", "down"):
                lin = getattr(L, part)
                self.register_buffer(f"l{i}_{part}", lin.weight)
                self.register_buffer(f"l{i}_{part}_bias", lin.bias)
            for part in ("ln1", "ln2", "q_norm", "k_norm"):
                norm = getattr(L, part)
                self.register_buffer(f"l{i}_{part}", None if norm is None else norm.weight)
        self.register_buffer("norm", dec.norm.weight)
        self.register_buffer("head", dec.lm_head.weight)


def package_name(fwd, bits: int, rows: int, max_keys: int) -> str:
    """A name for the package of fwd's graph in `bits` (aot_package.name): the model's weights, the bits, shapes and
    constants, the inductor options, the traced code."""
    dec = fwd.dec
    layers = [(L.scaling, aot_package.act_id(L.act), L.ln1.eps, L.ln2.eps,
               *(n if n is None else n.eps for n in (L.q_norm, L.k_norm))) for L in fwd.layers]
    return aot_package.name(PREFIX, "1" if rows == 1 else "n", Path(__file__).parent, SOURCES, _Source(dec), rows,
                            max_keys, ring_graph.BLOCK, bits, dec.n_q, dec.n_kv, dec.head_dim, dec.inter, layers,
                            fwd.norm.eps, ring_graph.options(bits))


def path(fwd, bits: int, rows: int, max_keys: int) -> Path:
    """Where the package of fwd's graph in `bits` for `rows` sequences a call (1, or 0: any number up to MAX_ROWS)
    lives."""
    return cache_root() / "drafts" / package_name(fwd, bits, rows, max_keys)


def build(graph: torch.nn.Module, example: tuple, rows: int, max_keys: int, where: Path):
    """Export graph at the example's shapes (the keys dynamic up to max_keys, a multiple of ring_graph.BLOCK, and the
    sequences where rows is 0) and write its package (aot_package.write), with progress on stderr; returns the loaded
    callable."""
    print(f"specrun: compiling the {graph.bits}-bit self-draft for {'one sequence' if rows == 1 else 'several'} a call "
          f"(AOTInductor, 1-3 minutes once per machine and model; cached in {where.parent})", file=sys.stderr,
          flush=True)
    # the keys' blocks of slots: a ring holds at least two (export fixes a dimension of size 1)
    blocks = torch.export.Dim("RB", min=2, max=max(3, max_keys // ring_graph.BLOCK))
    keys = ring_graph.BLOCK * blocks
    seqs = torch.export.Dim.STATIC if rows == 1 else torch.export.Dim("B", min=2, max=MAX_ROWS)
    dims = {"x": {0: seqs}, "cos": {0: seqs}, "sin": {0: seqs}, "K": {0: seqs, 3: blocks}, "V": {0: seqs, 4: keys},
            "mask": {0: seqs, 1: keys}, "counts": {0: seqs}, "theta": {0: seqs}, "below": {0: seqs}, "rows": None}
    with torch.inference_mode():
        program = torch.export.export(graph, example, dynamic_shapes=dims)
    return aot_package.write(program, dict(graph.options), where, PREFIX)
