"""The specrun cache ($SPECRUN_CACHE, default ~/.cache/specrun) and atomic building of model directories in it.

cached_dir(name, build) returns the directory, building it once in a temporary sibling renamed into place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    env = os.environ.get("SPECRUN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specrun"


def cached_dir(name: str, build: Callable[[Path], None]) -> Path:
    """cache_root()/name, built by build(tmp_dir) on first use; concurrent callers (Ray actors) are safe.

    A directory is complete once its config.json exists: the rename is the last step, so a crash leaves only a
    temporary sibling (removed) and the next call builds again.
    """
    root = cache_root()
    final = root / name
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # lost no race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def is_cached(p: Path, name: str) -> bool:
    try:
        return p == (cache_root() / name).resolve()
    except OSError:
        return False
