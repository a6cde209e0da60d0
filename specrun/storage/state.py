"""Recycling-matrix snapshots (hot start) as safetensors files under JOB/state/, tagged with the model fingerprint.

No pickles: tensors go through safetensors.numpy, metadata is a string dict (the file's header) checked on load.
"""

from __future__ import annotations

import fnmatch
import json
import os
import struct

import numpy as np
from safetensors.numpy import load, save

from specrun.storage.atomic import atomic_write_bytes
from specrun.storage.fs import fs_of, job_path


def snapshot_path(state_dir: str | os.PathLike, slot: int):
    return job_path(state_dir) / f"recycling-{slot:03d}.safetensors"


def _metadata(raw: bytes) -> dict:
    """The __metadata__ of a safetensors file's header (8-byte little-endian length, then that much JSON)."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]).get("__metadata__") or {}


def save_matrix(state_dir: str | os.PathLike, slot: int, arrays: dict[str, np.ndarray], fingerprint: str):
    """Atomically write one worker slot's matrix state (arrays as returned by RecyclingMatrix.state_dict, numpy)."""
    data = save({k: np.ascontiguousarray(v) for k, v in arrays.items()}, metadata={"fingerprint": fingerprint})
    return atomic_write_bytes(snapshot_path(state_dir, slot), data)


def load_matrix(state_dir: str | os.PathLike, fingerprint: str,
                slot: int | None = None) -> dict[str, np.ndarray] | None:
    """The slot's snapshot (else the newest one) made with the same model; None when there is no usable one."""
    d = job_path(state_dir)
    fs = fs_of(d)
    stamped = []
    for name in fnmatch.filter(fs.list(d), "recycling-*.safetensors"):
        try:
            stamped.append((fs.mtime(d / name), d / name))
        except FileNotFoundError:
            continue
    files = [f for _, f in sorted(stamped, key=lambda t: t[0], reverse=True)]
    if slot is not None:
        mine = snapshot_path(d, slot)
        files = [mine] * (mine in files) + [f for f in files if f != mine]
    for f in files:
        try:
            raw = fs.read(f)
            if _metadata(raw).get("fingerprint") != fingerprint:
                continue
            return load(raw)
        except Exception:  # truncated/foreign file: a cold start is always correct, only slower
            continue
    return None
