"""Attention for a forward over packed sequences in the paged pool, behind one switch: sdpa | dense | paged | flashinfer.

`sdpa` (the reference) attends each sequence as a solo run does (same kernel, same operand shapes: bit-identical on
CPU); `dense` attends them all in one batched matmul (dense_attention.py; exact up to rounding, the CPU default in bf16);
`paged` interprets the plan arrays flashinfer takes, in torch; `flashinfer` hands the same plan to flashinfer. On CPUs
where our kernels run, `sdpa` and `dense` forwards of one-page sequences run their layers in one call instead
(cpu_layers.py: each row as its solo run computes it, bf16 included).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specrun.decoding.choices import PAGED_BACKENDS
from specrun.decoding.forward.dense_attention import Dense, attend_dense, dense_rows
from specrun.decoding.forward.paged_kv import PagePool, gather_slots, gather_tokens
from specrun.decoding.forward.plan import BatchPlan

REDUCED = (torch.bfloat16, torch.float16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # head sizes its prefill kernels are built for


def check_paged_backend(name: str) -> None:
    if name != "auto" and name not in PAGED_BACKENDS:
        raise ValueError(f"unknown batched attention backend {name!r}; choose from auto, {', '.join(PAGED_BACKENDS)}")


@functools.cache
def flashinfer_available() -> bool:
    """Whether flashinfer imports here (installed is not enough: a missing dependency fails at import)."""
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 (any import failure means: not usable here)
        return False
    return True


def resolve_backend(name: str, dtype: torch.dtype, device, head_dim: int | None = None) -> str:
    """auto: `flashinfer` on CUDA in reduced precision where it is installed and takes the head size (one call a layer
    for the whole batch: 3.6x sdpa's aggregate at 32 sequences of an 8B shape on an H200); `dense` on CPU in reduced
    precision; else `sdpa`, which keeps float32 sequences bit-for-bit their solo runs. Where our CPU kernels run,
    sdpa and dense take the one-call layers for one-page sequences (each row its solo values); elsewhere dense attends
    every sequence in one call (~2x faster than a call per sequence, exact up to rounding)."""
    check_paged_backend(name)
    if name != "auto":
        return name
    kind = torch.device(device).type
    if kind == "cuda" and dtype in REDUCED and head_dim in FLASHINFER_HEAD_DIMS and flashinfer_available():
        return "flashinfer"
    return "dense" if kind == "cpu" and dtype in REDUCED else "sdpa"


@dataclass(frozen=True)
class _Span:
    """One sequence of a packed forward as the sdpa backend reads it, worked out once per forward (not per layer)."""

    a: int  # its query rows [a, b)
    b: int
    S: int  # keys it sees (committed + new)
    pages: torch.Tensor | int  # its page ids, or the id of the one page holding all of them (CPU jobs)
    mask: torch.Tensor | None  # [1, 1, G*T, S] bool, None for one new token (it sees every key)


def sdpa_spans(plan: BatchPlan, G: int, device, skip: frozenset = frozenset()) -> list[_Span]:
    """Per sequence (but those in skip) its rows, keys and the solo path's mask (prefix visible, tree mask on the new
    tokens, repeated for G query heads per KV head)."""
    spans = []
    for i in range(plan.batch_size):
        if i in skip:
            continue
        a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        T, S, pages = b - a, plan.kv_len(i), plan.pages(i)
        mask = None
        if T > 1:
            mask = torch.ones((T, S), dtype=torch.bool, device=device)
            mask[:, S - T :] = plan.tree_masks[i].to(device)
            mask = (mask.repeat(G, 1) if G > 1 else mask)[None, None]
        spans.append(_Span(a, b, S, int(pages[0]) if pages.shape[0] == 1 else pages, mask))
    return spans


def attend_sdpa(spans: list[_Span], k_store, v_store, q: torch.Tensor, scaling, out: torch.Tensor | None = None):
    """Per sequence, exactly the solo path (decoding/forward/attention.py): GQA folded into the query axis, the prefix visible.

    # q: [Ntok, Hq, D], spans: sdpa_spans(plan, Hq // Hkv) -> out: [Ntok, Hq, D] (the spans' rows written)
    """
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_store.shape[1]
    G = Hq // Hkv
    out = torch.empty_like(q) if out is None else out
    for sp in spans:
        keys, values = gather_tokens(k_store, sp.pages, sp.S), gather_tokens(v_store, sp.pages, sp.S)
        T = sp.b - sp.a
        qg = q[sp.a : sp.b].transpose(0, 1).reshape(1, Hkv, G * T, D)
        o = F.scaled_dot_product_attention(qg, keys[None], values[None], attn_mask=sp.mask, scale=scaling)
        out[sp.a : sp.b] = o.reshape(Hq, T, D).transpose(0, 1)
    return out


def attend_selected(plan: BatchPlan, k_store, v_store, q: torch.Tensor, scaling, selects: list, layer: int):
    """A self-draft forward: one new token per sequence against its partial cache (the slots its select lists per KV
    head, then itself), or against every key where its select is None; as the solo path attends (attention.py).

    # q: [N, Hq, D], selects[i]: [Lyr, Hkv, B] token indices or None -> [N, Hq, D]
    """
    N, Hq, D = q.shape
    Hkv = k_store.shape[1]
    out = torch.empty_like(q)
    for i in range(plan.batch_size):
        S, pages = plan.kv_len(i), plan.pages(i)
        if selects[i] is None:
            keys, values = gather_tokens(k_store, pages, S), gather_tokens(v_store, pages, S)
        else:
            sel = selects[i][layer]  # [Hkv, B]
            idx = torch.empty((Hkv, sel.shape[1] + 1), dtype=torch.long, device=sel.device)
            idx[:, :-1], idx[:, -1] = sel, S - 1
            keys, values = gather_slots(k_store, pages, idx), gather_slots(v_store, pages, idx)
        qg = q[i : i + 1].transpose(0, 1).reshape(1, Hkv, Hq // Hkv, D)
        out[i] = F.scaled_dot_product_attention(qg, keys[None], values[None], scale=scaling).reshape(Hq, D)
    return out


def attend_paged(plan: BatchPlan, k_store, v_store, q: torch.Tensor, scaling) -> torch.Tensor:
    """The plan read as flashinfer reads it: pages via kv_indptr/kv_indices/last_page_len, the packed custom mask.

    # q: [Ntok, Hq, D] -> [Ntok, Hq, D]
    """
    Hq, D = q.shape[1], q.shape[2]
    G = Hq // k_store.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = D**-0.5 if scaling is None else scaling
    out = torch.empty_like(q)
    for i in range(plan.batch_size):
        a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        S = plan.kv_len(i)
        keys = gather_tokens(k_store, plan.pages(i), S).repeat_interleave(G, dim=0).to(acc)  # [Hq, S, D]
        values = gather_tokens(v_store, plan.pages(i), S).repeat_interleave(G, dim=0).to(acc)
        s = torch.matmul(q[a:b].transpose(0, 1).to(acc), keys.transpose(1, 2)) * scale  # [Hq, T, S]
        mask = plan.mask(i)
        if mask is not None:
            s = s.masked_fill(~mask.to(q.device), float("-inf"))
        out[a:b] = torch.matmul(s.softmax(dim=-1), values).transpose(0, 1).to(q.dtype)
    return out


@dataclass
class FlashInferAttention:
    """flashinfer's BatchPrefillWithPagedKVCacheWrapper over the pool (HND layout): planned once per forward."""

    device: torch.device
    workspace_mb: int = 128
    _wrapper: object = field(default=None, repr=False)

    def plan(self, plan: BatchPlan, n_q: int, n_kv: int, head_dim: int, dtype, scaling) -> None:
        if self._wrapper is None:
            try:
                import flashinfer
            except ImportError as e:
                raise RuntimeError("the flashinfer attention backend needs flashinfer: pip install 'specrun[cuda]'") from e
            workspace = torch.zeros(self.workspace_mb << 20, dtype=torch.uint8, device=self.device)
            # FA2: it takes custom (tree) masks, and its one JIT module per dtype and head size serves every mask
            # mode (auto picks FA3 on Hopper for unmasked batches: a second, slower compile)
            self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", backend="fa2")
        dev = self.device
        self._wrapper.plan(
            plan.qo_indptr.to(dev), plan.kv_indptr.to(dev), plan.kv_indices.to(dev), plan.kv_last_page_len.to(dev),
            n_q, n_kv, head_dim, plan.page_size,
            packed_custom_mask=None if plan.mask_packed is None else plan.mask_packed.to(dev),
            causal=False, sm_scale=scaling, q_data_type=dtype, kv_data_type=dtype,
        )
        if plan.mask_packed is not None:
            # flashinfer (0.7.2) given a packed mask plans its offsets in bits (qo_len x kv_len summed), where the kernel
            # reads bytes: every sequence after the first read another's mask bits (seen on an H200). Ours are bytes.
            self._wrapper._mask_indptr_buf = plan.mask_indptr.to(dev)

    def run(self, k_store, v_store, q: torch.Tensor) -> torch.Tensor:
        """# q: [Ntok, Hq, D], stores: [Pg, Hkv, P, D] -> [Ntok, Hq, D]"""
        return self._wrapper.run(q, (k_store, v_store))


