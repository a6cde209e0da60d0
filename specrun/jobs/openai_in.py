"""OpenAI/vLLM batch input lines (custom_id, method POST, url, body) -> specrun's plain prompt lines.

Body fields specrun implements map to its overrides; neutral ones are accepted only at the value that changes nothing;
every other field is refused by name (never ignored). The plain line then goes through inputs.py's checks.
"""

from __future__ import annotations

import json
import reprlib

OPENAI_LINE = ("custom_id", "method", "url", "body")
OPENAI_URLS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}  # url -> the body's source field
# Body fields we implement (theirs -> our override). Every other body field is refused by name: to lift a refusal,
# implement the field and map it here (and in OVERRIDES or STOP_OVERRIDES). stop_token_ids is vLLM's extension.
OPENAI_BODY = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "seed": "seed",
               "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
               "repetition_penalty": "penalty", "stop": "stop", "stop_token_ids": "stop_token_ids"}
OPENAI_NO_EFFECT = ("model", "user")  # accepted, change nothing: the job's --model generates every line
OPENAI_NEUTRAL = {"n": 1, "best_of": 1, "stream": False, "echo": False, "logprobs": False, "frequency_penalty": 0,
                  "presence_penalty": 0}  # accepted only at the value that changes nothing
_short = reprlib.Repr()
_short.maxstring = _short.maxother = _short.maxlong = 40


def from_openai(obj: dict) -> dict:
    """OpenAI/vLLM batch line -> plain line (raises ValueError naming the problem)."""
    unknown = sorted(set(obj) - set(OPENAI_LINE))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} in an OpenAI batch line (allowed: {', '.join(OPENAI_LINE)})")
    cid, method, url, body = (obj.get(k) for k in OPENAI_LINE)
    if not isinstance(cid, str) or not cid:
        raise ValueError("OpenAI batch line needs a non-empty string 'custom_id'")
    if method != "POST":
        raise ValueError(f"OpenAI batch line needs \"method\": \"POST\" (got {_short.repr(method)})")
    if not url:
        raise ValueError(f"OpenAI batch line needs a 'url' ({' or '.join(OPENAI_URLS)})")
    if not isinstance(url, str) or url not in OPENAI_URLS:
        raise ValueError(f"url {_short.repr(url)} is not supported (use {' or '.join(OPENAI_URLS)})")
    if not isinstance(body, dict):
        raise ValueError("OpenAI batch line needs an object 'body'")
    body = {k: v for k, v in body.items() if v is not None}  # null means "not set" in the OpenAI API
    source = OPENAI_URLS[url]
    for k, v in body.items():
        if k in OPENAI_NEUTRAL:
            neutral = OPENAI_NEUTRAL[k]
            if isinstance(v, bool) != isinstance(neutral, bool) or v != neutral:
                raise ValueError(f"body field {k!r} is only supported as {json.dumps(neutral)} "
                                 f"(got {_short.repr(v)})")
        elif k != source and k not in OPENAI_BODY and k not in OPENAI_NO_EFFECT:
            raise ValueError(f"body field {k!r} is not supported"
                             + (f" by {url}" if k in OPENAI_URLS.values() else ""))
    if source not in body:
        raise ValueError(f"body needs {source!r} for {url}")
    value = body[source]
    if source == "prompt" and isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        out = {"id": cid, "input_ids": value}
    else:
        out = {"id": cid, source: value}
    for theirs, ours in OPENAI_BODY.items():
        if theirs in body:
            if ours in out:
                both = " and ".join(repr(t) for t, o in OPENAI_BODY.items() if o == ours and t in body)
                raise ValueError(f"body has both {both}: give one")
            out[ours] = body[theirs]
    return out
