"""`specrun export`: the finished rows of a job, in input order, as JSON lines, one Parquet file, or plain text.

Only prompts with a done marker are exported; the caller is told how many are missing.
"""

from __future__ import annotations

import json
import sys

import pyarrow as pa

from specrun.jobs.jobdir import JobDir
from specrun.storage.atomic import atomic_write_table


def finished_table(job: JobDir) -> tuple[pa.Table, int]:
    """(rows in input order, number of prompts not done)."""
    prompts = job.prompts()
    table = job.records.read_outputs()
    order = {p.id: i for i, p in enumerate(prompts)}
    rows = sorted(table.to_pylist(), key=lambda r: order.get(r["id"], len(order)))
    return pa.Table.from_pylist(rows, schema=table.schema), len(prompts) - len(rows)


def export(job: JobDir, fmt: str, out: str | None) -> tuple[int, int]:
    """Write the rows to `out` ('-' or None = stdout for jsonl); returns (rows written, prompts missing)."""
    table, missing = finished_table(job)
    if fmt == "parquet":
        if out in (None, "-"):
            raise ValueError("--format parquet needs -o FILE")
        atomic_write_table(out, table)
    elif fmt in ("jsonl", "text"):
        lines = []
        for r in table.to_pylist():
            if fmt == "text":  # for reading: a header line per prompt, then its generated text
                lines.append(f"=== {r['id']} ({r['n_tokens']} tokens, {r['finish_reason']}) ===\n{r['text']}\n")
                continue
            r["stats"] = json.loads(r["stats"])
            lines.append(json.dumps(r, ensure_ascii=False))
        data = "".join(line + "\n" for line in lines)
        if out in (None, "-"):
            sys.stdout.write(data)
            sys.stdout.flush()
        else:
            from specrun.storage.atomic import atomic_write_bytes

            atomic_write_bytes(out, data.encode("utf-8"))
    else:
        raise ValueError(f"unknown format {fmt!r} (jsonl, parquet or text)")
    return table.num_rows, missing