@dataclass
class BatchContext:
    """What one packed forward needs beyond the weights: the pool, the plan, the backend (decoder calls attend)."""

    pool: PagePool
    plan: BatchPlan
    backend: str = "sdpa"
    flashinfer: FlashInferAttention | None = None
    selects: list | None = None  # a self-draft forward: per sequence its partial cache [Lyr, Hkv, B] or None
    queries: list | None = None  # when a list, each layer appends its q [N, Hq, D] (for KV importance)
    _spans: list | None = None  # sdpa/dense: per-sequence rows, keys and masks, worked out at the first layer
    _dense: Dense | None = None  # dense: the sequences attended together

    def whole_layer_spans(self) -> list[tuple[int, int, int, int, torch.Tensor | None]] | None:
        """Where cpu_layers may run this forward's layers in one call (CpuLayers.batch): `sdpa` or `dense` (there both
        become each row as its solo run computes it), every sequence on one page (CPU jobs), no partial caches. Then per
        sequence (its page, first row, rows, committed tokens, tree mask or None for one row); else None."""
        if self.selects is not None or self.backend not in ("sdpa", "dense"):
            return None
        plan, spans = self.plan, []
        for i in range(plan.batch_size):
            pages, T = plan.pages(i), plan.qo_len(i)
            if pages.shape[0] != 1:
                return None
            spans.append((int(pages[0]), int(plan.qo_indptr[i]), T, plan.kv_len(i) - T,
                          None if T == 1 else plan.tree_masks[i]))
        return spans

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling):
        """Write the new tokens' K/V into their pages, then attend. # q: [1, Hq, N, D], k/v: [1, Hkv, N, D] -> [1, N, Hq, D]"""
        k_store, v_store = self.pool.k[layer], self.pool.v[layer]  # [Pg, Hkv, P, D]
        pages, offsets = self.plan.write_pages, self.plan.write_offsets
        k_store[pages, :, offsets] = k[0].transpose(0, 1)  # [N, Hkv, D]
        v_store[pages, :, offsets] = v[0].transpose(0, 1)
        qn = q[0].transpose(0, 1)  # [N, Hq, D]
        if self.queries is not None:
            self.queries.append(qn)
        if self.selects is not None:  # every backend: drafts only propose, and flashinfer has no per-head slot lists
            out = attend_selected(self.plan, k_store, v_store, qn, scaling, self.selects, layer)
        elif self.backend == "flashinfer":
            out = self.flashinfer.run(k_store, v_store, qn.contiguous())
        elif self.backend == "paged":
            out = attend_paged(self.plan, k_store, v_store, qn, scaling)
        else:
            if self._spans is None:
                G = q.shape[1] // k.shape[1]
                self._dense = dense_rows(self.plan, k.shape[1], G, q.device) if self.backend == "dense" else None
                skip = self._dense.members if self._dense is not None else frozenset()
                self._spans = sdpa_spans(self.plan, G, q.device, skip)
            out = attend_sdpa(self._spans, k_store, v_store, qn, scaling)
            if self._dense is not None:
                attend_dense(self._dense, k_store, v_store, qn, scaling, out)
        return out[None]
