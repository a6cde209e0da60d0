"""One job = one directory: manifest (written once), prompts.parquet, progress/, state/, outputs/, done/, and a lock.

The lock (storage/lock.py: exclusive create, heartbeat and lease, atomic takeover) keeps a second driver out; a dead
driver's lock (same host: its pid is gone; another host: its heartbeat is older than the lease) is taken over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from specrun.decoding.verify.params import SamplingParams
from specrun.errors import SpecrunError
from specrun.jobs.inputs import PromptRecord
from specrun.storage.atomic import atomic_write_json, read_json
from specrun.storage.fs import fs_of, is_tmp_name, job_path
from specrun.storage.fs import location as location_of
from specrun.storage.lock import JobLock, LockHeld, read_lock
from specrun.storage.names import id_key
from specrun.storage.records import Records
from specrun.storage.rowfiles import row_writer
from specrun.storage.schemas import PROMPTS

if TYPE_CHECKING:  # the engine's modules (torch) load where a run needs them, not for `specrun status`
    from specrun.decoding.engine import EngineConfig

# manifest entries that change the generated tokens: they must match to resume (the attention backend can change the
# logits' last bits); every other setting may change between attempts (jobs/attempts.py): compiled layers run only
# where a token is defined up to a near tie anyway (docs/design.md section 2), and compile_layers auto varies by cache
OUTPUT_KEYS = ("input.sha256", "model.fingerprint", "model.dtype", "model.rope_scaling", "params", "engine.attention")
# the top-level keys of a manifest (submit.build_manifest, and the checksums JobDir.create adds)
MANIFEST_KEYS = {"specrun_version", "schema_version", "created_at", "input", "model", "params", "engine", "checkpoint",
                 "prompts_sha256", "checksum"}
MANIFEST_NEEDS = ("input", "model", "params", "engine", "checkpoint")  # every job.json has them, as objects


@dataclass(frozen=True)
class PromptInfo:
    id: str
    line: int
    n_input: int  # prompt tokens
    params: SamplingParams
    row: int  # position in prompts.parquet (input order)


class JobError(SpecrunError):
    """A job-level problem the user must act on (message says what and how)."""


class JobDir:
    def __init__(self, location: str | os.PathLike):
        self.root = job_path(location)  # a Path, or an ObjectPath for an object-store URI (storage/fs.py)
        self.fs = fs_of(self.root)
        self.records = Records(self.root, self.prompt_ids, lambda: self.manifest().get("checksum"))
        self.manifest_path = self.root / "job.json"
        self.prompts_path = self.root / "prompts.parquet"
        self.lock_path = self.root / "lock.json"
        self.lock = JobLock(self.lock_path)
        self.state_dir = self.root / "state"
        self.attempts_dir = self.root / "attempts"
        self._prompts_checked = False

    @property
    def location(self) -> str:
        """The job's absolute path or URI: what workers and later commands open it with."""
        return location_of(self.root)

    def exists(self) -> bool:
        return self.fs.exists(self.manifest_path)

    def progress_dir(self, prompt_id: str):
        return self.root / "progress" / id_key(prompt_id)

    # -- manifest and prompts -----------------------------------------------------------------------------------
    def manifest(self) -> dict:
        """job.json; JobError naming it when it is missing, unreadable or fails its checksum (it cannot be rebuilt)."""
        if not self.exists():
            if isinstance(self.root, Path) and self.root.exists() and not self.root.is_dir():
                raise JobError(f"{self.root} is a file, not a job's folder")
            if self.half_created():
                raise JobError(f"{self.root} is a job whose creation was interrupted (it has no job.json yet): run the "
                               f"same `specrun submit` again to create it")
            raise JobError(f"{self.root} is not a specrun job (no job.json)")
        try:
            m = read_json(self.manifest_path)
            # older jobs have no checksum, but never a key we do not know (a flipped bit in a key's name)
            ok = isinstance(m, dict) and set(m) <= MANIFEST_KEYS and m.get("checksum", _checksum(m)) == _checksum(m)
            why = "its checksum does not match its content"
            lacks = [k for k in MANIFEST_NEEDS if not isinstance(m.get(k), dict)] if ok and "checksum" not in m else []
            if lacks:  # what every command reads, missing from a manifest without a checksum
                ok, why = False, f"it has no {', '.join(lacks)}"
        except (OSError, ValueError) as e:
            ok, why = False, f"{type(e).__name__}: {str(e)[:200]}"
        if not ok:
            raise JobError(f"{self.manifest_path} is damaged ({why}): the job's manifest is written once and cannot "
                           f"be rebuilt; restore it from a copy, or submit the prompts again with another --job-dir")
        return m

    def create(self, manifest: dict, prompts: list[PromptRecord]) -> None:
        """Prompts first, manifest last: a directory without job.json is not a job yet (a crash here is redone). Both
        carry checksums (Parquet page CRCs; the manifest's "checksum"): damage is refused, never read as settings."""
        rows = [{"id": p.id, "line": p.line, "text": p.text, "input_ids": list(p.input_ids),
                 "overrides": json.dumps(p.overrides, sort_keys=True),
                 "params": json.dumps(dataclasses.asdict(p.params), sort_keys=True), "source": p.source}
                for p in prompts]
        with row_writer(self.prompts_path, PROMPTS) as w:
            w.add(pa.Table.from_pylist(rows, schema=PROMPTS))
        manifest = {**manifest, "prompts_sha256": self._prompts_sha256()}
        atomic_write_json(self.manifest_path, {**manifest, "checksum": _checksum(manifest)})

    def _prompts_sha256(self) -> str:
        h = hashlib.sha256()
        with pa.input_stream(self.fs.source(self.prompts_path)) as f:  # streamed: it can be GBs
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()

    def _prompt_table(self, columns=None) -> pa.Table:
        """prompts.parquet; JobError naming it when it cannot be read or is not the file job.json recorded (checked
        once per JobDir: Parquet's page checksums leave out the page headers, where a flipped bit can drop values)."""
        try:
            if not self._prompts_checked:
                want = self.manifest().get("prompts_sha256")  # jobs made before it have none
                if want is not None and self._prompts_sha256() != want:
                    raise ValueError("its sha256 is not the one job.json recorded")
                self._prompts_checked = True
            return pq.read_table(self.fs.source(self.prompts_path), columns=columns, schema=PROMPTS,
                                 page_checksum_verification=True)
        except (OSError, ValueError, pa.ArrowException) as e:  # missing, truncated, a flipped bit
            raise JobError(f"{self.prompts_path} is damaged ({type(e).__name__}: {str(e)[:200]}): the job's "
                           f"validated prompts cannot be rebuilt from the job; restore it from a copy, or submit the "
                           f"prompts again with another --job-dir (the finished rows are in {self.root}/outputs)"
                           ) from None

    def prompts(self) -> list[PromptRecord]:
        t = self._prompt_table()
        return [PromptRecord(r["id"], r["line"], r["text"], tuple(r["input_ids"]), json.loads(r["overrides"]),
                             SamplingParams(**json.loads(r["params"])), r["source"]) for r in t.to_pylist()]

    def prompt_infos(self) -> tuple[list[PromptInfo], pa.ChunkedArray]:
        """What the driver keeps per prompt (no token ids, no text), and the input_ids column as Arrow (4 bytes a
        token, not a Python int each): PromptInfo.row indexes it."""
        t = self._prompt_table(["id", "line", "input_ids", "params"])
        lens = pc.list_value_length(t.column("input_ids")).to_pylist()
        infos = [PromptInfo(pid, line, n, SamplingParams(**json.loads(params)), row) for row, (pid, line, n, params)
                 in enumerate(zip(t.column("id").to_pylist(), t.column("line").to_pylist(), lens,
                                  t.column("params").to_pylist()))]
        return infos, t.column("input_ids")

    def prompt_ids(self) -> list[str]:
        """The prompts' ids in input order (reads one column)."""
        t = self._prompt_table(["id"])
        return t.column("id").to_pylist()

    def prompt_sources(self):
        """(id, source) of every prompt in input order: the field its line gave it in (None in jobs older than that)."""
        t = self._prompt_table(["id", "source"])
        return zip(t.column("id").to_pylist(), t.column("source").to_pylist())

    # -- creation: only specrun's own names are ever removed ------------------------------------------------------
    def creation_leftovers(self) -> list[str] | None:
        """The names in a directory without job.json that a creation killed midway leaves (prompts.parquet, the
        temporaries of prompts.parquet, job.json and lock.json, a lock and its takeover claims); None when it holds
        anything else (it is not ours to touch)."""
        own = {"prompts.parquet", self.lock_path.name}
        names = self.fs.list(self.root)
        for n in names:
            base = n[1:].rsplit(".", 2)[0] if is_tmp_name(n) else None
            if not (n in own or base in ("prompts.parquet", "job.json", self.lock_path.name)
                    or n.startswith(f".{self.lock_path.name}.takeover-")):
                return None
        return names

    def half_created(self) -> bool:
        names = self.creation_leftovers()
        return bool(names) and names != [self.lock_path.name]

    def check_confined(self) -> None:
        """JobError when anything inside the job directory is a symbolic link: specrun writes, moves and removes files
        only inside the job, and a linked sub-directory would take it elsewhere (the job directory itself may be a
        link). Local disks only (object stores have no links)."""
        if not isinstance(self.root, Path):
            return
        for top, dirs, files in os.walk(self.root):  # links to directories are listed, never entered
            for n in dirs + files:
                p = Path(top) / n
                if p.is_symlink():
                    raise JobError(f"{p} is a symbolic link (to {os.readlink(p)}): specrun writes, moves and deletes "
                                   f"files only inside the job directory {self.root}; replace the link with a real "
                                   f"{'directory' if n in dirs else 'file'}")

    # -- lock -----------------------------------------------------------------------------------------------------
    def lock_owner(self) -> dict | None:
        return self.lock.owner()

    def acquire_lock(self) -> None:
        self.fs.mkdir(self.root)
        self.check_confined()
        try:
            self.lock.acquire()
        except LockHeld as e:
            if e.owner is None:  # damaged, or being created by a driver starting now: held until a lease old
                mtime = read_lock(self.lock_path)[1]
                ago = f"written {time.time() - mtime:.0f} s ago" if mtime is not None else "gone now"
                raise JobError(f"{self.lock_path} cannot be read (damaged, or a driver is starting right now); it "
                               f"counts as held until it is {self.lock.lease_s:g} s old ({ago}); if no driver runs "
                               f"this job, delete it") from None
            o = {k: v for k, v in e.owner.items() if isinstance(v, (str, int, float))}  # as written, or damaged
            beat, started = o.get("heartbeat_at"), o.get("started_at")
            since = f", last heartbeat {time.time() - beat:.0f} s ago" if isinstance(beat, (int, float)) else ""
            raise JobError(
                f"job {self.root} is being run by another driver (pid {o.get('pid')} on {o.get('host')}, since "
                f"{time.ctime(started) if isinstance(started, (int, float)) else '?'}{since}); if that driver is "
                f"gone for good, delete {self.lock_path}, or wait for its lease ({o.get('lease_s', '?')} s after its "
                f"last heartbeat) to expire") from None

    def remove_leftovers(self, names: list[str]) -> None:
        """Remove what creation_leftovers() listed (under the lock), so the job is created anew."""
        for n in names:
            if n != self.lock_path.name:
                self.fs.delete(self.root / n)

    def release_lock(self) -> None:
        self.lock.release()

    def lock_lost(self) -> bool:
        """True once this process's lock can no longer be trusted (see JobLock.beat): stop the run."""
        return self.lock.lost

    def driver_alive(self) -> bool:
        return self.lock.held_by_live()


