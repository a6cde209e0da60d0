"""The job database's filesystem seam: JobFS (jobfs.py) is every operation a job directory needs (atomic put, read,
list, exists, delete, put-if-absent); LocalFS is the local disk, objectfs.py the object stores (s3://, gs://, abfs://).

A location is a pathlib.Path (local) or an ObjectPath (a key in an object store); job_path() makes one from what a user
typed (a path, file://..., s3://bucket/prefix?endpoint_override=...), fs_of() gives its JobFS. Both kinds have `/`,
name, parent and with_name, so code that builds paths does not care which it holds; all I/O goes through the JobFS.
LocalFS writes a hidden temporary `.<name>.<8 hex>.tmp` in the target's directory (a glob of `*.parquet` never matches
one), fsyncs it and renames it; durable=False skips the fsyncs (still atomic) for files rebuilt after a crash.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from pathlib import Path

from specrun.storage.jobfs import JobFS, ObjectPath  # also imported from here


def tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


_TMP_NAME = re.compile(r"^\..+\.[0-9a-f]{8}\.tmp$")


def is_tmp_name(name: str) -> bool:
    """A temporary name tmp_path() gives (`.<name>.<8 hex>.tmp`): the only names specrun removes as leftovers."""
    return _TMP_NAME.match(name) is not None


def fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalFS(JobFS):
    """The local disk (NFS and FUSE mounts included): temporary name, flush, fsync, rename; the lock file is a complete
    temporary hard-linked to its name, or, where there are no hard links (FUSE object-store mounts), created with
    O_CREAT|O_EXCL and then written (a reader may see it empty for a moment)."""

    @contextlib.contextmanager
    def writing(self, path, durable: bool = True):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_name(path)
        try:
            yield tmp
            if durable:
                _fsync_file(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if durable:
            fsync_dir(path.parent)

    def put(self, path, data: bytes, durable: bool = True) -> None:
        with self.writing(path, durable) as tmp:
            tmp.write_bytes(data)

    def read(self, path) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_stat(self, path) -> tuple[bytes, int] | None:
        try:
            with open(path, "rb") as f:
                return f.read(), os.fstat(f.fileno()).st_mtime_ns
        except FileNotFoundError:
            return None

    def source(self, path):
        return path

    def list(self, directory) -> list[str]:
        try:
            return os.listdir(directory)
        except FileNotFoundError:
            return []

    def exists(self, path) -> bool:
        return Path(path).exists()

    def mtime(self, path) -> float:
        return os.stat(path).st_mtime

    def delete(self, path) -> None:
        Path(path).unlink(missing_ok=True)

    def delete_tree(self, directory) -> None:
        try:
            shutil.rmtree(directory)
        except FileNotFoundError:
            pass

    def rename(self, src, dst) -> None:
        os.replace(src, dst)

    def mkdir(self, directory) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)

    def put_if_absent(self, path, data: bytes) -> bool:
        path = Path(path)
        tmp = tmp_name(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.put(tmp, data)
            try:
                os.link(tmp, path)  # atomic, and fails if the file exists
            except FileExistsError:
                return False
            except OSError:  # no hard links here (FUSE object-store mounts)
                return self._create_exclusive(path, data)
            fsync_dir(path.parent)
            return True
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def _create_exclusive(path: Path, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        fsync_dir(path.parent)
        return True


LOCAL = LocalFS()  # stateless: every local location shares it


def job_path(location) -> Path | ObjectPath:
    """A location from a user's string: a local path or file://... -> Path; an object-store URI -> ObjectPath
    (ValueError naming the value when no object store serves it)."""
    if isinstance(location, (Path, ObjectPath)):
        return location
    s = os.fspath(location)
    if s.startswith("file://"):
        return Path(s[len("file://"):])
    if "://" not in s:
        return Path(s)
    from specrun.storage.objectfs import open_uri

    return open_uri(s)


def fs_of(path) -> JobFS:
    return path.fs if isinstance(path, ObjectPath) else LOCAL


def location(path) -> str:
    """What another process (a Ray worker, a later command) opens the same location with: an absolute path or the
    URI."""
    p = job_path(path)
    return str(p.resolve()) if isinstance(p, Path) else str(p)


def move_aside(path, suffix: str = ".corrupt") -> None:
    """Rename a damaged or stale file out of the readers' way (kept for inspection); gone already is fine."""
    try:
        fs_of(path).rename(path, path.with_name(path.name + suffix))
    except FileNotFoundError:
        pass
