"""Training of auxiliary modules on a frozen model (TokenSwift draft heads).

train_heads(lm, data_files, out_dir, ...) -> metrics; the heads themselves live in specrun.decoding.drafters.heads.
"""

from specrun.train.heads import fit_heads, train_heads

__all__ = ["fit_heads", "train_heads"]
