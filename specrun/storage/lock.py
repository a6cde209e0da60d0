"""The job lock (JOB/lock.json): one driver per job directory, on local disks, NFS, FUSE mounts and object stores.

Content: pid, host, boot_id, pid_start (the process's start time, to tell a reused pid), token (unique per holder),
started_at, heartbeat_at, lease_s.

- Create: JobFS.put_if_absent (storage/fs.py). Locally the content goes to a private temporary file that is
  hard-linked to lock.json (atomic, never seen half written). Where the filesystem has no hard links (os.link fails
  with anything but FileExistsError, as on FUSE object-store mounts), lock.json is created with O_CREAT|O_EXCL, then
  written: a reader may see it empty for a moment, so a lock that cannot be parsed counts as held until its mtime is
  older than the lease. On S3 it is a conditional PutObject (If-None-Match: "*"), elsewhere a lease object
  (objectfs.py).
- Heartbeat: a thread of the holder rewrites heartbeat_at every heartbeat_s (temporary file + rename). A holder whose
  last good heartbeat is older than lease_s - heartbeat_s, or that finds another token in the lock, stops refreshing
  and sets `lost` (another driver may hold the job now); the driver then stops as on SIGTERM, and release() leaves
  the lock alone.
- Stale: on the same host (and boot), when its pid is dead, a zombie, or another process (start time differs); on
  another host, whose processes cannot be seen, when heartbeat_at is more than lease_s old. A holder stops beating
  (and stops its run) once its last beat is lease_s - heartbeat_s old, so hosts' clocks must agree to within
  heartbeat_s (30 s; NTP does far better) for a takeover never to meet a live holder.
- Takeover: a process that judged a lock stale first creates, exclusively, a claim file named after that lock's
  identity (a hash of its bytes and mtime): of several processes acting on the same judgement exactly one gets the
  claim. The claimant removes the lock only if it still has that identity (while it holds the claim no one else can
  move that lock, its creator no longer writes it, and no lock can be created over it), then drops the claim; everyone
  then races to create the lock exclusively, which exactly one wins. A live lock is never moved, even for a moment
  (moving one and putting it back would let a third process create a lock in between). A claim left by a process
  that died inside a takeover is moved aside once older than the lease (on an object store a move is copy + delete,
  so two processes removing the same abandoned claim could, in a further race, each see a takeover through; the
  heartbeat makes the one whose lock is gone stop).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from specrun.storage.fs import fs_of, job_path

HEARTBEAT_S = 30.0
LEASE_S = 120.0
ACQUIRE_S = 30.0  # how long acquire() keeps trying while other processes are taking the same lock over
log = logging.getLogger(__name__)


class LockHeld(Exception):
    def __init__(self, owner: dict | None, path):
        self.owner, self.path = owner, path
        super().__init__(f"{path} is held by {owner!r}")


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def proc_stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _pid_start(pid: int) -> str | None:
    st = proc_stat(pid)
    return st[19] if st and len(st) > 19 else None  # field 22: start time in clock ticks since boot


def _read_raw(path) -> tuple[bytes, int] | None:
    """(bytes, mtime_ns) of the lock, None when there is none."""
    return fs_of(path).read_stat(path)


def _parse(raw: tuple[bytes, int] | None) -> tuple[dict | None, float | None]:
    if raw is None:
        return None, None
    data, mtime_ns = raw
    try:
        info = json.loads(data.decode("utf-8"))
    except ValueError:
        info = None
    return (info if isinstance(info, dict) else None), mtime_ns / 1e9


def _identity(raw: tuple[bytes, int]) -> str:
    return hashlib.sha256(raw[0] + b"|%d" % raw[1]).hexdigest()[:16]


def read_lock(path) -> tuple[dict | None, float | None]:
    """(content, mtime); (None, None) when there is no lock, (None, mtime) when it cannot be parsed."""
    return _parse(_read_raw(path))


def is_stale(info: dict | None, mtime: float | None, now: float | None = None) -> bool:
    now = time.time() if now is None else now
    if info is None:  # no lock (None mtime), or one being written by an exclusive create, or damaged
        return mtime is not None and now - mtime > LEASE_S
    lease = info.get("lease_s")
    lease = float(lease) if isinstance(lease, (int, float)) and lease > 0 else LEASE_S
    beat = info.get("heartbeat_at")
    beat = float(beat) if isinstance(beat, (int, float)) else (mtime or 0.0)
    if info.get("host") != socket.gethostname():
        return now - beat > lease
    if info.get("boot_id") and _boot_id() and info["boot_id"] != _boot_id():
        return True  # this host rebooted since
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    st = proc_stat(pid)
    if st and st[0] == "Z":
        return True
    return bool(info.get("pid_start") and st and _pid_start(pid) != info["pid_start"])  # pid reused


class JobLock:
    def __init__(self, path: str | os.PathLike, heartbeat_s: float = HEARTBEAT_S, lease_s: float = LEASE_S):
        self.path = job_path(path)
        self.fs = fs_of(self.path)
        self.heartbeat_s, self.lease_s = heartbeat_s, lease_s
        self.token: str | None = None
        self.lost = False
        self._info: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_beat = 0.0

    def owner(self) -> dict | None:
        return read_lock(self.path)[0]

    def held_by_live(self) -> bool:
        info, mtime = read_lock(self.path)
        return mtime is not None and not is_stale(info, mtime)

    # -- acquire ----------------------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lock (taking over a stale one), or raise LockHeld naming the live owner."""
        now = time.time()
        self.token = uuid.uuid4().hex
        self._info = {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": _boot_id(),
                      "pid_start": _pid_start(os.getpid()), "token": self.token, "started_at": now,
                      "heartbeat_at": now, "lease_s": self.lease_s}
        self.lost = False
        deadline = time.monotonic() + ACQUIRE_S
        while time.monotonic() < deadline:
            self._info["heartbeat_at"] = time.time()
            if self.fs.put_if_absent(self.path, json.dumps(self._info).encode()):
                self._last_beat = self._info["heartbeat_at"]
                self._start_heartbeat()
                return
            raw = _read_raw(self.path)
            if raw is None:
                continue  # gone meanwhile: try to create it again
            info, mtime = _parse(raw)
            if not is_stale(info, mtime):
                raise LockHeld(info, self.path)
            if not self._take_over(_identity(raw)):
                time.sleep(0.05)  # another process is taking it over: see what it leaves
        raise LockHeld(read_lock(self.path)[0], self.path)

    def _take_over(self, ident: str) -> bool:
        """Remove the stale lock whose identity is `ident`, under its claim; False when another process holds it."""
        fs, claim = self.fs, self.path.with_name(f".{self.path.name}.takeover-{ident}")
        if not fs.put_if_absent(claim, json.dumps(self._info).encode()):
            try:
                abandoned = time.time() - fs.mtime(claim) > self.lease_s
            except FileNotFoundError:
                return False
            if abandoned:  # its claimant died inside a takeover
                aside = claim.with_name(f"{claim.name}.{uuid.uuid4().hex[:8]}.abandoned")
                try:
                    fs.rename(claim, aside)
                    fs.delete(aside)
                except FileNotFoundError:
                    pass
            return False
        try:
            raw = _read_raw(self.path)
            if raw is not None and _identity(raw) == ident:
                fs.delete(self.path)  # no one else can change it while we hold its claim
        finally:
            fs.delete(claim)
        return True

    # -- heartbeat and release ----------------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="specrun-lock-heartbeat", daemon=True)
        self._thread.start()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if not self.beat():
                return

    def beat(self) -> bool:
        """Refresh heartbeat_at; False (and `lost`) when the lock is no longer surely ours: another token in it, or
        our last heartbeat so old that another host may judge it stale (the lease, less a heartbeat of margin)."""
        now = time.time()
        if now - self._last_beat > max(self.lease_s - self.heartbeat_s, self.lease_s / 2):
            return self._lose(f"no heartbeat for {now - self._last_beat:.0f} s (lease {self.lease_s:g} s)")
        info, _ = read_lock(self.path)
        if info is None or info.get("token") != self.token:
            return self._lose(f"lock now held by {info!r}" if info else "lock removed")
        try:
            self.fs.put(self.path, json.dumps({**self._info, "heartbeat_at": now}).encode())
            self._last_beat = now
        except OSError as e:
            log.warning("job lock %s: heartbeat write failed (%s); retrying", self.path, e)
        return True

    def _lose(self, why: str) -> bool:
        self.lost = True
        log.warning("job lock %s lost: %s", self.path, why)
        return False

    def release(self) -> None:
        """Remove the lock if it is still ours (not after it was lost: it may be another driver's by now)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        info, _ = read_lock(self.path)
        if self.token is not None and not self.lost and info is not None and info.get("token") == self.token:
            self.fs.delete(self.path)
        self.token = None
