"""How many sequences a worker runs at once: the KV memory its device can give, over what one sequence needs.

A sequence is admitted only with its whole KV reserved (decoding/forward/paged_kv.py), so N is fixed once, at load.
"""

from __future__ import annotations

from pathlib import Path

import torch

AUTO_MAX = {"cpu": 16, "cuda": 16}  # --concurrency auto never goes past: per-step Python work grows with N (CPU,
# smollm2 bf16, 32 sampled prompts: 8 / 16 / 32 at once gave 365-393 / 452-463 / 507-516 tok/s)
CUDA_RESERVE = 0.10  # of the GPU's total memory, kept for activations, logits and the allocator's slack
CPU_SHARE = 0.5  # of the memory available now, split between the CPU workers (the rest: the OS, the driver, Ray)
GiB = 2**30


def kv_budget_bytes(device: str, workers: int, cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes this worker may give its KV pool, measured after the model is loaded.

    CUDA: free memory minus a reserve (one worker per GPU). CPU: half of what is available (the container's limit
    where lower), split between `workers` (the run's CPU workers, counted as if they all shared this machine).
    """
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return max(0, int(free - CUDA_RESERVE * total))
    return int(CPU_SHARE * _cpu_available(cgroup) / max(1, workers))


def _cpu_available(cgroup: Path) -> int:
    available = _meminfo_available()
    try:  # cgroup v2: a container's limit is not in /proc/meminfo
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(0, available)


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # no /proc (macOS): free pages


def fit_concurrency(cap: int, need_tokens: int, bytes_per_token: int, budget: int, extra: int = 0) -> int:
    """Most sequences (1..cap) whose whole KV (need_tokens each) and `extra` bytes each (the draft's window) fit in
    budget bytes; at least 1 (a sequence that does not fit alone fails at admission, naming its need)."""
    per_sequence = need_tokens * bytes_per_token + extra
    return max(1, min(cap, budget // max(1, per_sequence)))


def check_concurrency(n: int, need_tokens: int, bytes_per_token: int, budget: int, extra: int = 0) -> None:
    """A --concurrency N that cannot hold N sequences' KV (and `extra` bytes each) fails at load, with both sizes,
    instead of mid-run."""
    want = n * (need_tokens * bytes_per_token + extra)
    if want > budget:
        window = f", and each a {extra / 2**20:.0f} MiB window of the 4-bit draft" if extra else ""
        raise ValueError(f"--concurrency {n} needs {want / GiB:.2f} GiB of KV ({n} x {need_tokens} tokens, the job's "
                         f"longest prompt + max_tokens{window}) but this worker can give {budget / GiB:.2f} GiB: lower "
                         f"--concurrency or max_tokens, or leave --concurrency auto")


def draft_window_bytes(lm, config, need: int) -> int:
    """What each sequence's 4-bit draft takes beside its KV: its window (kernel_window.py) where it drafts on our
    kernels; 0 where it does not draft or reads the KV pages themselves (torch's int4 forward)."""
    from specrun.decoding.drafters.kernel_window import window_bytes
    from specrun.decoding.drafters.quant_draft import KernelForward, quantized
    from specrun.decoding.forward.decoder import FusedDecoder

    if not config.wants_quant or lm.device.type != "cpu":  # a window is our kernels' draft's, and they are the CPU's
        return 0
    dec = FusedDecoder.of(lm.model)
    if not isinstance(quantized(dec), KernelForward):
        return 0
    return window_bytes(len(dec.layers), dec.n_kv, dec.head_dim, need)


def kv_need(longest: int, trie_budget: int) -> int:
    """KV slots one sequence reserves: the longest prompt + max_tokens, and a verify trie beyond it."""
    return longest + trie_budget + 1


def page_size_for(device: str, need: int) -> int:
    """CPU: one page per sequence, so attention reads its keys in place as a solo run does; CUDA: flashinfer's pages."""
    from specrun.decoding.config import BatchConfig

    return BatchConfig(kv_tokens=need).page_tokens(device)


def concurrency_for(lm, config, cap: int, need: int, device: str, workers: int = 1, auto: bool = True) -> int:
    """Sequences at once (1..cap) of `need` KV slots each: checked against (or, auto, fitted to) the KV memory this
    worker can give."""
    from specrun.decoding.forward.paged_runner import kv_bytes_per_token

    if cap == 1:
        return 1
    per_token = kv_bytes_per_token(lm.model.config, lm.dtype)
    budget = kv_budget_bytes(device, workers)
    extra = draft_window_bytes(lm, config, need) if device == "cpu" else 0
    if not auto:
        check_concurrency(cap, need, per_token, budget, extra)
        return cap
    return fit_concurrency(cap, need, per_token, budget, extra)


def engine_for(lm, config, n: int, need: int, page_size: int):
    """The Engine of n sequences at once, each with `need` KV slots reserved in pages of page_size (n == 1: the
    engine of one sequence at a time, its own contiguous cache)."""
    from specrun.decoding.engine import BatchConfig, Engine

    batch = BatchConfig() if n == 1 else BatchConfig(concurrency=n, kv_tokens=n * need, page_size=page_size)
    return Engine(lm, config, batch)
