"""prompts.jsonl (or Parquet: parquet_in.py) -> validated PromptRecords, in one streaming pass that also hashes the
bytes (pipes and FIFOs work).

Every bad line is reported with its number and reason (bad JSON or UTF-8, lone surrogates, absurd nesting or numbers,
wrong fields, a chat template that raises, too long for the model); nothing is returned unless every line is good.
Accepts `prompt` | `messages` | `input_ids` lines with optional id and sampling overrides (`stop` and
`stop_token_ids` included), and OpenAI batch lines (POST /v1/completions or /v1/chat/completions); an OpenAI body field
we do not implement is refused by name.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import hashlib
import json
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path

from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.stops import check_stop_token_ids, check_stops
from specrun.errors import InputError  # also imported from here
from specrun.jobs.openai_in import from_openai
from specrun.models.prompts import KINDS, check_text, check_token_ids, encode, max_text_bytes

MAX_REPORTED = 20
MAX_LINE_BYTES = 64 << 20  # a longer line is reported, never loaded (a binary file without newlines stays cheap)
MAX_INT = 2**63 - 1  # an integer given for a number (a float field converts it) must fit in int64
OVERRIDES = {"max_tokens": int, "seed": int, "temperature": float, "top_k": int, "top_p": float, "min_p": float,
             "penalty": float, "penalty_window": int}
STOP_OVERRIDES = ("stop", "stop_token_ids")  # a line's own list replaces the job's (--stop, --stop-token-id)
SOURCES = KINDS
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how JSON text spells a UTF-16 surrogate
_BLANK = object()  # _parse's answer for a blank line (JSON null is a value, and a bad line)
_short = reprlib.Repr()
_short.maxstring = _short.maxother = _short.maxlong = 40


@dataclass(frozen=True)
class PromptRecord:
    id: str
    line: int
    text: str | None  # rendered prompt text (None when given as input_ids)
    input_ids: tuple[int, ...]
    overrides: dict
    params: SamplingParams  # effective params, seed resolved
    source: str | None = None  # the field the line gave it in (SOURCES; an OpenAI line: its url's); None: not recorded


def derive_seed(job_seed: int, prompt_id: str) -> int:
    """A prompt without its own seed samples with a seed from (job seed, id): same on every resume, distinct per id."""
    return int.from_bytes(hashlib.sha256(f"{job_seed}\0{prompt_id}".encode()).digest()[:8], "little") >> 1


def _type_ok(value, kind) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind is int else isinstance(value, (int, float))


def _parse(data: bytes, line: int):
    """One line's bytes -> JSON value, or _BLANK for a blank line; ValueError naming the fault."""
    if line == 1 and data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]  # editors write one; it is not part of the first object
    try:
        s = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid UTF-8 (byte 0x{data[e.start]:02x} at column {e.start + 1})") from None
    if not s.strip(" \t\r\n"):  # JSON whitespace only: a line of other invisible characters is bad JSON
        return _BLANK
    try:
        obj = json.loads(s, object_pairs_hook=_unique_fields)
    except _DuplicateField as e:
        raise ValueError(f"field {e.args[0]!r} is given twice in one object (JSON would keep only the last)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"bad JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise ValueError("bad JSON: nested too deeply") from None
    except ValueError as e:  # an integer beyond Python's int-str conversion limit
        raise ValueError(f"bad JSON: {str(e).split(';')[0]}") from None
    if _SURROGATE_ESCAPE.search(s):
        check_unicode(obj)
    return obj


class _DuplicateField(Exception):
    """A JSON object names a field twice: json.loads would keep the last value silently."""


def _unique_fields(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateField(key)
            seen.add(key)
    return obj


def check_unicode(obj) -> None:
    """ValueError naming a string (or field name) holding a lone surrogate, which UTF-8 and tokenizers cannot encode."""
    stack = [(obj, "")]  # iterative: a line may nest as deep as json.loads goes, deeper than recursion here could
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            check_text(value, where)
        elif isinstance(value, dict):
            for k, v in value.items():
                check_text(k, f"a field name in {where or 'the line'}")
                stack.append((v, f"{where}.{k}" if where else k))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))



