"""The compiled draft's packages in the cache: a package's name changes with anything that changes what it computes or
where it can run; a damaged one is not loaded but removed (then built anew), a sound one that does not load is kept;
packages long unused go, past the most recently used."""

import os
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specrun.decoding.drafters import ring_package
from specrun.decoding.drafters.quant_ring import RingForward
from specrun.decoding.drafters.quant_torch import TorchForward
from specrun.decoding.forward.runner import ModelRunner
from specrun.models.loader import load_model
from tests.decoding.test_quant_draft import _on_grid, model_dir  # noqa: F401 (a fixture)


def test_a_package_is_named_by_its_weights_rows_keys_threads_and_host(model_dir, monkeypatch):  # noqa: F811
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)  # an emulation of another CPU set by whoever runs this
    lm = _on_grid(load_model(str(model_dir), dtype="float32"))
    graph = RingForward(TorchForward.of(ModelRunner(lm, max_rows=4).decoder)).graph
    name = ring_package.package_name(graph, 1, 4096)
    assert name == ring_package.package_name(graph, 1, 4096) and name.startswith("draft-1-") and name.endswith(".pt2")
    assert ring_package.path(graph, 1, 4096).name == name
    assert ring_package.package_name(graph, 0, 4096) != name  # several sequences a call
    assert ring_package.package_name(graph, 1, 2048) != name  # another bound on the ring's keys
    packed = graph.layers[1].gate_up.packed
    kept = packed.clone()
    with torch.inference_mode():
        packed.view(-1)[0] ^= 1  # one code of one weight
    assert ring_package.package_name(graph, 1, 4096) != name
    with torch.inference_mode():
        packed.copy_(kept)
    assert ring_package.package_name(graph, 1, 4096) == name
    graph.layers[0].scaling *= 2  # a constant of the graph, not a tensor
    assert ring_package.package_name(graph, 1, 4096) != name
    graph.layers[0].scaling /= 2
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # inductor's loops are compiled for a number of threads
    try:
        assert ring_package.package_name(graph, 1, 4096) != name
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # the same CPU, inductor's instructions narrowed
    assert ring_package.package_name(graph, 1, 4096) != name
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert ring_package.package_name(graph, 1, 4096) == name
    monkeypatch.setattr(ring_package, "_host", lambda: "flags : fpu sse sse2 avx2")  # another CPU
    assert ring_package.package_name(graph, 1, 4096) != name


def test_a_damaged_package_is_removed_not_loaded(tmp_path):
    where = tmp_path / "draft-1-0123.pt2"
    assert ring_package.load(where) is None  # none there
    where.write_bytes(b"PK\x03\x04 the first bytes of a zip, cut off")
    assert ring_package.load(where) is None and not where.exists()


def test_a_sound_package_that_does_not_load_here_raises_and_is_kept(tmp_path):
    """Not this host's to remove (another may load it): the caller drafts eagerly."""
    where = tmp_path / "draft-1-4567.pt2"
    with zipfile.ZipFile(where, "w") as z:
        z.writestr("draft/data/aotinductor/model/model.wrapper.so", b"no library")
    with pytest.raises(Exception):  # noqa: B017 (whatever the loader raises)
        ring_package.load(where)
    assert where.exists()


def test_packages_long_unused_are_pruned_past_the_most_recent(tmp_path):
    now = 1_000_000_000.0
    recent = ring_package.KEEP + 2  # days unused: more recent ones than KEEP (all stay), then three stale ones
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
    removed = ring_package.prune(tmp_path, now=now)
    assert sorted(removed) == sorted(files[recent:])  # past the KEEP most recently used, only the stale ones go
    assert all(f.exists() for f in files[:recent]) and other.exists()
    later = ring_package.prune(tmp_path, now=now + 365 * 86400)  # a year on: all stale, the KEEP newest stay
    assert sorted(later) == sorted(files[ring_package.KEEP : recent])


def test_loading_a_package_marks_it_used(tmp_path, monkeypatch):
    where = tmp_path / "draft-1-89ab.pt2"
    with zipfile.ZipFile(where, "w") as z:
        z.writestr("draft/x", b"x")
    os.utime(where, (0, 0))
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: "loaded")
    assert ring_package.load(where) == "loaded"
    assert time.time() - where.stat().st_mtime < 60  # prune() counts from now


def test_a_build_prunes_the_cache(tmp_path, monkeypatch):
    """After writing its package a build prunes the folder (export and inductor stubbed: the rule is prune's)."""
    fresh = [tmp_path / f"draft-n-{i:04d}.pt2" for i in range(ring_package.KEEP)]
    for f in fresh:
        f.write_bytes(b"x")
    stale = tmp_path / "draft-1-0old.pt2"
    stale.write_bytes(b"x")
    os.utime(stale, (0, 0))
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: "program")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        lambda program, package_path, inductor_configs: Path(package_path).write_bytes(b"package"))
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: "loaded")
    where = tmp_path / "draft-1-0new.pt2"
    assert ring_package.build(SimpleNamespace(options={}), (), 1, 4, where) == "loaded"
    assert where.read_bytes() == b"package" and all(f.exists() for f in fresh) and not stale.exists()
