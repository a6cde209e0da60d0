"""The cache of AOTInductor packages: a damaged one is not loaded but removed (then built anew), a sound one that does not
load is kept; packages long unused go, past the most recently used; two builds of one graph never overlap; a package
built with the model's weights apart stores only what the compile derived from them and computes as the module does."""

import logging
import os
import shutil
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specrun.decoding.forward import aot_package


def test_a_damaged_package_is_removed_not_loaded(tmp_path):
    where = tmp_path / "draft-1-0123.pt2"
    assert aot_package.load(where) is None  # none there
    where.write_bytes(b"PK\x03\x04 the first bytes of a zip, cut off")
    assert aot_package.load(where) is None and not where.exists()


def test_a_sound_package_that_does_not_load_here_raises_and_is_kept(tmp_path):
    """Not this host's to remove (another may load it): the caller drafts eagerly."""
    where = tmp_path / "draft-1-4567.pt2"
    with zipfile.ZipFile(where, "w") as z:
        z.writestr("draft/data/aotinductor/model/model.wrapper.so", b"no library")
    with pytest.raises(Exception):  # noqa: B017 (whatever the loader raises)
        aot_package.load(where)
    assert where.exists()


def test_packages_long_unused_are_pruned_past_the_most_recent(tmp_path):
    now = 1_000_000_000.0
    recent = aot_package.KEEP + 2  # days unused: more recent ones than KEEP (all stay), then three stale ones
    ages = [*range(recent), 20, 21, 22]
    files = []
    for i, days in enumerate(ages):
        f = tmp_path / f"draft-{i % 2}-{i:04d}.pt2"
        f.write_bytes(b"x")
        os.utime(f, (now - days * 86400, now - days * 86400))
        files.append(f)
    other = tmp_path / "notes.txt"  # not a package: never touched
    other.write_bytes(b"x")
    os.utime(other, (0, 0))
    removed = aot_package.prune(tmp_path, "draft", now=now)
    assert sorted(removed) == sorted(files[recent:])  # past the KEEP most recently used, only the stale ones go
    assert all(f.exists() for f in files[:recent]) and other.exists()
    later = aot_package.prune(tmp_path, "draft", now=now + 365 * 86400)  # a year on: all stale, the KEEP newest stay
    assert sorted(later) == sorted(files[aot_package.KEEP : recent])


def test_loading_a_package_marks_it_used(tmp_path, monkeypatch):
    where = tmp_path / "draft-1-89ab.pt2"
    with zipfile.ZipFile(where, "w") as z:
        z.writestr("draft/x", b"x")
    os.utime(where, (0, 0))
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: "loaded")
    assert aot_package.load(where) == "loaded"
    assert time.time() - where.stat().st_mtime < 60  # prune() counts from now


def test_a_build_prunes_the_cache(tmp_path, monkeypatch):
    """After writing its package a build prunes the folder (export and inductor stubbed: the rule is prune's)."""
    fresh = [tmp_path / f"draft-n-{i:04d}.pt2" for i in range(aot_package.KEEP)]
    for f in fresh:
        f.write_bytes(b"x")
    stale = tmp_path / "draft-1-0old.pt2"
    stale.write_bytes(b"x")
    os.utime(stale, (0, 0))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        lambda program, package_path, inductor_configs: Path(package_path).write_bytes(b"package"))
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: "loaded")
    where = tmp_path / "draft-1-0new.pt2"
    assert aot_package.write("program", {}, where, "draft") == "loaded"
    assert where.read_bytes() == b"package" and all(f.exists() for f in fresh) and not stale.exists()


def test_two_builds_of_one_graph_never_overlap(tmp_path, monkeypatch):
    """Inductor packages a graph's generated files after releasing its own lock on them: a second build of the graph
    in the meantime rewrote one being packaged. The first build waits inside for a second to come in; none does."""
    program = torch.export.export(_Two(), (torch.zeros(2, 32),))
    inside, most, second = [0], [0], threading.Event()

    def compile_and_package(program, package_path, inductor_configs):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        if inside[0] > 1:
            second.set()
        second.wait(timeout=1.5)
        inside[0] -= 1
        Path(package_path).write_bytes(b"package")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_and_package)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: "loaded")
    builds = [threading.Thread(target=aot_package.write, args=(program, {}, tmp_path / f"draft-n-{i}.pt2", "draft"))
              for i in range(2)]
    for b in builds:
        b.start()
    for b in builds:
        b.join()
    assert most[0] == 1 and all((tmp_path / f"draft-n-{i}.pt2").exists() for i in range(2))


def test_prune_leaves_other_kinds_of_package(tmp_path):
    now = 1_000_000_000.0
    files = [tmp_path / f"{kind}-1-{i:04d}.pt2" for kind in ("draft", "layers") for i in range(aot_package.KEEP + 1)]
    for f in files:
        f.write_bytes(b"x")
        os.utime(f, (0, 0))
    removed = aot_package.prune(tmp_path, "layers", now=now)
    assert len(removed) == 1 and removed[0].name.startswith("layers-") and all(f.exists() for f in files[:9])


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w1", torch.randn(64, 32, generator=g))
        self.register_buffer("w2", torch.randn(16, 64, generator=g))

    def forward(self, x):
        return F.linear(torch.relu(F.linear(x, self.w1)), self.w2)


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor compiles C++")
def test_a_package_with_weights_apart_stores_none_of_them_and_runs_on_the_models_own(tmp_path):
    from specrun.decoding.forward.compiled import OPTIONS

    m, x = _Two().eval(), torch.randn(3, 32)
    shared = dict(m.named_buffers())
    with torch.inference_mode():
        program = torch.export.export(m, (x,))
    where = tmp_path / "layers-1-0abc.pt2"
    aot_package.write(program, OPTIONS, where, "layers", shared)
    with zipfile.ZipFile(where) as z:
        stored = [i for i in z.infolist() if "/data/weights/" in i.filename]
    assert stored and sum(i.file_size for i in stored) < 1.5 * sum(t.nbytes for t in shared.values())  # packed only
    said = _Said()
    logging.getLogger("torch.export").addHandler(said)  # torch's own handler there writes to the user's stderr
    try:
        fn = aot_package.load(where, shared)  # as a later process does
    finally:
        logging.getLogger("torch.export").removeHandler(said)
    assert said.records == []  # torch's loader took the file's name without a warning
    with torch.inference_mode():
        torch.testing.assert_close(fn(x), m(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="w1"):
        aot_package.load(where, {**shared, "w1": torch.zeros(64, 16)})  # not the weights it was built for
    assert where.exists()
    pool = {}  # two packages deriving the same constants (here: the same program twice) keep one copy of them
    other = tmp_path / "layers-n-0def.pt2"
    aot_package.write(program, OPTIONS, other, "layers", shared, pool)
    derived = [t for ts in pool.values() for t in ts]
    assert derived and all(t.nbytes for t in derived)
    again = aot_package.load(where, shared, pool)
    assert [id(t) for ts in pool.values() for t in ts] == [id(t) for t in derived]  # the first package's copies serve
    with torch.inference_mode():
        torch.testing.assert_close(again(x), m(x), rtol=1e-5, atol=1e-5)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["layers-1-0abc.pt2", "layers-n-0def.pt2"]  # no links left