class Validator:
    """record(line object, line number) -> PromptRecord, or ValueError naming the fault (the API checks its dict
    prompts with it too: their outputs are a job's)."""

    def __init__(self, tokenizer, max_context: int, vocab_size: int, base: SamplingParams):
        self.tok, self.max_context, self.vocab_size, self.base = tokenizer, max_context, vocab_size, base
        self.max_text = max_text_bytes(tokenizer, max_context)
        # JSON spells a byte as at most 6 characters (\u00xx); any line that can hold a prompt that fits is shorter
        self.max_line = MAX_LINE_BYTES if self.max_text is None else min(MAX_LINE_BYTES, 6 * self.max_text + (1 << 20))

    def record(self, obj, line: int) -> PromptRecord:
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        if "custom_id" in obj or "body" in obj:
            obj = from_openai(obj)
        unknown = sorted(set(obj) - {"id", *SOURCES, *OVERRIDES, *STOP_OVERRIDES})
        if unknown:
            allowed = ", ".join(("id", *SOURCES, *OVERRIDES, *STOP_OVERRIDES))
            raise ValueError(f"unknown field {unknown[0]!r} (allowed: {allowed})")
        given = [k for k in SOURCES if k in obj]
        if len(given) != 1:
            raise ValueError(f"needs exactly one of {', '.join(SOURCES)} (found {', '.join(given) or 'none'})")
        pid = obj.get("id", line)
        if isinstance(pid, bool) or not isinstance(pid, (str, int)) or pid == "":
            raise ValueError(f"id {_short.repr(pid)} must be a non-empty string or an integer")
        pid = str(pid)
        overrides = {}
        for k, kind in OVERRIDES.items():
            if k in obj:
                value = obj[k]
                if not _type_ok(value, kind):
                    raise ValueError(f"{k}={_short.repr(value)} must be {'an integer' if kind is int else 'a number'}")
                # an integer field's bound is SamplingParams' (named below); a number's, int64's
                if kind is float and isinstance(value, int) and abs(value) > MAX_INT:
                    raise ValueError(f"{k}={_short.repr(value)} is out of range (at most 2**63 - 1)")
                overrides[k] = value
        overrides.update(self._stops(obj))
        seed = overrides.get("seed", derive_seed(self.base.seed, pid))
        try:
            params = dataclasses.replace(self.base, **{**overrides, "seed": seed})
        except ValueError as e:
            raise ValueError(f"bad override: {e}") from None
        text, ids = encode(self.tok, self.vocab_size, given[0], obj[given[0]], self.max_text, self.max_context)
        total = len(ids) + params.max_tokens
        if total > self.max_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                             f"model context of {self.max_context}")
        return PromptRecord(pid, line, text, tuple(ids), overrides, params, given[0])

    def _stops(self, obj: dict) -> dict:
        """The line's stop / stop_token_ids (lists), checked: ValueError naming the fault."""
        out = {}
        if "stop" in obj:
            out["stop"] = list(check_stops(obj["stop"]))
        if "stop_token_ids" in obj:
            ids = list(check_stop_token_ids(obj["stop_token_ids"]))
            self.check_vocab("stop_token_ids", ids)
            out["stop_token_ids"] = ids
        return out

    def check_vocab(self, what: str, ids) -> None:
        check_token_ids(what, ids, self.vocab_size)


def _lines(f, h, limit: int):
    """(line number, bytes) of a binary stream, each line fed to the hash h as read; a line over `limit` -> None."""
    line = 0
    while data := f.readline(limit + 1):
        line += 1
        h.update(data)
        if len(data) > limit:
            while not data.endswith(b"\n") and (data := f.readline(1 << 20)):
                h.update(data)  # skip (but hash) the rest of the line
            data = None
        yield line, data


def _jsonl(path, h, limit: int):
    """(line number, parse) of each line of PATH, read once and hashed as read; parse() -> the JSON object, _BLANK, or
    ValueError naming the fault."""
    with open(path, "rb") as f:
        for line, data in _lines(f, h, limit):
            yield line, functools.partial(_parse_line, data, line, limit)


def _parse_line(data: bytes | None, line: int, limit: int):
    if data is None:
        raise ValueError(f"longer than {limit} bytes: no line holding a prompt that fits the model context is that "
                         f"long; not read")
    return _parse(data, line)


def read_prompts(path: str | Path, tokenizer, max_context: int, vocab_size: int, base: SamplingParams,
                 max_reported: int = MAX_REPORTED, columns=None) -> tuple[list[PromptRecord], str]:
    """Read PATH once, streaming (a pipe or FIFO works): -> (records, sha256 hex of every byte read).

    A Parquet file (a .parquet or .pq name, or `columns` given: parquet_in.Columns) is read a row group at a time,
    its rows validated as lines are and numbered from 1 ("row N"); its hash also covers the column choice.
    Raises InputError listing the bad lines (line number + reason) when any is bad, or when PATH cannot be read;
    ValueError when a stop token id of `base` is outside the vocabulary.
    """
    from specrun.jobs.parquet_in import is_parquet, parquet_rows

    v = Validator(tokenizer, max_context, vocab_size, base)
    v.check_vocab("--stop-token-id", base.stop_token_ids)  # the job's own (a line's replaces it): once, not per line
    parquet = columns is not None or is_parquet(path)
    if parquet and not is_parquet(path) and Path(path).is_file():  # columns given for a file of another name
        with open(path, "rb") as f:
            if f.read(4) != b"PAR1":
                why = ("--prompt-column, --messages-column and --id-column read Parquet files, and this is not one "
                       "(a JSON-lines file names its fields itself)")
                raise InputError(str(path), [why], 1)
    unit = "row" if parquet else "line"
    problems: list[str] = []
    total_bad = 0
    records: list[PromptRecord] = []
    first_line: dict[str, int] = {}

    def bad(why: str) -> None:
        nonlocal total_bad
        total_bad += 1
        if len(problems) < max_reported:
            problems.append(why)

    h = hashlib.sha256()
    try:
        for line, parse in parquet_rows(path, columns, h) if parquet else _jsonl(path, h, v.max_line):
            try:
                obj = parse()
                if obj is _BLANK:
                    continue
                rec = v.record(obj, line)
                if rec.id in first_line:
                    raise ValueError(f"duplicate id {_short.repr(rec.id)} (first used on {unit} "
                                     f"{first_line[rec.id]})")
            except ValueError as e:
                bad(f"{unit} {line}: {e}")
                continue
            first_line[rec.id] = line
            records.append(rec)
    except OSError as e:
        raise InputError(str(path), [f"cannot read it: {e.strerror or e}"], 1) from None
    if not records and not total_bad:
        bad("no prompts (the file is empty or has only blank lines)")
    if total_bad:
        raise InputError(str(path), problems, total_bad)
    return records, h.hexdigest()
