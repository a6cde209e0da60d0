"""Prompt ids -> safe, unique file names: a readable escaped prefix plus a hash of the full id.

Ids never become raw file names: no separators, no dot files, no case collisions, bounded length.
"""

from __future__ import annotations

import hashlib
import re

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def id_key(prompt_id: str) -> str:
    """'chapter/1' -> 'chapter_1-3f2a9c0d1e4b5a69' (prefix for humans, sha256 prefix for uniqueness)."""
    digest = hashlib.sha256(prompt_id.encode("utf-8")).hexdigest()[:16]
    prefix = _UNSAFE.sub("_", prompt_id)[:40].strip("_") or "id"
    return f"{prefix}-{digest}"
