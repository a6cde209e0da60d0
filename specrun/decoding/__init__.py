"""Lossless speculative decoding: the engine (engine.py: one sequence or several a step) over forward/, verify/,
drafters/ and width/; kernels/ holds our optional C kernels; choices.py the names a user picks from (no torch)."""
