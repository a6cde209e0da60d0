"""The compiled draft's graph (quant_ring._Graph) as an AOTInductor package in the specrun cache: built once per
machine and model (~1 minute for smollm2), then loaded by any later process in about a second.

path(graph, rows) names the package of a graph for one sequence a call (rows 1) or several (rows 0); load() returns
its callable or None, build() compiles and writes it atomically, then prunes packages long unused. A package is a
proposal-maker only (I1): a wrong one would cost speed, never output; its name covers the weights, the code that traces
it, torch, the CPU and its threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import tempfile
import time
import warnings
import zipfile
from pathlib import Path

import torch

from specrun.models.cache import cache_root

MAX_ROWS = 1024  # sequences in one call of the several-rows package (an engine's concurrency; more: split)
ABANDONED = 3600  # seconds after which a build's temporary file is a killed process's leftover
KEEP = 8  # packages a cache keeps whatever their age (the latest loaded or built: several models, thread counts)
STALE = 14 * 86400  # seconds unused after which a package past the KEEP newest goes (a new specrun, weights or torch
# names new packages; ~90 MB each on smollm2, gigabytes on larger models)
SAMPLE = 1 << 14  # bytes hashed at each of 64 places of a large weight (all of a small one)
# the modules whose code the graph runs: a change to any of them names a new package
SOURCES = ("quant_ring.py", "quant_torch.py", "../forward/decoder.py", "../forward/quant.py", "ring_package.py")


def _host() -> str:
    """The CPU's features, which inductor compiles for (a package built for AVX-512 must not load on AVX2): Linux's
    flags line, else what the platform and ATen's dispatch say; and ATen's capability where set (ATEN_CPU_CAPABILITY
    narrows the instructions inductor and ATen use on the same CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.strip() for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    flags = flags or f"{platform.machine()} {platform.processor()} {torch.backends.cpu.get_cpu_capability()}"
    return f"{flags}\0{os.environ.get('ATEN_CPU_CAPABILITY', '')}"


def _weights_digest(h, graph: torch.nn.Module) -> None:
    for name, t in graph.state_dict().items():
        raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
        h.update(f"{name}\0{tuple(t.shape)}\0{t.dtype}\0".encode())
        if raw.size <= 64 * SAMPLE:
            h.update(raw.tobytes())
        else:
            for i in range(64):
                at = i * (raw.size - SAMPLE) // 63
                h.update(raw[at : at + SAMPLE].tobytes())


def _act(act) -> str:
    """An activation's identity that stays the same across processes (a function's repr holds its address)."""
    return repr(act) if isinstance(act, torch.nn.Module) else f"{act.__module__}.{act.__qualname__}"


def package_name(graph: torch.nn.Module, rows: int, max_keys: int) -> str:
    """A name for graph's package: its weights (sampled), shapes and constants, the traced code, torch and
    transformers, the CPU's features and the threads its loops are compiled for (inductor fixes them at compile time)."""
    import transformers

    h = hashlib.sha256()
    here = Path(__file__).parent
    for src in SOURCES:
        h.update((here / src).read_bytes())
    layers = [(L.scaling, _act(L.act), L.ln1.eps, L.ln2.eps, *(n if n is None else n.eps for n in (L.q_norm, L.k_norm)))
              for L in graph.layers]
    h.update(repr((torch.__version__, transformers.__version__, _host(), torch.get_num_threads(), rows, max_keys,
                   graph.nq, graph.nkv, graph.D, graph.inter, layers, graph.norm.eps, graph.options)).encode())
    _weights_digest(h, graph)
    return f"draft-{'1' if rows == 1 else 'n'}-{h.hexdigest()[:20]}.pt2"


def path(graph: torch.nn.Module, rows: int, max_keys: int) -> Path:
    """Where graph's package for `rows` sequences a call (1, or 0: any number up to MAX_ROWS) lives."""
    return cache_root() / "drafts" / package_name(graph, rows, max_keys)


def load(where: Path):
    """The package's callable (quant_ring._Graph.forward's inputs and outputs), or None where there is none or where the
    file is damaged (removed, to be built again). A sound file that does not load here raises (the caller drafts
    eagerly): another process, or host, may load it."""
    if not where.is_file():
        return None
    try:
        fn = torch._inductor.aoti_load_package(str(where))
    except Exception:
        if _sound(where):
            raise
        where.unlink(missing_ok=True)
        return None
    with contextlib.suppress(OSError):  # its time of last use, which prune() reads
        os.utime(where)
    return fn


def prune(folder: Path, now: float | None = None) -> list[Path]:
    """Remove the packages in folder unused (not loaded nor built) for STALE seconds, past the KEEP most recently used;
    returns those removed. One another process has open stays readable to it (POSIX unlink); one removed before it
    opened it is built again. Marking use needs write access: the cache is its user's own (SPECRUN_CACHE)."""
    now = time.time() if now is None else now
    used = []
    for f in folder.glob("draft-*.pt2"):
        with contextlib.suppress(OSError):
            used.append((f.stat().st_mtime, f))
    removed = []
    for mtime, f in sorted(used, reverse=True)[KEEP:]:
        if now - mtime > STALE:
            with contextlib.suppress(OSError):
                f.unlink()
                removed.append(f)
    return removed


def _sound(where: Path) -> bool:
    try:
        with zipfile.ZipFile(where) as z:
            return z.testzip() is None
    except (OSError, zipfile.BadZipFile):
        return False


def build(graph: torch.nn.Module, example: tuple, rows: int, max_keys: int, where: Path):
    """Export graph at the example's shapes (the keys dynamic up to max_keys, and the sequences where rows is 0),
    compile it ahead of time, load it, and only then put it in place atomically (concurrent builders: the last rename
    wins); builds a process killed left behind are removed."""
    keys = torch.export.Dim("R", min=2, max=max_keys)
    seqs = torch.export.Dim.STATIC if rows == 1 else torch.export.Dim("B", min=2, max=MAX_ROWS)
    dims = {"x": {0: seqs}, "cos": {0: seqs}, "sin": {0: seqs}, "K": {0: seqs, 3: keys}, "V": {0: seqs, 3: keys},
            "mask": {0: seqs, 1: keys}, "counts": {0: seqs}, "theta": {0: seqs}, "below": {0: seqs}, "rows": None}
    with torch.inference_mode():
        program = torch.export.export(graph, example, dynamic_shapes=dims)
    where.parent.mkdir(parents=True, exist_ok=True)
    for old in where.parent.glob(".draft-*"):
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > ABANDONED:
                old.unlink()
    fd, tmp = tempfile.mkstemp(prefix=f".{where.name}.", suffix=".pt2", dir=where.parent)
    os.close(fd)
    try:
        with warnings.catch_warnings():  # torch's own deprecation notices from inside the packaging, not the user's
            warnings.simplefilter("ignore", FutureWarning)
            torch._inductor.aoti_compile_and_package(program, package_path=tmp, inductor_configs=dict(graph.options))
        fn = torch._inductor.aoti_load_package(tmp)  # raises where it does not load: nothing put in place
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, where)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    prune(where.parent)
    return fn
