"""Our own CPU kernels (cpu_kernels.c: bf16 matrix-vector products with AVX-512 BF16), compiled once per machine.

cpu_kernels() -> CpuKernels | None: None where they cannot run (no avx512_bf16, no C compiler, SPECRUN_CPU_KERNELS=0,
a failed build); callers keep torch's path then. The library is built into the specrun cache, atomically.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from specrun.models.cache import cache_root

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU runs AVX-512 BF16 (vdpbf16ps), read from /proc/cpuinfo (Linux; elsewhere: no)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in f)
    except OSError:
        return False


def build(source: Path, out_dir: Path) -> Path:
    """The shared library of source in out_dir, compiled on first use (named by a hash of source, compiler and flags;
    written under a temporary name and renamed, so concurrent builders and crashes leave no half-written library)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    key = hashlib.sha256(source.read_bytes() + cc.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    final = out_dir / f"{source.stem}-{key}.so"
    if final.is_file():
        return final
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


class CpuKernels:
    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls; OpenMP resolves to torch's loaded runtime
        self._gemv = lib.gemv_bf16
        self._gemv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
        self._gemv.restype = None

    def gemv_bf16(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """# x: [M, K] bf16, w: [N, K] bf16, b: [N] float32 or None -> [M, N] bf16 (float32 accumulation)"""
        x, M, (N, K) = x.contiguous(), x.shape[0], w.shape
        y = torch.empty((M, N), dtype=torch.bfloat16)
        self._gemv(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), M, N, K,
                   torch.get_num_threads())
        return y


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The kernels, built and loaded once per process; None where they cannot run here (see the module doc)."""
    if os.environ.get("SPECRUN_CPU_KERNELS", "1") == "0" or not cpu_has_bf16_dot():
        return None
    try:
        return CpuKernels(build(SOURCE, cache_root() / "kernels"))
    except (RuntimeError, OSError) as e:
        import warnings

        warnings.warn(f"specrun's CPU kernels are off ({e}); bf16 linears use oneDNN", stacklevel=2)
        return None
