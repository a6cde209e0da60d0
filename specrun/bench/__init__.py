"""Side-by-side benchmarks of specrun against HF generate (runner: measure; report: aggregate and render).

Used by `specrun bench`; benchmarks are not tests (CI runs only a smoke test on a tiny model).
"""
