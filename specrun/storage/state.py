"""Recycling-matrix snapshots (hot start) as safetensors files under JOB/state/, tagged with the model fingerprint.

No pickles: tensors go through safetensors.numpy, metadata is a string dict checked on load.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from safetensors.numpy import load, save

from specrun.storage.atomic import atomic_write_bytes


def snapshot_path(state_dir: str | os.PathLike, slot: int) -> Path:
    return Path(state_dir) / f"recycling-{slot:03d}.safetensors"


def save_matrix(state_dir: str | os.PathLike, slot: int, arrays: dict[str, np.ndarray], fingerprint: str) -> Path:
    """Atomically write one worker slot's matrix state (arrays as returned by RecyclingMatrix.state_dict, numpy)."""
    data = save({k: np.ascontiguousarray(v) for k, v in arrays.items()}, metadata={"fingerprint": fingerprint})
    return atomic_write_bytes(snapshot_path(state_dir, slot), data)


def load_matrix(state_dir: str | os.PathLike, fingerprint: str,
                slot: int | None = None) -> dict[str, np.ndarray] | None:
    """The slot's snapshot (else the newest one) made with the same model; None when there is no usable one."""
    d = Path(state_dir)
    if not d.is_dir():
        return None
    files = sorted(d.glob("recycling-*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
    if slot is not None:
        mine = snapshot_path(d, slot)
        files = [mine] * mine.exists() + [f for f in files if f != mine]
    for f in files:
        try:
            raw = f.read_bytes()
            from safetensors import safe_open  # metadata lives in the header

            with safe_open(f, framework="numpy") as h:
                if (h.metadata() or {}).get("fingerprint") != fingerprint:
                    continue
            return load(raw)
        except Exception:  # truncated/foreign file: a cold start is always correct, only slower
            continue
    return None
