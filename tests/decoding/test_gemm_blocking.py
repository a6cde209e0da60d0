"""gemm_blocking.capped_rows: inductor's bf16 register blocks on AVX-512 take at most 4 rows while held, and only
then."""

import torch

from specrun.decoding.forward import gemm_blocking


def _blocks(table, mg):
    """(rows, columns) of each bf16 x bf16 AVX-512 block of the table, and the table's other configs."""
    bf16 = [c for c in table if c.vec_isa_cls is mg.VecAVX512 and c.input_dtype == c.input2_dtype == torch.bfloat16]
    return [c.register_blocking[:2] for c in bf16], [c for c in table if c not in bf16]


def test_capped_rows_narrows_the_bf16_blocks_while_held_and_restores_the_table():
    import torch._inductor.lowering  # noqa: F401  (as capped_rows imports it)
    from torch._inductor.codegen import cpp_micro_gemm as mg

    table = mg.micro_gemm_configs[mg.CppMicroGemmFP32Vec]
    blocks, others = _blocks(table, mg)
    assert max(m for m, _ in blocks) > gemm_blocking.ROWS  # torch's default, which the cap exists for
    with gemm_blocking.capped_rows():
        capped, rest = _blocks(mg.micro_gemm_configs[mg.CppMicroGemmFP32Vec], mg)
        assert capped == [(min(m, gemm_blocking.ROWS), n) for m, n in blocks] and rest == others
    assert mg.micro_gemm_configs[mg.CppMicroGemmFP32Vec] is table
