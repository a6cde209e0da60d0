"""The names a user picks from: drafters and attention backends, without torch (the CLI builds its options from them
before anything heavy loads). The modules that implement each name read them from here.
"""

DRAFTER_NAMES = ("quant", "heads", "fused", "recurrent", "ngram", "recycling")  # drafting order: a head's guess keys
# the n-grams
BACKENDS = ("sdpa", "split")  # one sequence's attention (forward/attention.py)
PAGED_BACKENDS = ("sdpa", "dense", "paged", "flashinfer")  # several sequences' (forward/paged_attention.py)
