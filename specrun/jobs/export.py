"""`specrun export`: the finished rows of a job, in input order, as JSON lines, OpenAI batch output lines
(openai_out.py), one Parquet file, or plain text.

Streamed: rows are read from the job's output files a row group at a time and written out as they come, so memory
holds the ids (openai: the chat prompts' ids once more) plus one row group per output file, never every token of every
output. A Parquet export gets row groups of bounded size (storage/rowfiles.py) and the OUTPUT schema; a file written
to -o appears only complete (atomic), through a symlink to its target; a device or FIFO is written in place.
Only finished prompts are exported; the caller is told how many are missing. A row that cannot be read (a damaged
output file) is skipped with a warning: `specrun resume` generates it again.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import sys
from pathlib import Path

import pyarrow as pa

from specrun.jobs.jobdir import JobDir
from specrun.jobs.openai_out import OpenAIBatchLines
from specrun.jobs.printable import printable
from specrun.storage.atomic import atomic_path, output_target
from specrun.storage.fs import job_path
from specrun.storage.outputs import is_foreign
from specrun.storage.rowfiles import row_writer
from specrun.storage.schemas import OUTPUT

FORMATS = ("jsonl", "openai", "parquet", "text")


def iter_finished(job: JobDir, problems: list | None = None, batches: bool = False):
    """(id, 1-row table) of every finished row, in input order; with `batches`, (ids, table) of several rows."""
    yield from job.records.iter_outputs(job.prompt_ids(), problems=problems, batches=batches)


def finished_table(job: JobDir) -> tuple[pa.Table, int]:
    """(rows in input order, number of prompts not done), in memory: for small jobs and tests."""
    tables = [t for _, t in iter_finished(job)]
    table = pa.concat_tables(tables) if tables else OUTPUT.empty_table()
    return table, len(job.prompt_ids()) - table.num_rows


def _lines(batches, fmt: str, openai: OpenAIBatchLines | None = None):
    for _, t in batches:
        for i in range(t.num_rows):  # one row at a time in Python objects (a row group of them can be GBs)
            r = t.slice(i, 1).to_pylist()[0]
            if fmt == "text":  # for reading: a header line per prompt, then its generated text
                yield f"=== {r['id']} ({r['n_tokens']} tokens, {r['finish_reason']}) ===\n{r['text']}\n\n"
            elif fmt == "openai":
                yield json.dumps(openai(r), ensure_ascii=False) + "\n"
            else:
                r["stats"] = json.loads(r["stats"])
                yield json.dumps(r, ensure_ascii=False) + "\n"


def _check_output(job: JobDir, out: str) -> None:
    """-o names a file outside the job (over its manifest or outputs the job could never be read again), in a folder
    that exists (a mistyped path makes no folders)."""
    target = job_path(out)
    if isinstance(target, Path) and isinstance(job.root, Path):
        inside = target.resolve().is_relative_to(job.root.resolve())
    else:
        inside = posixpath.normpath(str(target)).startswith(posixpath.normpath(str(job.root)).rstrip("/") + "/")
    if inside:
        raise ValueError(f"-o {out} is inside the job {job.root}, whose folder holds the job's own files: write it "
                         f"elsewhere")
    if isinstance(target, Path) and target.is_dir():
        raise ValueError(f"-o {out} is a folder: give a file name")
    if isinstance(target, Path) and not target.resolve().parent.is_dir():
        raise ValueError(f"-o {out}: the folder {target.parent} does not exist")


def export(job: JobDir, fmt: str, out: str | None) -> tuple[int, int]:
    """Write the rows to `out` ('-' or None = stdout but for parquet); returns (rows written, prompts missing)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} ({', '.join(FORMATS)})")
    if fmt == "parquet" and out in (None, "-"):
        raise ValueError("--format parquet needs -o FILE")
    if out not in (None, "-"):
        _check_output(job, out)
    n_prompts = len(job.prompt_ids())
    openai = OpenAIBatchLines(job) if fmt == "openai" else None
    problems: list[str] = []
    n = 0

    def counted():
        nonlocal n
        for ids, t in iter_finished(job, problems, batches=True):
            n += len(ids)
            yield ids, t

    target, atomic = (None, True) if out in (None, "-") else output_target(out)
    if fmt == "parquet":
        with row_writer(target, OUTPUT, atomic=atomic) as w:
            for _, t in counted():
                w.add(t)
    elif target is None:
        for line in _lines(counted(), fmt, openai):
            sys.stdout.write(line)
        sys.stdout.flush()
    else:
        with atomic_path(target) if atomic else contextlib.nullcontext(target) as tmp, \
                open(tmp, "w", encoding="utf-8") as f:
            f.writelines(_lines(counted(), fmt, openai))
    for p in problems:
        lost = "" if is_foreign(p) else f"; those rows were not exported (`specrun resume {job.root}` generates them again)"
        print(f"warning: {printable(p)}{lost}", file=sys.stderr)
    return n, n_prompts - n
