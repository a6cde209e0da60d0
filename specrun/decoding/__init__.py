"""Lossless speculative decoding: the engines (engine.py solo, batch_engine.py batched) over forward/, verify/,
drafters/ and width/; kernels/ holds our optional C kernels."""
