"""The job lock: without hard links (exclusive create), heartbeat and lease for other hosts, pid checks on this one,
atomic takeover (of many concurrent takers exactly one wins), and a holder that notices it lost the lock."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

import pytest

import specrun.storage.lock as lockmod
from specrun.storage.lock import JobLock, LockHeld, is_stale, read_lock


@pytest.fixture(params=["hard links", "no hard links"])
def links(request, monkeypatch):
    if request.param == "no hard links":  # as on FUSE object-store mounts
        def no_link(*a, **kw):
            raise OSError(1, "Operation not permitted")
        monkeypatch.setattr(os, "link", no_link)
    return request.param


def _write(path, **info):
    path.write_text(json.dumps(info))


def _other_host(beat_age: float, **extra) -> dict:
    now = time.time()
    return {"pid": 4242, "host": "elsewhere-" + socket.gethostname(), "token": "t-other", "started_at": now - 1000,
            "heartbeat_at": now - beat_age, "lease_s": 120.0, **extra}


def test_acquire_refuse_release(tmp_path, links):
    path = tmp_path / "lock.json"
    a = JobLock(path)
    a.acquire()
    try:
        info, _ = read_lock(path)
        assert info["pid"] == os.getpid() and info["token"] == a.token and info["lease_s"] == 120.0
        with pytest.raises(LockHeld) as e:
            JobLock(path).acquire()
        assert e.value.owner["token"] == a.token
    finally:
        a.release()
    assert not path.exists() and [p.name for p in tmp_path.iterdir()] == []  # no temporaries left
    b = JobLock(path)
    b.acquire()
    b.release()


def test_no_hard_links_falls_back_to_exclusive_create(tmp_path, monkeypatch):
    calls = []

    def no_link(*a, **kw):
        calls.append(a)
        raise OSError(95, "Operation not supported")
    monkeypatch.setattr(os, "link", no_link)
    path = tmp_path / "lock.json"
    lock = JobLock(path)
    lock.acquire()
    assert calls and read_lock(path)[0]["token"] == lock.token
    lock.release()
    # an exclusive create shows the lock empty for a moment: held while fresh, stale once older than the lease
    path.write_bytes(b"")
    with pytest.raises(LockHeld):
        JobLock(path).acquire()
    old = time.time() - lockmod.LEASE_S - 5
    os.utime(path, (old, old))
    lock = JobLock(path)
    lock.acquire()
    assert read_lock(path)[0]["token"] == lock.token
    lock.release()


def test_another_hosts_lock_is_stale_only_after_its_lease(tmp_path, links):
    path = tmp_path / "lock.json"
    _write(path, **_other_host(beat_age=30))
    with pytest.raises(LockHeld, match="elsewhere"):
        JobLock(path).acquire()
    assert JobLock(path).held_by_live()  # a live driver elsewhere
    _write(path, **_other_host(beat_age=500))  # its host was preempted: no heartbeat for longer than the lease
    assert not JobLock(path).held_by_live()
    lock = JobLock(path)
    lock.acquire()
    assert read_lock(path)[0]["token"] == lock.token
    assert not [p for p in tmp_path.iterdir() if p.name != "lock.json"]  # the stale lock moved aside was removed
    lock.release()
    # its own lease counts: a short one expires sooner
    _write(path, **_other_host(beat_age=40, lease_s=30.0))
    assert is_stale(*read_lock(path))


def test_same_host_lock_is_stale_when_its_process_is_gone_or_another(tmp_path):
    path = tmp_path / "lock.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    _write(path, pid=dead.pid, host=host, heartbeat_at=time.time())  # fresh heartbeat, but its pid is dead
    assert is_stale(*read_lock(path))
    _write(path, pid=os.getpid(), host=host, heartbeat_at=0)  # alive on this host: held whatever the heartbeat
    assert not is_stale(*read_lock(path))
    if lockmod._pid_start(os.getpid()) is not None:  # Linux: a pid reused by another process is not the holder
        _write(path, pid=os.getpid(), host=host, pid_start="1", heartbeat_at=time.time())
        assert is_stale(*read_lock(path))


def _contend(path: str, start, results, hold, links_ok: bool, slow: bool) -> None:
    if not links_ok:
        def no_link(*a, **kw):
            raise OSError(1, "Operation not permitted")
        os.link = no_link
    if slow:  # every taker judges the lock stale, then waits: all of them act on the same stale judgement
        real, calls = lockmod.is_stale, []

        def is_stale(*a, **kw):
            stale = real(*a, **kw)
            calls.append(stale)
            if len(calls) == 1:
                time.sleep(0.3)
            return stale
        lockmod.is_stale = is_stale
    lock = JobLock(path)
    start.wait()
    try:
        lock.acquire()
    except LockHeld:
        results.put("held")
        return
    results.put("won")
    hold.wait(30)  # keep it while the others try
    lock.release()


@pytest.mark.parametrize("links_ok", [True, False], ids=["hard links", "no hard links"])
@pytest.mark.parametrize("slow", [False, True], ids=["racing", "all judged stale first"])
def test_concurrent_takeovers_of_a_stale_lock_have_exactly_one_winner(tmp_path, links_ok, slow):
    # spawn, not fork: a child forked from pytest's threads (torch, Ray) can inherit a held lock and abort
    ctx = mp.get_context("spawn")
    path = tmp_path / "lock.json"
    for round_ in range(3):
        _write(path, **_other_host(beat_age=1000))
        start, hold, results = ctx.Event(), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_contend, args=(str(path), start, results, hold, links_ok, slow))
                 for _ in range(6)]
        for p in procs:
            p.start()
        start.set()
        outcomes = sorted(results.get(timeout=60) for _ in procs)
        hold.set()
        for p in procs:
            p.join(30)
        assert outcomes == ["held"] * 5 + ["won"], f"round {round_}: {outcomes}"
        assert [p.exitcode for p in procs] == [0] * 6
        assert not path.exists()  # the winner released it
        assert [p.name for p in tmp_path.iterdir()] == []


def test_heartbeat_refreshes_and_a_holder_notices_it_lost_the_lock(tmp_path):
    path = tmp_path / "lock.json"
    lock = JobLock(path, heartbeat_s=0.05)
    lock.acquire()
    first = read_lock(path)[0]["heartbeat_at"]
    time.sleep(0.3)
    assert read_lock(path)[0]["heartbeat_at"] > first and not lock.lost
    lock.release()
    lock = JobLock(path, heartbeat_s=1000)  # beats by hand below
    lock.acquire()
    try:
        assert lock.beat() and not lock.lost
        # another driver holds it now (we were stalled past the lease, say)
        tmp = tmp_path / "other"
        _write(tmp, **_other_host(beat_age=0))
        os.replace(tmp, path)
        assert not lock.beat() and lock.lost
        assert read_lock(path)[0]["token"] == "t-other"  # and we did not overwrite theirs
    finally:
        lock.release()
    assert read_lock(path)[0]["token"] == "t-other"  # release leaves another holder's lock alone


def test_a_stalled_holder_past_its_lease_gives_up(tmp_path):
    lock = JobLock(tmp_path / "lock.json", heartbeat_s=1000, lease_s=0.2)
    lock.acquire()
    try:
        time.sleep(0.3)
        assert not lock.beat() and lock.lost
    finally:
        lock.release()
