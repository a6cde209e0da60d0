"""Inductor's register blocking for the compiled layers' bfloat16 products on AVX-512: at most ROWS rows a block.
Its default block (8 rows by 48 columns) ran several times slower per row from 5 rows up; the sums are the same.

Inductor chooses its micro-kernel from a table it has no setting for (codegen/cpp_micro_gemm.py): capped_rows()
narrows that table while a package builds. Each output's sum runs over K in the same order whatever the block's rows,
so a row's values do not change (docs/benchmarks.md, stop 83).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

ROWS = 4  # rows of a bf16 register block on AVX-512


@contextlib.contextmanager
def capped_rows():
    """While held (process-wide: one build at a time), inductor's bf16 x bf16 micro-kernels for AVX-512 take at most
    ROWS rows a register block, each its columns as before. Where inductor's table is not as read here (another torch),
    it is left as it is."""
    try:
        import torch._inductor.lowering  # noqa: F401  (cpp_micro_gemm imports in a cycle unless lowering comes first)
        from torch._inductor.codegen import cpp_micro_gemm as mg

        table, cls = mg.micro_gemm_configs, mg.CppMicroGemmFP32Vec
        old = table[cls]
        new = [dataclasses.replace(c, register_blocking=c.register_blocking._replace(
            block_m=min(c.register_blocking.block_m, ROWS))) if _bf16_avx512(c, mg.VecAVX512) else c for c in old]
    except (ImportError, AttributeError, KeyError, TypeError):
        yield
        return
    table[cls] = new
    try:
        yield
    finally:
        table[cls] = old


def _bf16_avx512(config, isa) -> bool:
    return config.vec_isa_cls is isa and config.input_dtype == config.input2_dtype == torch.bfloat16
