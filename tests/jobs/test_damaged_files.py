"""Damaged job files that cannot be regenerated (issue 11, item 8): job.json and prompts.parquet, truncated or with any
one bit flipped, are refused by status, export and resume with an error naming the file, never read as different
settings or prompts and never a traceback; a lock.json that cannot be parsed is named as such. (The other kinds are
regenerated; tests/faults/corrupt_files.py runs every kind end to end.)
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import specrun
from specrun.cli import main
from specrun.decoding.engine import EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs.jobdir import JobDir, JobError
from specrun.jobs.modelinfo import model_info
from specrun.jobs.submit import JobSettings, prepare_job


@pytest.fixture(scope="module")
def job(tiny_models, tmp_path_factory) -> JobDir:
    d = tmp_path_factory.mktemp("damaged")
    prompts = d / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt {i}", "max_tokens": 5 + i}) + "\n"
                               for i in range(4)))
    job, _ = prepare_job(prompts, d / "job", model_info(tiny_models["llama_mha"]), JobSettings(),
                         SamplingParams(max_tokens=8, temperature=0.7), EngineConfig())
    return job


def _each_flip(path, check) -> int:
    """Flip one bit of every byte of the file in turn (bit pos % 8; restoring the file after each), calling
    check(pos, bit); returns how many flips."""
    data = path.read_bytes()
    try:
        for pos in range(len(data)):
            flipped = bytearray(data)
            flipped[pos] ^= 1 << pos % 8
            path.write_bytes(bytes(flipped))
            check(pos, pos % 8)
    finally:
        path.write_bytes(data)
    return len(data)


def test_no_flipped_bit_of_job_json_is_read_as_settings(job):
    good = job.manifest()
    refused = []

    def check(pos, bit):
        try:
            m = job.manifest()
        except JobError as e:
            assert "job.json is damaged" in str(e)
            refused.append(pos)
        else:  # a flip JSON cannot see (the case of a hex digit in the checksum is not one of them)
            assert m == good, (pos, bit)

    n = _each_flip(job.manifest_path, check)
    assert len(refused) > 0.95 * n


def test_no_flipped_bit_of_prompts_parquet_is_read_as_other_prompts(job):
    good = [(p.id, p.input_ids, p.params) for p in job.prompts()]

    def check(pos, bit):
        try:
            got = [(p.id, p.input_ids, p.params) for p in JobDir(job.root).prompts()]  # as a new command reads it
        except JobError as e:
            assert "prompts.parquet is damaged" in str(e)
        else:  # footer statistics and the like: not what is read
            assert got == good, (pos, bit)

    _each_flip(job.prompts_path, check)


@pytest.mark.parametrize("name", ["job.json", "prompts.parquet"])
def test_a_truncated_manifest_or_prompts_file_is_refused_naming_it(job, name):
    path = job.root / name
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    try:
        for args in (["status", str(job.root), "--json"], ["export", str(job.root)], ["resume", str(job.root)]):
            r = CliRunner().invoke(main, args)
            assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (args, r.exception)
            assert f"{path} is damaged" in r.stderr and "--job-dir" in r.stderr, (args, r.stderr)
    finally:
        path.write_bytes(data)


@pytest.mark.parametrize("content", ["{}", '{"model": 3, "specrun_version": "0"}'])
def test_a_manifest_without_a_checksum_lacking_settings_is_refused_naming_them(job, content):
    """An old job's manifest has no checksum: one without the settings every command reads is damaged, not read."""
    data = job.manifest_path.read_bytes()
    job.manifest_path.write_text(content)
    try:
        for args in (["status", str(job.root)], ["export", str(job.root)]):
            r = CliRunner().invoke(main, args)
            assert r.exit_code == 1 and "job.json is damaged (it has no input, model" in r.stderr, (args, r.stderr)
    finally:
        job.manifest_path.write_bytes(data)


def test_a_file_given_as_a_job_is_named_by_the_api(tmp_path):
    (tmp_path / "afile.txt").write_text("x")
    for call in (lambda j: j.status(), lambda j: j.outputs()):
        with pytest.raises(JobError, match="afile.txt is a file, not a job's folder"):
            call(specrun.Job(tmp_path / "afile.txt"))


def test_a_lock_that_cannot_be_parsed_is_named_and_counts_as_held_for_a_lease(job):
    job.lock_path.write_bytes(b'{"pid": 12')
    try:
        r = CliRunner().invoke(main, ["resume", str(job.root)])
        assert r.exit_code == 1 and f"{job.lock_path} cannot be read" in r.stderr, r.stderr
        assert "counts as held until it is 120 s old (written 0 s ago)" in r.stderr
    finally:
        job.lock_path.unlink()


def test_no_flipped_bit_of_an_output_file_or_chunk_is_read_as_other_tokens(tmp_path):
    """Parquet's page CRCs leave out the page headers: the output row's own checksum, and the chunk's, catch the rest.
    A damaged row or chunk is skipped (the prompt is generated again), never read as other content."""
    from specrun.storage.chunks import read_progress, write_chunk
    from specrun.storage.records import Records, output_row

    rec = Records(tmp_path / "job")
    toks = [(7 * i) % 250 for i in range(40)]
    rec.write_output(output_row("p/1", toks, "some text", "length", {"steps": 3}, prompt_tokens=2, resumed_tokens=0,
                                attempts=1))
    good = [t.to_pylist() for _, t in rec.iter_outputs(["p/1"])]
    assert len(good) == 1 and good[0][0]["token_ids"] == toks

    def check_output(pos, bit):
        got = [t.to_pylist() for _, t in rec.iter_outputs(["p/1"])]
        assert got in ([], good), (pos, bit)

    _each_flip(rec.output_path("p/1"), check_output)
    chunk = write_chunk(tmp_path / "progress", 0, toks)

    def check_chunk(pos, bit):
        assert read_progress(tmp_path / "progress", quarantine=False) in ([], toks), (pos, bit)

    _each_flip(chunk, check_chunk)
