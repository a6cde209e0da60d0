"""prompts.jsonl -> validated PromptRecords: reads the whole file and reports every bad line with its number and reason.

Accepts `prompt` | `messages` | `input_ids` lines with optional id and sampling overrides, and OpenAI batch lines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from specrun.decoding.sampling import SamplingParams

MAX_REPORTED = 20
OVERRIDES = {"max_tokens": int, "seed": int, "temperature": float, "top_k": int, "top_p": float, "min_p": float,
             "penalty": float, "penalty_window": int}
SOURCES = ("prompt", "messages", "input_ids")
OPENAI_URLS = ("/v1/completions", "/v1/chat/completions")
OPENAI_BODY = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "seed": "seed",
               "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
               "repetition_penalty": "penalty"}


@dataclass(frozen=True)
class PromptRecord:
    id: str
    line: int
    text: str | None  # rendered prompt text (None when given as input_ids)
    input_ids: tuple[int, ...]
    overrides: dict
    params: SamplingParams  # effective params, seed resolved


class InputError(ValueError):
    def __init__(self, path: str, problems: list[str], total: int):
        self.problems, self.total = problems, total
        more = f"\n  ... and {total - len(problems)} more" if total > len(problems) else ""
        super().__init__(f"{path}: {total} bad line(s), nothing was started:\n  " + "\n  ".join(problems) + more)


def derive_seed(job_seed: int, prompt_id: str) -> int:
    """A prompt without its own seed samples with a seed from (job seed, id): same on every resume, distinct per id."""
    return int.from_bytes(hashlib.sha256(f"{job_seed}\0{prompt_id}".encode()).digest()[:8], "little") >> 1


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _type_ok(value, kind) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind is int else isinstance(value, (int, float))


def _from_openai(obj: dict) -> dict:
    """OpenAI/vLLM batch line -> plain line (raises ValueError naming the problem)."""
    cid, body, url = obj.get("custom_id"), obj.get("body"), obj.get("url", "")
    if not isinstance(cid, str) or not cid:
        raise ValueError("OpenAI batch line needs a non-empty string 'custom_id'")
    if not isinstance(body, dict):
        raise ValueError("OpenAI batch line needs an object 'body'")
    if url and url not in OPENAI_URLS:
        raise ValueError(f"url {url!r} is not supported (use {' or '.join(OPENAI_URLS)})")
    if body.get("n", 1) != 1:
        raise ValueError(f"body.n={body['n']!r}: only n=1 is supported")
    out = {"id": cid}
    if "messages" in body or url == "/v1/chat/completions":
        out["messages"] = body.get("messages")
    elif isinstance(body.get("prompt"), list) and all(_type_ok(t, int) for t in body["prompt"]):
        out["input_ids"] = body["prompt"]
    else:
        out["prompt"] = body.get("prompt")
    out.update({ours: body[theirs] for theirs, ours in OPENAI_BODY.items() if theirs in body})
    return out


class _Validator:
    def __init__(self, tokenizer, max_context: int, vocab_size: int, base: SamplingParams):
        self.tok, self.max_context, self.vocab_size, self.base = tokenizer, max_context, vocab_size, base

    def record(self, obj, line: int) -> PromptRecord:
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        if "custom_id" in obj or "body" in obj:
            obj = _from_openai(obj)
        unknown = sorted(set(obj) - {"id", *SOURCES, *OVERRIDES})
        if unknown:
            allowed = ", ".join(("id", *SOURCES, *OVERRIDES))
            raise ValueError(f"unknown field {unknown[0]!r} (allowed: {allowed})")
        given = [k for k in SOURCES if k in obj]
        if len(given) != 1:
            raise ValueError(f"needs exactly one of {', '.join(SOURCES)} (found {', '.join(given) or 'none'})")
        pid = obj.get("id", line)
        if isinstance(pid, bool) or not isinstance(pid, (str, int)) or pid == "":
            raise ValueError(f"id {pid!r} must be a non-empty string or an integer")
        pid = str(pid)
        overrides = {}
        for k, kind in OVERRIDES.items():
            if k in obj:
                if not _type_ok(obj[k], kind):
                    raise ValueError(f"{k}={obj[k]!r} must be {'an integer' if kind is int else 'a number'}")
                overrides[k] = obj[k]
        seed = overrides.get("seed", derive_seed(self.base.seed, pid))
        try:
            params = dataclasses.replace(self.base, **{**overrides, "seed": seed})
        except ValueError as e:
            raise ValueError(f"bad override: {e}") from None
        text, ids = self._encode(given[0], obj[given[0]])
        total = len(ids) + params.max_tokens
        if total > self.max_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                             f"model context of {self.max_context}")
        return PromptRecord(pid, line, text, tuple(ids), overrides, params)

    def _encode(self, kind: str, value) -> tuple[str | None, list[int]]:
        if kind == "input_ids":
            if not isinstance(value, list) or not value:
                raise ValueError("input_ids must be a non-empty list of integers")
            bad = [t for t in value if not _type_ok(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"input_ids holds {bad[0]!r}: token ids must be integers in [0, {self.vocab_size})")
            return None, value
        if kind == "messages":
            if not isinstance(value, list) or not value:
                raise ValueError("messages must be a non-empty list of {role, content} objects")
            for i, m in enumerate(value):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
            if not getattr(self.tok, "chat_template", None):
                raise ValueError("messages given, but the model's tokenizer has no chat template (use 'prompt')")
            text = self.tok.apply_chat_template(value, tokenize=False, add_generation_prompt=True)
            ids = self.tok.encode(text, add_special_tokens=False)
        else:
            if not isinstance(value, str):
                raise ValueError(f"prompt must be a string, got {type(value).__name__}")
            if not value:
                raise ValueError("prompt is empty")
            text, ids = value, self.tok.encode(value, add_special_tokens=True)
        if not ids:
            raise ValueError("prompt encodes to no tokens")
        return text, ids


def read_prompts(path: str | Path, tokenizer, max_context: int, vocab_size: int, base: SamplingParams,
                 max_reported: int = MAX_REPORTED) -> list[PromptRecord]:
    """Validate the whole file; raise InputError listing bad lines (line number + reason) when any is bad."""
    v = _Validator(tokenizer, max_context, vocab_size, base)
    problems: list[str] = []
    total_bad = 0
    records: list[PromptRecord] = []
    first_line: dict[str, int] = {}

    def bad(line: int, why: str) -> None:
        nonlocal total_bad
        total_bad += 1
        if len(problems) < max_reported:
            problems.append(f"line {line}: {why}")

    raw = Path(path).read_bytes()
    for line, data in enumerate(raw.split(b"\n"), start=1):
        try:
            s = data.decode("utf-8")
        except UnicodeDecodeError as e:
            bad(line, f"not valid UTF-8 (byte 0x{data[e.start]:02x} at column {e.start + 1})")
            continue
        if not s.strip():
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            bad(line, f"bad JSON: {e.msg} (column {e.colno})")
            continue
        try:
            rec = v.record(obj, line)
        except ValueError as e:
            bad(line, str(e))
            continue
        if rec.id in first_line:
            bad(line, f"duplicate id {rec.id!r} (first used on line {first_line[rec.id]})")
            continue
        first_line[rec.id] = line
        records.append(rec)
    if not records and not total_bad:
        bad(0, "no prompts (the file is empty)")
    if total_bad:
        raise InputError(str(path), problems, total_bad)
    return records
