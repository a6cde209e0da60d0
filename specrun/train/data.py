"""Training text for the draft heads: .txt (one document per file), .jsonl (`text` per line), .parquet (`text` column).

pack_sequences(tokenizer, files, seq_len, eos_id) -> LongTensor [N, seq_len] of documents joined by EOS; clear errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Sequence

import torch

EXTENSIONS = (".txt", ".jsonl", ".parquet")
TOKENIZE_BATCH = 256  # documents per tokenizer call


def check_data_files(files: Sequence) -> list[Path]:
    """Paths of the data files; ValueError naming the first missing / non-file / unsupported one."""
    if not files:
        raise ValueError("no data files given (pass --data FILE, .txt, .jsonl or .parquet)")
    out = []
    for f in files:
        p = Path(f).expanduser()
        if not p.exists():
            raise ValueError(f"data file {str(f)!r} does not exist")
        if not p.is_file():
            raise ValueError(f"data file {str(f)!r} is not a file")
        if p.suffix.lower() not in EXTENSIONS:
            raise ValueError(f"data file {str(f)!r} has unsupported extension {p.suffix!r}; "
                             f"expected one of {', '.join(EXTENSIONS)}")
        out.append(p)
    return out


def read_documents(path: Path) -> Iterator[str]:
    """The non-empty texts of one data file, in file order; ValueError naming the file (and line) on bad content."""
    ext = path.suffix.lower()
    if ext == ".txt":
        text = path.read_text(encoding="utf-8", errors="replace")
        if text:
            yield text
    elif ext == ".jsonl":
        with open(path, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"data file {str(path)!r} line {n}: not valid JSON ({e})") from e
                text = row.get("text") if isinstance(row, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"data file {str(path)!r} line {n}: expected an object with a string 'text' field")
                if text:
                    yield text
    else:
        yield from _parquet_documents(path)


def _parquet_documents(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for non-parquet bytes
        raise ValueError(f"data file {str(path)!r} is not a readable parquet file: {e}") from e
    names = pf.schema_arrow.names
    if "text" not in names:
        raise ValueError(f"data file {str(path)!r} has no 'text' column (columns: {', '.join(names) or 'none'})")
    for batch in pf.iter_batches(columns=["text"]):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str) and text:
                yield text


def _batched(it: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize_files(tokenizer, files: Sequence, eos_id: int | None) -> torch.Tensor:
    """All documents of all files tokenized (no special tokens) with eos_id after each -> LongTensor [N_tokens]."""
    parts: list[torch.Tensor] = []
    for path in check_data_files(files):
        found = 0
        for docs in _batched(read_documents(path), TOKENIZE_BATCH):
            for ids in tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]:
                if not ids:
                    continue
                found += 1
                parts.append(torch.tensor(list(ids) + ([eos_id] if eos_id is not None else []), dtype=torch.long))
        if not found:
            raise ValueError(f"data file {str(path)!r} contains no text")
    return torch.cat(parts)


def pack_sequences(tokenizer, files: Sequence, seq_len: int, eos_id: int | None, min_sequences: int = 1) -> torch.Tensor:
    """Token stream cut into full sequences -> [N, seq_len] (the tail shorter than seq_len is dropped).

    ValueError naming --seq-len when fewer than min_sequences full sequences fit.
    """
    tokens = tokenize_files(tokenizer, files, eos_id)
    n = tokens.numel() // seq_len
    if n < min_sequences:
        need = min_sequences * seq_len
        raise ValueError(f"the data has {tokens.numel():,} tokens but --seq-len {seq_len} needs at least {need:,} "
                         f"({min_sequences} sequence(s) of {seq_len}: training plus held-out); "
                         f"add data or lower --seq-len")
    return tokens[: n * seq_len].view(n, seq_len)
