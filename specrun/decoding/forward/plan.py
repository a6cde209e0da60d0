"""One forward over packed sequences, as data: flashinfer's paged-prefill plan arrays plus where new K/V go.

Built once per forward (not per layer), on the CPU, from each sequence's page table, new-token count and tree mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrun.decoding.forward.paged_kv import SeqPages

_BITS = 2 ** torch.arange(8, dtype=torch.uint8)  # little bit order: element j of a byte is bit j


def packbits(bits: torch.Tensor) -> torch.Tensor:
    """numpy.packbits(bitorder="little") of a 1-D bool tensor (flashinfer's packbits). # [n] bool -> [ceil(n/8)] uint8"""
    n = bits.shape[0]
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits
    return (padded.view(-1, 8) * _BITS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpackbits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of packbits. # [ceil(n/8)] uint8 -> [n] bool"""
    return (packed[:, None] & _BITS.to(packed.device)).ne(0).reshape(-1)[:n]


@dataclass(frozen=True)
class BatchPlan:
    """Sequence i has q rows [qo_indptr[i], qo_indptr[i+1]) and kv tokens on pages kv_indices[kv_indptr[i]:...]
    (the last page holding kv_last_page_len[i] of them); its new tokens are the last q rows' worth of kv tokens.
    """

    qo_indptr: torch.Tensor  # [N+1] int32
    kv_indptr: torch.Tensor  # [N+1] int32
    kv_indices: torch.Tensor  # [sum pages] int32
    kv_last_page_len: torch.Tensor  # [N] int32, 1..P
    page_size: int
    mask_packed: torch.Tensor | None  # uint8, per sequence the [qo_len, kv_len] mask row-major, little bit order
    mask_indptr: torch.Tensor | None  # [N+1] int32 byte offsets (flashinfer's segment_packbits layout)
    tree_masks: tuple[torch.Tensor, ...]  # per sequence [qo_len, qo_len] bool: the new tokens among themselves
    write_pages: torch.Tensor  # [Ntok] long: page of each new token's K/V
    write_offsets: torch.Tensor  # [Ntok] long: its slot in that page

    @property
    def batch_size(self) -> int:
        return self.kv_last_page_len.shape[0]

    def qo_len(self, i: int) -> int:
        return int(self.qo_indptr[i + 1] - self.qo_indptr[i])

    def kv_len(self, i: int) -> int:
        pages = int(self.kv_indptr[i + 1] - self.kv_indptr[i])
        return (pages - 1) * self.page_size + int(self.kv_last_page_len[i])

    def pages(self, i: int) -> torch.Tensor:
        return self.kv_indices[self.kv_indptr[i] : self.kv_indptr[i + 1]]

    def mask(self, i: int) -> torch.Tensor | None:
        """Sequence i's full mask unpacked. # -> [qo_len, kv_len] bool, or None when every row sees every key"""
        if self.mask_packed is None:
            return None
        T, S = self.qo_len(i), self.kv_len(i)
        return unpackbits(self.mask_packed[self.mask_indptr[i] : self.mask_indptr[i + 1]], T * S).view(T, S)


def build_plan(seqs: list[SeqPages], tree_masks: list[torch.Tensor], pack_mask: bool = True) -> BatchPlan:
    """Plan a forward of tree_masks[i].shape[0] new tokens after each sequence's committed ones; takes their pages.

    pack_mask=False leaves out the packed [T, S] masks (O(T x context) bits per sequence), which only the paged and
    flashinfer backends read. # tree_masks: per sequence [T_i, T_i] bool (ancestor-or-self; causal for a prefill)
    """
    P = seqs[0].pool.page_size
    qo, kv, indices, last, writes = [0], [0], [], [], []
    for sp, tm in zip(seqs, tree_masks):
        T = tm.shape[0]
        end = sp.length + T
        sp.ensure(end)
        table = sp.table(end)
        indices.append(table)
        qo.append(qo[-1] + T)
        kv.append(kv[-1] + table.shape[0])
        last.append(end - (table.shape[0] - 1) * P)
        writes.append(sp.slots(sp.length, end))
    needs_mask = pack_mask and any(tm.shape[0] > 1 for tm in tree_masks)
    packed = indptr = None
    if needs_mask:  # a batch of single new tokens sees every key: no mask at all (flashinfer's fast path)
        segments, offsets = [], [0]
        for sp, tm in zip(seqs, tree_masks):
            T, start = tm.shape[0], sp.length
            full = torch.ones((T, start + T), dtype=torch.bool)
            full[:, start:] = tm.cpu()
            segments.append(packbits(full.reshape(-1)))
            offsets.append(offsets[-1] + segments[-1].shape[0])
        packed = torch.cat(segments)
        indptr = torch.tensor(offsets, dtype=torch.int32)
    as32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return BatchPlan(as32(qo), as32(kv), torch.cat(indices), as32(last), P, packed, indptr,
                     tuple(tm.cpu() for tm in tree_masks), torch.cat([w[0] for w in writes]),
                     torch.cat([w[1] for w in writes]))
