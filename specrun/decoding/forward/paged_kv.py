"""Paged KV pool: one preallocated K/V store per worker in pages of P tokens, and a page table per sequence.

Admission reserves every page a sequence can ever hold (prompt + max_tokens + the widest trie), so no step runs out of
memory late in a generation; with P = 1, committing a verify forward's accepted nodes is a table edit, never a copy.
"""

from __future__ import annotations

import torch


def gather_tokens(store: torch.Tensor, pages: torch.Tensor | int, n: int) -> torch.Tensor:
    """A sequence's first n tokens of one layer, contiguous per head; pages: its page ids, or its one page's id.

    # store: [Pg, Hkv, P, D] -> [Hkv, n, D]"""
    if isinstance(pages, int) or pages.shape[0] == 1:  # one page per sequence (as on CPU): a view, nothing copied
        return store[int(pages if isinstance(pages, int) else pages[0]), :, :n]
    x = store[pages.long()]  # [pages, Hkv, P, D]
    return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])[:, :n]


def gather_slots(store: torch.Tensor, table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per KV head its own token indices of a sequence, wherever their pages are (no copy of the whole sequence).

    # store: [Pg, Hkv, P, D], table: [pages] page ids, idx: [Hkv, B] token indices -> [Hkv, B, D]
    """
    P = store.shape[2]
    heads = torch.arange(idx.shape[0], device=idx.device)[:, None]
    return store[table.to(idx.device).long()[idx // P], heads, idx % P]


class PagePool:
    def __init__(self, n_layers: int, n_pages: int, page_size: int, n_kv_heads: int, head_dim: int, dtype, device):
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"a KV pool needs pages >= 1 and page_size >= 1 (got {n_pages}, {page_size})")
        shape = (n_layers, n_pages, n_kv_heads, page_size, head_dim)  # flashinfer's HND layout, per layer
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [Lyr, Pg, Hkv, P, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self._free = list(range(n_pages - 1, -1, -1))  # a stack: recently freed pages are reused first
        self._promised = 0  # pages reserved by admitted sequences and not yet taken

    @property
    def n_pages(self) -> int:
        return self.k.shape[1]

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    @property
    def available(self) -> int:
        """Pages neither used nor promised: what admission can still hand out."""
        return len(self._free) - self._promised

    def admit(self, n_tokens: int) -> SeqPages | None:
        """A page table that can always grow to n_tokens, or None when the pool cannot promise that many pages."""
        need = self.pages_for(n_tokens)
        if need > self.available:
            return None
        self._promised += need
        return SeqPages(self, need)

    def _take(self) -> int:
        self._promised -= 1
        return self._free.pop()

    def _give_back(self, pages: list[int], keep_promised: bool) -> None:
        self._free.extend(pages)
        if keep_promised:
            self._promised += len(pages)


class SeqPages:
    """A sequence's pages: page i holds its tokens [i*P, (i+1)*P); tokens [0, length) are committed."""

    def __init__(self, pool: PagePool, promised: int):
        self.pool = pool
        self.promised = promised  # pages this sequence may still take
        self._table = torch.empty(promised, dtype=torch.int32)  # [Pg_max] page ids; the first n_pages are held
        self.n_pages = 0
        self.length = 0

    def ensure(self, n_tokens: int) -> None:
        """Hold pages for tokens [0, n_tokens): a forward writes its new tokens after the committed ones."""
        need = self.pool.pages_for(n_tokens) - self.n_pages
        if need > self.promised:
            raise RuntimeError(f"sequence needs {n_tokens} KV slots, beyond what was reserved at admission")
        for _ in range(need):
            self._table[self.n_pages] = self.pool._take()
            self.n_pages += 1
            self.promised -= 1

    def table(self, n_tokens: int) -> torch.Tensor:
        """Page ids covering tokens [0, n_tokens) (a view: no per-step copy of a long table). # -> [Pg] int32"""
        return self._table[: self.pool.pages_for(n_tokens)]

    def slots(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where tokens [start, end) live. # -> page ids, offsets in page: [end - start] long each"""
        idx = torch.arange(start, end)
        return self._table[idx // self.pool.page_size].long(), idx % self.pool.page_size

    def commit(self, offsets: torch.Tensor) -> None:
        """Keep the forward's tokens length+offsets (ascending) as the next committed ones; free what is left over.

        # offsets: [A] long on any device, offsets[0] == 0 (the root)
        """
        offsets = offsets.cpu()  # the page table lives on the CPU; a CUDA path indexed it and crashed (seen on an H200)
        a, start = offsets.shape[0], self.length
        if self.pool.page_size == 1:  # reorder the table: accepted nodes' pages become the next ones, no K/V copy
            fresh = self._table[start : self.n_pages].clone()
            self._table[start : start + a] = fresh[offsets]
            rejected = torch.ones(fresh.shape[0], dtype=torch.bool)
            rejected[offsets] = False
            self._table[start + a : self.n_pages] = fresh[rejected]
        elif int(offsets[-1]) != a - 1:  # not already in place (ascending from 0, so last == a-1 means 0..a-1)
            # move at most depth rows into place (the right side is gathered before the write: overlap is safe)
            src_pages, src_off = self.slots(start, start + int(offsets[-1]) + 1)
            dst_pages, dst_off = self.slots(start, start + a)
            src_pages, src_off = src_pages[offsets], src_off[offsets]
            for store in (self.pool.k, self.pool.v):
                store[:, dst_pages, :, dst_off] = store[:, src_pages, :, src_off]
        self.length += a
        self._trim()

    def append(self, n: int) -> None:
        """Commit n tokens written in order (prefill)."""
        self.length += n
        self._trim()

    def _trim(self) -> None:
        """Pages past the committed tokens go back to the pool, still promised: the next forward may need them."""
        keep = self.pool.pages_for(self.length)
        freed = self._table[keep : self.n_pages].tolist()
        self.pool._give_back(freed, keep_promised=True)
        self.promised += len(freed)
        self.n_pages = keep

    @property
    def n_layers(self) -> int:
        return self.pool.k.shape[0]

    def keys_values(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Its first n tokens' K and V at one layer, as KVCache.keys_values gives them. # -> [Hkv, n, D] each"""
        table = self.table(n)
        return gather_tokens(self.pool.k[layer], table, n), gather_tokens(self.pool.v[layer], table, n)

    def page_view(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Its K and V of every layer as views [Lyr, Hkv, P, D] where one page holds all it can ever hold (CPU: one page
        a sequence); else None."""
        if self.n_pages + self.promised != 1 or self.n_pages != 1:
            return None
        page = int(self._table[0])
        return self.pool.k[:, page], self.pool.v[:, page]

    def release(self) -> None:
        """The sequence is done: every page and every promise goes back to the pool."""
        self.pool._give_back(self._table[: self.n_pages].tolist(), keep_promised=False)
        self.pool._promised -= self.promised
        self.n_pages, self.promised, self.length = 0, 0, 0
