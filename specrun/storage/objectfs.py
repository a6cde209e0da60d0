"""Job directories on object stores (s3://, gs://, abfs://, opened with pyarrow.fs.FileSystem.from_uri): an object
appears whole or not at all, so every file is written straight to its final key; the lock uses conditional writes.

- put: one PutObject (an s3:// URI gets allow_delayed_open=true unless it says otherwise, so a small object is one
  request, not a multipart upload). A file a streaming writer produces (Parquet) is written to a local temporary file
  first, then uploaded in one copy; a multipart upload is visible only once completed.
- put_if_absent (the job lock, storage/lock.py): on S3 a conditional write, PutObject with If-None-Match: "*" through
  boto3 (the `specrun[s3]` extra): a second writer gets 412 PreconditionFailed. Stores that pyarrow reaches without
  conditional writes get a lease object instead: written only if absent, read back after SETTLE_S, and the writer whose
  bytes are there wins (two writers whose check and write are more than SETTLE_S apart could both win; the lock's
  heartbeat then tells the loser within heartbeat_s that the lock is another's, and it stops).
- rename (setting a damaged file aside) is copy + delete, not atomic: only the driver does it, under the lock.
- An object removed while a reader has it open cannot be read any more (POSIX keeps a removed file readable): readers
  that hit that re-check existence and raise FileNotFoundError, and take a new snapshot (storage/outputs.py).
Credentials and endpoints are pyarrow's and boto3's own: AWS_* variables (AWS_ENDPOINT_URL too), ~/.aws, or the URI's
endpoint_override, scheme and region query parameters. Every process that touches the job (Ray workers) needs them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from urllib.parse import parse_qsl, urlencode, urlsplit

from specrun.storage.jobfs import JobFS, ObjectPath

OBJECT_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss")
SETTLE_S = 2.0  # lease objects: how long a writer waits before reading its lease back


class ObjectFS(JobFS):
    def __init__(self, pafs, scheme: str, query: str = ""):
        self.pafs, self.scheme, self.query = pafs, scheme, query

    def uri(self, key: str) -> str:
        return f"{self.scheme}://{key}" + (f"?{self.query}" if self.query else "")

    def _info(self, path: ObjectPath):
        return self.pafs.get_file_info(path.key)

    def put(self, path: ObjectPath, data: bytes, durable: bool = True) -> None:
        with self.pafs.open_output_stream(path.key) as out:
            out.write(data)  # one call: an interrupt cannot leave a part of it to be completed on close

    @contextlib.contextmanager
    def writing(self, path: ObjectPath, durable: bool = True):
        from pathlib import Path

        import pyarrow.fs as pafs

        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            yield Path(tmp)
            pafs.copy_files(tmp, path.key, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.pafs)
        finally:
            os.unlink(tmp)

    def read(self, path: ObjectPath) -> bytes:
        with self.pafs.open_input_stream(path.key) as f:
            return f.read()

    def read_stat(self, path: ObjectPath) -> tuple[bytes, int] | None:
        import pyarrow.fs as pafs

        info = self._info(path)
        if info.type == pafs.FileType.NotFound:
            return None
        try:
            return self.read(path), info.mtime_ns
        except FileNotFoundError:
            return None

    def source(self, path: ObjectPath):
        return self.pafs.open_input_file(path.key)

    def list(self, directory: ObjectPath) -> list[str]:
        import pyarrow.fs as pafs

        return [i.base_name for i in self.pafs.get_file_info(pafs.FileSelector(directory.key, allow_not_found=True))]

    def exists(self, path: ObjectPath) -> bool:
        import pyarrow.fs as pafs

        return self._info(path).type != pafs.FileType.NotFound

    def mtime(self, path: ObjectPath) -> float:
        import pyarrow.fs as pafs

        info = self._info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(str(path))
        return info.mtime_ns / 1e9

    def delete(self, path: ObjectPath) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.pafs.delete_file(path.key)

    def delete_tree(self, directory: ObjectPath) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.pafs.delete_dir(directory.key)

    def rename(self, src: ObjectPath, dst: ObjectPath) -> None:
        self.pafs.move(src.key, dst.key)

    def mkdir(self, directory: ObjectPath) -> None:
        pass  # prefixes exist by the objects under them

    def put_if_absent(self, path: ObjectPath, data: bytes) -> bool:
        if self.exists(path):
            return False
        self.put(path, data)
        time.sleep(SETTLE_S)
        try:
            return self.read(path) == data
        except FileNotFoundError:
            return False


class S3FS(ObjectFS):
    """S3: put_if_absent is a conditional PutObject (If-None-Match: "*") through boto3."""

    def __init__(self, pafs, scheme: str, query: str = ""):
        super().__init__(pafs, scheme, query)
        self._client = None

    def _s3(self):
        if self._client is None:
            try:
                import boto3
            except ImportError:
                raise OSError("the job lock on s3:// needs boto3: pip install 'specrun[s3]'") from None
            q = dict(parse_qsl(self.query))
            endpoint = q.get("endpoint_override")
            if endpoint and "://" not in endpoint:
                endpoint = f"{q.get('scheme', 'https')}://{endpoint}"
            self._client = boto3.client("s3", endpoint_url=endpoint or None, region_name=q.get("region") or None)
        return self._client

    def put_if_absent(self, path: ObjectPath, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        bucket, _, key = path.key.partition("/")
        try:
            self._s3().put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        except ClientError as e:
            # 412: it exists; 409: a concurrent conditional write of the same key is in progress (S3 asks to retry:
            # the lock does, after reading what is there)
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        return True


def open_uri(uri: str) -> ObjectPath:
    """The job location at an object-store URI; ValueError naming it when it is not one or pyarrow cannot open it."""
    import pyarrow.fs as pafs

    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in OBJECT_SCHEMES:
        raise ValueError(f"job location {uri!r}: {scheme}:// is not an object store specrun writes to (a local path, "
                         f"file://, or one of {', '.join(s + '://' for s in OBJECT_SCHEMES)})")
    query = parts.query
    if scheme == "s3" and "allow_delayed_open" not in dict(parse_qsl(query)):
        query = urlencode([*parse_qsl(query), ("allow_delayed_open", "true")])
    try:
        fs, key = pafs.FileSystem.from_uri(f"{scheme}://{parts.netloc}{parts.path}" + (f"?{query}" if query else ""))
    except (ValueError, OSError) as e:
        raise ValueError(f"job location {uri!r}: {e}") from None
    key = key.rstrip("/")
    if "/" not in key:
        raise ValueError(f"job location {uri!r}: give a prefix inside the bucket (s3://bucket/jobs/name), not a bucket")
    return ObjectPath((S3FS if scheme == "s3" else ObjectFS)(fs, scheme, parts.query), key)
