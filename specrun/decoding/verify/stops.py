"""Stop strings, matched over the generated text as it grows, at a bounded cost per token (I5).

StopMatcher(tokenizer, stops).feed(token) -> True when that token completes a stop string. The text a token adds is
found by decoding only the few tokens since the last settled character (a byte-level token may hold part of a UTF-8
character, a SentencePiece token's leading space depends on what precedes it), and the search looks only at the
last len(longest stop) characters. seed(resumed) replays the tail of resumed tokens. first_stop(text, stops) is
where the returned text is cut.

The text matched is the generated text alone (the prompt is not part of it), decoded as the output text is
(special tokens skipped), less an incomplete last character: a stop completes at the first token after which
decode(generated tokens) holds it. Stop strings cannot contain U+FFFD, so undecodable bytes never take part in a
match. Limit: a character whose bytes straddle a run of more than MAX_HELD tokens that all end in undecodable bytes
is seen as U+FFFD (it can miss a stop there, never invent one).
"""

from __future__ import annotations

from specrun.models.detokenize import decode_tokens
from specrun.models.prompts import check_text

MAX_STOPS = 4  # as the OpenAI API
MAX_STOP_CHARS = 1000  # per stop string: the tail kept and searched per token grows with it
MAX_HELD = 16  # tokens held back while their text ends in an incomplete character; then taken as decoded (U+FFFD)
REPLACEMENT = "\ufffd"


def check_stops(stop) -> tuple[str, ...]:
    """A string or a list of up to MAX_STOPS non-empty strings -> tuple; ValueError naming the fault."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOPS:
        raise ValueError(f"stop has {len(stop)} strings: at most {MAX_STOPS}")
    for i, s in enumerate(stop):
        where = "stop" if len(stop) == 1 else f"stop[{i}]"
        if not isinstance(s, str):
            raise ValueError(f"{where} must be a string, got {type(s).__name__}")
        if not s:
            raise ValueError(f"{where} is empty: a stop string needs at least one character")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"{where} is {len(s)} characters long: at most {MAX_STOP_CHARS}")
        if REPLACEMENT in s:
            raise ValueError(f"{where} holds U+FFFD (the replacement character, which stands for undecodable bytes)")
        check_text(s, where)
    return tuple(stop)


def check_stop_token_ids(ids) -> tuple[int, ...]:
    """A list of token ids (integers >= 0) -> tuple; ValueError naming the fault. The vocabulary is checked later."""
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers, got {type(ids).__name__}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"stop_token_ids holds {repr(t)[:40]}: token ids are integers >= 0")
    return tuple(ids)


def first_stop(text: str, stops) -> int | None:
    """Index of the earliest occurrence of any stop string in text (where the returned text ends), or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


class StopMatcher:
    """Incremental stop-string matching: each feed decodes a bounded window and searches a bounded tail."""

    def __init__(self, tokenizer, stops):
        self.stops = check_stops(stops)
        if not self.stops:
            raise ValueError("StopMatcher needs at least one stop string")
        self._decode = lambda ids: decode_tokens(tokenizer, ids)
        self.keep = max(map(len, self.stops)) - 1  # chars of earlier text a new match may start in
        self.tail = ""  # the last `keep` characters of the text so far
        self.window: list[int] = []  # window[:read] gave the last settled text (context), window[read:] is held
        self.read = 0
        self._context_text: str | None = None  # decode(window[:read]), cached while tokens are held
        self.shown = 0  # characters of the held tokens' text already searched (all but an incomplete last one)

    def feed(self, token: int) -> bool:
        """Append one generated token -> True when the text now holds a stop string (it ends in this token's text)."""
        w = self.window
        w.append(int(token))
        if self._context_text is None:
            self._context_text = self._decode(w[: self.read])
        text = self._decode(w)
        held = text.endswith(REPLACEMENT) and len(w) - self.read < MAX_HELD  # its last character may be incomplete
        visible = text.rstrip(REPLACEMENT) if held else text
        new = visible[len(self._context_text) + self.shown:]
        if held:
            self.shown += len(new)
        else:
            self._settle(text)
        return bool(new) and self._search(new)

    def _settle(self, text: str) -> None:
        """The held tokens' text is final: they become the context of the next tokens (bounded window)."""
        w = self.window
        if len(text) > len(self._context_text):  # they made text: they alone are the context
            del w[: self.read]
            self._context_text = None
        elif len(w) > MAX_HELD:  # a long run of tokens without text (specials): keep the window bounded
            del w[: len(w) - MAX_HELD]
            self._context_text = None
        else:  # tokens that made no text join the context (a lone SentencePiece "▁" still shapes the next one)
            self._context_text = text
        self.read = len(w)
        self.shown = 0

    def _search(self, new: str) -> bool:
        seen = self.tail + new
        self.tail = seen[-self.keep:] if self.keep else ""
        return any(s in seen for s in self.stops)

    def seed(self, tokens: list[int]) -> int | None:
        """Replay already generated tokens (a resume) -> index in tokens of the first that completes a stop, or None.

        Only the tail that can reach into a future match is replayed (a bounded number of tokens)."""
        span = 4 * (self.keep + 1) + 2 * MAX_HELD  # a character is at most 4 bytes, every text token at least 1
        start = max(0, len(tokens) - span)
        for i in range(start, len(tokens)):
            if self.feed(tokens[i]):
                return i
        return None
