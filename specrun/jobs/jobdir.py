"""One job = one directory: manifest (written once), prompts.parquet, progress/, state/, outputs/, done/, and a lock.

The lock (pid + host, created atomically with os.link) keeps a second driver out; a dead driver's lock is taken over.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from specrun.decoding.sampling import SamplingParams
from specrun.jobs.inputs import PromptRecord
from specrun.storage.atomic import atomic_write_json, atomic_write_table, local_path, read_json
from specrun.storage.names import id_key
from specrun.storage.records import Records
from specrun.storage.schemas import PROMPTS

# manifest entries that change the generated tokens: they must match to resume
OUTPUT_KEYS = ("input.sha256", "model.fingerprint", "model.dtype", "params")


class JobError(Exception):
    """A job-level problem the user must act on (message says what and how)."""


class JobDir:
    def __init__(self, location: str | os.PathLike):
        self.root = local_path(location)
        self.records = Records(self.root)
        self.manifest_path = self.root / "job.json"
        self.prompts_path = self.root / "prompts.parquet"
        self.lock_path = self.root / "lock.json"
        self.state_dir = self.root / "state"

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def progress_dir(self, prompt_id: str) -> Path:
        return self.root / "progress" / id_key(prompt_id)

    # -- manifest and prompts -----------------------------------------------------------------------------------
    def manifest(self) -> dict:
        if not self.exists():
            raise JobError(f"{self.root} is not a specrun job (no job.json)")
        return read_json(self.manifest_path)

    def create(self, manifest: dict, prompts: list[PromptRecord]) -> None:
        """Prompts first, manifest last: a directory without job.json is not a job yet (a crash here is redone)."""
        rows = [{"id": p.id, "line": p.line, "text": p.text, "input_ids": list(p.input_ids),
                 "overrides": json.dumps(p.overrides, sort_keys=True),
                 "params": json.dumps(dataclasses.asdict(p.params), sort_keys=True)} for p in prompts]
        atomic_write_table(self.prompts_path, pa.Table.from_pylist(rows, schema=PROMPTS))
        atomic_write_json(self.manifest_path, manifest)

    def prompts(self) -> list[PromptRecord]:
        t = pq.read_table(self.prompts_path, schema=PROMPTS)
        return [PromptRecord(r["id"], r["line"], r["text"], tuple(r["input_ids"]), json.loads(r["overrides"]),
                             SamplingParams(**json.loads(r["params"]))) for r in t.to_pylist()]

    # -- lock -----------------------------------------------------------------------------------------------------
    def lock_owner(self) -> dict | None:
        try:
            return read_json(self.lock_path)
        except (OSError, ValueError):
            return None

    def acquire_lock(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time()}
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".lock.{uuid.uuid4().hex[:8]}.tmp"
        tmp.write_text(json.dumps(me))
        try:
            for _ in range(2):
                try:
                    os.link(tmp, self.lock_path)  # atomic: fails if a lock exists
                    return
                except FileExistsError:
                    owner = self.lock_owner()
                    if owner is not None and not _is_stale(owner):
                        raise JobError(
                            f"job {self.root} is being run by another driver (pid {owner.get('pid')} on "
                            f"{owner.get('host')}, since {time.ctime(owner.get('started_at', 0))}); if that driver "
                            f"is gone for good, delete {self.lock_path}") from None
                    self.lock_path.unlink(missing_ok=True)  # stale: the driver that held it is dead
            raise JobError(f"could not take the lock {self.lock_path}; retry")
        finally:
            tmp.unlink(missing_ok=True)

    def release_lock(self) -> None:
        owner = self.lock_owner()
        if owner and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
            self.lock_path.unlink(missing_ok=True)

    def driver_alive(self) -> bool:
        owner = self.lock_owner()
        return owner is not None and not _is_stale(owner)


def _is_stale(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        return False  # cannot see other hosts' processes: only a human may break that lock
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def manifest_differences(old: dict, new: dict) -> list[str]:
    """Human-readable list of output-changing differences between an existing manifest and a new request."""
    out = []
    for key in OUTPUT_KEYS:
        a, b = _get(old, key), _get(new, key)
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    out.append(f"{key}.{k}: job has {a.get(k)!r}, now {b.get(k)!r}")
        elif a != b:
            out.append(f"{key}: job has {a!r}, now {b!r}")
    return out


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d