def manifest_differences(old: dict, new: dict) -> list[str]:
    """Human-readable list of output-changing differences between an existing manifest and a new request."""
    out = []
    for key in OUTPUT_KEYS:
        # a setting added after the job was written stands at its default there
        a, b = _get(old, key, _default(key)), _get(new, key, _default(key))
        if isinstance(a, dict) and isinstance(b, dict):
            defaults = _param_defaults() if key == "params" else {}
            for k in sorted(set(a) | set(b)):
                va, vb = a.get(k, defaults.get(k)), b.get(k, defaults.get(k))
                if va != vb:
                    out.append(f"{key}.{k}: job has {va!r}, now {vb!r}")
        elif a != b:
            out.append(f"{key}: job has {a!r}, now {b!r}")
    return out


def engine_json(engine: EngineConfig) -> dict:
    """An EngineConfig as manifests and attempt records store it (tuples -> lists; actors.worker.engine_config()
    rebuilds it)."""
    return json.loads(json.dumps(dataclasses.asdict(engine)))


def _checksum(manifest: dict) -> str:
    """sha256 of the manifest's content (its "checksum" entry left out), as JSON with sorted keys."""
    rest = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode("utf-8")).hexdigest()


def _param_defaults() -> dict:
    return json.loads(json.dumps(dataclasses.asdict(SamplingParams())))  # as manifests store them (lists, not tuples)


def _default(key: str):
    from specrun.decoding.engine import EngineConfig

    return getattr(EngineConfig, key.split(".", 1)[1]) if key.startswith("engine.") else None


def _get(d: dict, dotted: str, default=None):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return default if d is None else d
