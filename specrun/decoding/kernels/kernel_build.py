"""Compiling our C kernels: the CPU's feature flags, and a source built once into a shared library named by a hash of
source, compiler and flags (cpu_kernels.py loads it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni",
         "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux; elsewhere none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU runs AVX-512 BF16 (vdpbf16ps) and VNNI (the draft's int8 attention), what cpu_kernels.c is
    built for."""
    return {"avx512_bf16", "avx512_vnni"} <= cpu_flags()


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
        done = subprocess.run([cc, *FLAGS, str(source), "-o", tmp, *LIBS], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final
