"""Storage: atomic writes, safe names, progress chunks (corrupt/truncated/gaps/overlaps), matrix snapshots, records."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from specrun.storage.atomic import atomic_write_bytes, atomic_write_json, read_json
from specrun.storage.chunks import chunk_name, progress_count, read_progress, write_chunk
from specrun.storage.fs import job_path
from specrun.storage.names import id_key
from specrun.storage.records import Records, distinct_n, output_row
from specrun.storage.schemas import CHUNK, OUTPUT
from specrun.storage.state import load_matrix, save_matrix


def test_atomic_write_replaces_whole_file_and_leaves_no_temporaries(tmp_path):
    p = tmp_path / "a" / "f.json"
    atomic_write_json(p, {"x": 1})
    atomic_write_json(p, {"x": 2})
    assert read_json(p) == {"x": 2}
    assert [f.name for f in p.parent.iterdir()] == ["f.json"]


def test_atomic_write_failure_keeps_old_file(tmp_path, monkeypatch):
    p = tmp_path / "f.bin"
    atomic_write_bytes(p, b"old")

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError):
        atomic_write_bytes(p, b"new")
    assert p.read_bytes() == b"old"
    assert [f.name for f in tmp_path.iterdir()] == ["f.bin"]


def test_job_path_takes_local_paths_and_file_uris_and_refuses_non_object_store_schemes(tmp_path):
    assert job_path(f"file://{tmp_path}") == tmp_path and job_path(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="hdfs://nn/job"):
        job_path("hdfs://nn/job")


@pytest.mark.parametrize("pid", ["../../etc/passwd", "a/b", ".hidden", "", "x" * 500, "Ünï cödé", "CON"])
def test_id_key_is_a_safe_file_name(pid):
    key = id_key(pid)
    assert "/" not in key and not key.startswith(".") and len(key) <= 60
    assert set(key) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def test_id_key_distinguishes_ids_that_escape_alike():
    assert len({id_key(s) for s in ["a/b", "a_b", "a?b", "A_b", "a_B"]}) == 5


def test_chunks_round_trip_in_order(tmp_path):
    write_chunk(tmp_path, 0, [1, 2, 3])
    write_chunk(tmp_path, 3, [4, 5])
    assert read_progress(tmp_path) == [1, 2, 3, 4, 5]
    assert progress_count(tmp_path) == 5
    t = pq.read_table(tmp_path / chunk_name(0, 3))
    assert t.schema.equals(CHUNK)


def test_missing_dir_is_no_progress(tmp_path):
    assert read_progress(tmp_path / "nope") == [] and progress_count(tmp_path / "nope") == 0


def test_truncated_chunk_is_dropped_with_everything_after_it(tmp_path):
    write_chunk(tmp_path, 0, [1, 2])
    bad = write_chunk(tmp_path, 2, [3, 4])
    write_chunk(tmp_path, 4, [5, 6])
    bad.write_bytes(bad.read_bytes()[:-20])
    assert read_progress(tmp_path) == [1, 2]
    assert (tmp_path / (bad.name + ".corrupt")).exists() and not bad.exists()


def test_bit_flip_is_caught_by_checksum(tmp_path):
    import pyarrow as pa

    write_chunk(tmp_path, 0, [1, 2])
    # a well-formed Parquet file whose tokens do not match their checksum
    good = pq.read_table(tmp_path / chunk_name(0, 2)).to_pylist()[0]
    good["token_ids"] = [1, 9]
    pq.write_table(pa.Table.from_pylist([good], schema=CHUNK), tmp_path / chunk_name(0, 2))
    assert read_progress(tmp_path) == []


def test_chunk_whose_name_disagrees_with_its_content_is_invalid(tmp_path):
    p = write_chunk(tmp_path, 0, [1, 2])
    p.rename(tmp_path / chunk_name(5, 7))
    write_chunk(tmp_path, 0, [1, 2])
    assert read_progress(tmp_path) == [1, 2]


def test_regenerated_chunks_overlapping_old_ones_read_consistently(tmp_path):
    write_chunk(tmp_path, 0, [1, 2, 3])
    write_chunk(tmp_path, 3, [4, 5, 6])
    write_chunk(tmp_path, 3, [4, 5, 6, 7])  # another run checkpointed at other boundaries: same tokens
    write_chunk(tmp_path, 7, [8])
    assert read_progress(tmp_path) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert not list(tmp_path.glob("*.stale")) and not list(tmp_path.glob("*.corrupt"))


def test_chunks_after_a_gap_are_set_aside_not_stitched_to_a_regenerated_run(tmp_path):
    write_chunk(tmp_path, 0, [1, 2, 3])
    bad = write_chunk(tmp_path, 3, [4, 5, 6])
    old = write_chunk(tmp_path, 6, [7, 8, 9])
    bad.write_bytes(b"garbage")
    assert read_progress(tmp_path) == [1, 2, 3]
    assert (tmp_path / (old.name + ".stale")).exists() and not old.exists()
    # the regenerated run (here: other tokens, e.g. resumed on another device) must not get the old 8, 9 appended
    write_chunk(tmp_path, 3, [4, 5, 60, 70])
    assert read_progress(tmp_path) == [1, 2, 3, 4, 5, 60, 70]


def test_chunk_disagreeing_with_an_overlapping_one_is_set_aside(tmp_path):
    write_chunk(tmp_path, 0, [1, 2, 3])
    write_chunk(tmp_path, 3, [4, 5, 6])
    other = write_chunk(tmp_path, 4, [5, 99, 7, 8])  # overlaps 4-6 with other tokens: another run's
    after = write_chunk(tmp_path, 8, [9])  # continues the other run
    assert read_progress(tmp_path, quarantine=False) == [1, 2, 3, 4, 5, 6]
    assert other.exists() and after.exists()  # quarantine=False touches nothing
    assert read_progress(tmp_path) == [1, 2, 3, 4, 5, 6]
    assert sorted(f.name for f in tmp_path.glob("*.stale")) == [other.name + ".stale", after.name + ".stale"]


def test_write_replaces_a_stale_chunk_at_the_same_span(tmp_path):
    write_chunk(tmp_path, 0, [1, 2, 3])
    write_chunk(tmp_path, 3, [4, 5, 6])  # left by an earlier run
    write_chunk(tmp_path, 3, [4, 50, 60])  # the run that resumed at 3 made other tokens
    write_chunk(tmp_path, 6, [70])
    assert read_progress(tmp_path) == [1, 2, 3, 4, 50, 60, 70]
    assert sorted(f.name for f in tmp_path.iterdir()) == [chunk_name(0, 3), chunk_name(3, 6), chunk_name(6, 7)]
    with pytest.raises(ValueError):
        write_chunk(tmp_path, 1, [])


def test_leftover_temporaries_of_a_killed_writer_are_removed(tmp_path):
    write_chunk(tmp_path, 0, [1])
    tmp = tmp_path / f".{chunk_name(1, 2)}.0123abcd.tmp"
    tmp.write_bytes(b"half a chunk")
    assert read_progress(tmp_path, quarantine=False) == [1] and tmp.exists()
    assert read_progress(tmp_path) == [1] and not tmp.exists()


def test_matrix_snapshot_round_trip_and_fingerprint_check(tmp_path):
    m = np.arange(40, dtype=np.int64).reshape(5, 8)
    save_matrix(tmp_path, 0, {"matrix": m}, "fp1")
    assert np.array_equal(load_matrix(tmp_path, "fp1", 0)["matrix"], m)
    assert np.array_equal(load_matrix(tmp_path, "fp1", 3)["matrix"], m)  # another slot falls back to any snapshot
    assert load_matrix(tmp_path, "other-model", 0) is None
    (tmp_path / "recycling-000.safetensors").write_bytes(b"junk")
    assert load_matrix(tmp_path, "fp1", 0) is None
    assert load_matrix(tmp_path / "missing", "fp1") is None


def test_distinct_n():
    assert distinct_n([1, 1, 1, 1], 1) == 0.25
    assert distinct_n([1, 2, 1, 2], 2) == 2 / 3
    assert distinct_n([1], 2) == 0.0


def test_records_output_then_marker_and_repair(tmp_path):
    rec = Records(tmp_path)
    row = output_row("a/b", [1, 2, 3], "xyz", "length", {"steps": 2, "seconds": 0.5, "mean_accepted": 1.5},
                     prompt_tokens=4, resumed_tokens=1, attempts=1)
    rec.mark_failed("a/b", "boom", 1)
    rec.write_output(row)
    assert rec.is_done("a/b") and rec.failure("a/b") is None and rec.read_done("a/b")["n_tokens"] == 3
    t = rec.read_outputs()
    assert t.schema.equals(OUTPUT) and t.column("id").to_pylist() == ["a/b"]
    assert t.column("distinct_1").to_pylist() == [1.0]
    # a crash between the output row and its marker: the marker is restored from the durable row
    next(iter(rec.done.iterdir())).unlink()
    scan = rec.repair(["a/b", "never-ran"])
    assert set(scan.rows) == {"a/b"} and scan.in_parts == {"a/b"} and rec.read_done("a/b")["n_tokens"] == 3
    assert not rec.is_done("never-ran")


def flip_last_page(path, row_group: int = 0, column: int = 1):
    """Flip one bit near the end of a column chunk (token_ids): inside its last page's data, which the page checksum
    covers (a column chunk's pages start at its dictionary page, when it has one)."""
    col = pq.ParquetFile(path).metadata.row_group(row_group).column(column)
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + col.total_compressed_size - 3] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["missing", "truncated", "bit flip"])
def test_done_marker_without_a_readable_output_is_dropped_for_regeneration(tmp_path, damage):
    rec = Records(tmp_path)
    for pid in ("a", "b"):
        rec.write_output(output_row(pid, list(range(300)), "xy", "length", {}, prompt_tokens=1, resumed_tokens=0,
                                    attempts=1))
    out = rec.output_path("a")
    if damage == "missing":
        out.unlink()
    elif damage == "truncated":
        out.write_bytes(out.read_bytes()[:-40])
    else:
        flip_last_page(out)
    problems = []
    assert [i for i, _ in rec.iter_outputs(["a", "b"], problems=problems)] == ["b"]  # export skips it, no crash
    assert bool(problems) == (damage != "missing")
    scan = rec.repair(["a", "b"])  # reads every file in full: resume regenerates "a"
    assert set(scan.rows) == {"b"} and rec.read_done("a") is None and rec.read_done("b") is not None
    assert out.with_name(out.name + ".corrupt").exists() == (damage != "missing")
    assert bool(scan.problems) == (damage != "missing")
