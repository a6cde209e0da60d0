"""Model directories and loading: local HF directories, the built-in demo (random weights) and smollm2 (real text).

Builders write into the specrun cache atomically; load_model turns any of them into a LoadedModel for the engine.
"""
