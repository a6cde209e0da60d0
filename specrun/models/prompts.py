"""A prompt given as text, chat messages or token ids -> (rendered text or None, token ids): the one encoder of the
prompts file, the Python API and `specrun generate`. ValueError names the fault; nothing else is raised.
"""

from __future__ import annotations

import reprlib

KINDS = ("prompt", "messages", "input_ids")  # the prompts file's field names for text, chat messages and token ids
_short = reprlib.Repr()
_short.maxstring = _short.maxother = _short.maxlong = 40


def check_text(s: str, where: str) -> None:
    """ValueError where s holds a lone surrogate (a command line's undecodable bytes come as such), which UTF-8 and
    tokenizers cannot encode."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid unicode (lone surrogate {s[e.start]!r}) in {where}") from None


def user_message(text: str) -> list[dict]:
    """A text prompt as one user message for the chat template; ValueError for an empty text (as a bare prompt's)."""
    if not text:
        raise ValueError("prompt is empty")
    return [{"role": "user", "content": text}]


def kind_of(prompt) -> str:
    """Which KINDS a Python value is: str -> prompt, a list of {role, content} -> messages, a list of ints ->
    input_ids. ValueError for anything else."""
    if isinstance(prompt, str):
        return "prompt"
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        return "messages"
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        return "input_ids"
    raise ValueError(f"a prompt is a string, a list of {{role, content}} messages or a list of token ids; got "
                     f"{_short.repr(prompt)}")


def check_token_ids(what: str, ids, vocab_size: int) -> None:
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} holds {_short.repr(bad[0])}: token ids must be integers in [0, {vocab_size})")


def max_text_bytes(tokenizer, max_context: int) -> int | None:
    """Most UTF-8 bytes of text that can encode to max_context tokens or fewer: no token stands for more bytes than
    its longest vocabulary string spells (x4 where the tokenizer normalizes: NFKC shrinks some characters up to 3x).
    Longer text is refused before it is tokenized (a 50 MB prompt took minutes and GBs to find out). None: no
    vocabulary to read."""
    try:
        longest = max(len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    shrink = 1 if backend is not None and getattr(backend, "normalizer", 0) is None else 4
    return max_context * max(longest, 1) * shrink


def _check_size(n_bytes: int, what: str, max_text: int | None, max_context: int | None) -> None:
    if max_text is not None and n_bytes > max_text:
        raise ValueError(f"{what} is {n_bytes} bytes: more than any text of at most {max_context} tokens (the model "
                         f"context) can be with this tokenizer ({max_text} bytes); not tokenized")


def encode(tokenizer, vocab_size: int, kind: str, value, max_text: int | None = None,
           max_context: int | None = None) -> tuple[str | None, list[int]]:
    """(text as the model reads it, None for token ids; token ids). Text gets the tokenizer's special tokens (BOS);
    messages go through the chat template, which already holds them. Text (or messages' contents) longer than
    `max_text` bytes (max_text_bytes) is refused unread."""
    if kind == "input_ids":
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError("input_ids must be a non-empty list of integers")
        check_token_ids("input_ids", value, vocab_size)
        return None, list(value)
    if kind == "messages":
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages given, but the model's tokenizer has no chat template (use 'prompt')")
        _check_size(sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in value), "messages' contents",
                    max_text, max_context)
        try:
            text = tokenizer.apply_chat_template(list(value), tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template is the model's code: any failure is this prompt's fault
            raise ValueError(f"the chat template refused the messages: {type(e).__name__}: {e}") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
    elif kind == "prompt":
        if not isinstance(value, str):
            raise ValueError(f"prompt must be a string, got {type(value).__name__}")
        if not value:
            raise ValueError("prompt is empty")
        _check_size(len(value.encode("utf-8", "surrogatepass")), "prompt", max_text, max_context)
        text, ids = value, tokenizer.encode(value, add_special_tokens=True)
    else:
        raise ValueError(f"unknown prompt kind {kind!r} (one of {', '.join(KINDS)})")
    if not ids:
        raise ValueError("prompt encodes to no tokens")
    return text, ids
