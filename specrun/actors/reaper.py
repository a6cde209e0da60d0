"""A watchdog beside a local Ray: when the driver that started it dies without shutting Ray down (SIGKILL), it stops
the Ray processes that were the driver's descendants (dashboard and runtime-env agents outlive their raylet otherwise).

Linux only (/proc); run as `python -m specrun.actors.reaper DRIVER_PID`, in its own session (start_reaper does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specrun.storage.lock import proc_stat

POLL_S = 1.0
GRACE_S = 3.0  # between SIGTERM and SIGKILL


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time in ticks) of a live process; None when it is gone or a zombie."""
    fields = proc_stat(pid)
    return None if not fields or fields[0] == "Z" or len(fields) < 20 else (int(fields[1]), fields[19])


def _is_ray(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"ray::" in cmd or b"/ray/" in cmd  # renamed workers and agents; Ray's own programs and scripts


def ray_descendants(root: int) -> dict[int, str]:
    """pid -> start time of the live Ray processes descending from `root`."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            parents.setdefault(st[0], []).append(int(d))
            starts[int(d)] = st[1]
    out, todo = {}, list(parents.get(root, ()))
    while todo:
        pid = todo.pop()
        todo.extend(parents.get(pid, ()))
        if pid != os.getpid() and _is_ray(pid):
            out[pid] = starts[pid]
    return out


def _signal_all(procs: dict[int, str], sig: int) -> dict[int, str]:
    """Signal the processes that are still the ones seen (same start time); -> those."""
    alive = {p: s for p, s in procs.items() if (st := _stat(p)) is not None and st[1] == s}
    for p in alive:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def watch(driver: int) -> None:
    """Until the driver is gone (then stop what was last seen of its Ray), or its Ray is (ray.shutdown)."""
    start = _stat(driver)
    seen: dict[int, str] = {}
    while (st := _stat(driver)) is not None and st[1] == start[1]:
        now = ray_descendants(driver)
        if seen and not now:
            return  # Ray was shut down; the driver lives on without it
        seen = now
        time.sleep(POLL_S)
    if _signal_all(seen, signal.SIGTERM):
        time.sleep(GRACE_S)
        _signal_all(seen, signal.SIGKILL)


def start_reaper() -> None:
    """Watch this process (call right after it started a local Ray); nothing where /proc is missing."""
    if not Path("/proc/self/stat").exists():
        return
    subprocess.Popen([sys.executable, "-m", "specrun.actors.reaper", str(os.getpid())], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


if __name__ == "__main__":
    if _stat(int(sys.argv[1])) is not None:
        watch(int(sys.argv[1]))
