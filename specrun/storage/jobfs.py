"""The job database's filesystem interface: JobFS, every operation a job directory needs, and ObjectPath, a key in an
object store with the JobFS that reaches it. Implemented by LocalFS (fs.py) and ObjectFS (objectfs.py); imports nothing.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass


class JobFS(abc.ABC):
    """What the job database does with files. `path` is a location of this filesystem (Path or ObjectPath); a file
    becomes visible under its name only complete (I3), whatever writes it."""

    @abc.abstractmethod
    def put(self, path, data: bytes, durable: bool = True) -> None:
        """Write `data` as the file at `path`, atomically (a reader sees the old content or the new, never part)."""

    @abc.abstractmethod
    def writing(self, path, durable: bool = True):
        """Context manager yielding a local Path for the caller to write (e.g. a ParquetWriter); on a clean exit its
        content becomes the file at `path` atomically, on an exception nothing changes."""

    @abc.abstractmethod
    def read(self, path) -> bytes:
        """The file's bytes; FileNotFoundError when there is none."""

    @abc.abstractmethod
    def read_stat(self, path) -> tuple[bytes, int] | None:
        """(bytes, mtime in ns) of the file, None when there is none."""

    @abc.abstractmethod
    def source(self, path):
        """What pyarrow readers (pq.read_table, pq.ParquetFile) open the file from; FileNotFoundError if missing."""

    @abc.abstractmethod
    def list(self, directory) -> list[str]:
        """Names of the entries directly under `directory`; [] when it does not exist."""

    @abc.abstractmethod
    def exists(self, path) -> bool: ...

    @abc.abstractmethod
    def mtime(self, path) -> float:
        """Seconds since the epoch of the last write; FileNotFoundError if missing."""

    @abc.abstractmethod
    def delete(self, path) -> None:
        """Remove the file; nothing when it is not there."""

    @abc.abstractmethod
    def delete_tree(self, directory) -> None:
        """Remove a directory and everything under it; nothing when it is not there."""

    @abc.abstractmethod
    def rename(self, src, dst) -> None:
        """Move a file to another name in the same job (to set it aside); FileNotFoundError if `src` is gone."""

    @abc.abstractmethod
    def mkdir(self, directory) -> None: ...

    @abc.abstractmethod
    def put_if_absent(self, path, data: bytes) -> bool:
        """Create the file with `data` only if there is none: of several callers exactly one gets True (the lock)."""


@dataclass(frozen=True, order=True)
class ObjectPath:
    """A key in an object store, "bucket/prefix/name" as pyarrow names it, with the JobFS that reaches it; str() is
    its URI (query included: what another process needs to open it)."""
    fs: JobFS
    key: str

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(self.fs, f"{self.key}/{name}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.fs, self.key.rsplit("/", 1)[0])

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def __str__(self) -> str:
        return self.fs.uri(self.key)
