"""Parquet prompts (an HF dataset's files, any table with a text or chat-messages column) -> the objects a prompts
file's lines hold, streamed a batch of rows at a time, numbered from 1 as lines are, hashed with the column choice.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

BATCH_ROWS = 1024  # rows turned into Python objects at a time (a row group can be GBs)
HASH_CHUNK = 1 << 20
SUFFIXES = (".parquet", ".pq")


@dataclass(frozen=True)
class Columns:
    """Which columns hold the prompt text (or the chat messages) and the id. None: the column named like the prompts
    file's field (prompt, messages or input_ids: exactly one must exist; id when there is one)."""

    prompt: str | None = None
    messages: str | None = None
    id: str | None = None

    def mapping(self, names) -> dict[str, str]:
        """{line field: column} for a table with these column names; ConfigError naming what is missing."""
        from specrun.errors import ConfigError
        from specrun.models.prompts import KINDS

        names = list(names)
        if self.prompt is not None and self.messages is not None:
            raise ConfigError("give one of the prompt column and the messages column, not both")
        given = {"prompt": self.prompt, "messages": self.messages}
        source = [(k, c) for k, c in given.items() if c is not None] or [(k, k) for k in KINDS if k in names]
        if len(source) != 1:
            raise ConfigError(f"no prompt column chosen and {'several' if source else 'none'} of "
                             f"{', '.join(KINDS)} found (columns: {', '.join(names)}); choose one (--prompt-column)")
        out = dict(source)
        if self.id is not None or "id" in names:
            out["id"] = self.id or "id"
        missing = [c for c in out.values() if c not in names]
        if missing:
            raise ConfigError(f"no column {missing[0]!r} (columns: {', '.join(names)})")
        return out


def is_parquet(path) -> bool:
    return Path(str(path)).suffix.lower() in SUFFIXES


def row_object(row: dict, mapping: dict[str, str]) -> dict:
    """A table row as the prompts-file line it stands for."""
    return {field: row[column] for field, column in mapping.items()}


def parquet_rows(path, columns: Columns | None, h):
    """(row number, parse) for each row of the Parquet file PATH; parse() -> its line object. Every byte of the file
    and the chosen columns go into the hash h (another column choice is another input). InputError when the file as a
    whole is unusable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from specrun.errors import InputError

    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    try:
        pf = pq.ParquetFile(path)
        mapping = (columns or Columns()).mapping(pf.schema_arrow.names)
    except (ValueError, pa.ArrowException) as e:
        raise InputError(str(path), [str(e)], 1) from None
    h.update(b"\0columns:" + json.dumps(mapping, sort_keys=True).encode())
    row = 0
    for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=list(dict.fromkeys(mapping.values()))):
        for r in batch.to_pylist():
            row += 1
            yield row, functools.partial(row_object, r, mapping)
