"""Generated tokens -> text deltas as they are accepted: decoded only at UTF-8 boundaries, and never past a stop
string; the deltas joined equal the returned text (models/loader.output_text). Used by LLM.stream and the CLI.
"""

from __future__ import annotations

from specrun.models.detokenize import decode_tokens

CONTEXT = 4  # tokens decoded before the new ones, then cut off: a tokenizer may spell a token differently at a start


class TextDeltas:
    """push(tokens) -> the text they add that is safe to show now; finish() -> what was held back. Decodes only the
    suffix (a context of CONTEXT tokens + the undecided ones), holding back incomplete UTF-8 and, with stop strings,
    the last characters a stop string may start in: nothing from a stop string on is ever returned, and a stop token
    ends the generation, so it never shows either."""

    def __init__(self, tokenizer, params):
        self.tokenizer = tokenizer
        self.stop, self.stop_ids = params.stop, frozenset(params.stop_token_ids)
        self.keep = max(map(len, self.stop), default=1) - 1
        self.context: list[int] = []  # the last tokens shown (decoded again before the pending ones, then cut)
        self.pending: list[int] = []  # not shown yet: they may end inside a UTF-8 character
        self.held = ""  # decoded, not shown yet: it may be the start of a stop string
        self.ended = False  # a stop string was reached: nothing more is shown

    def push(self, tokens: list[int]) -> str:
        if self.ended:
            return ""
        self.pending.extend(t for t in tokens if t not in self.stop_ids)
        text = self._decode()
        if text.endswith("\ufffd"):
            return ""
        self.context = (self.context + self.pending)[-CONTEXT:]
        self.pending = []
        return self._cut(text, final=False)

    def finish(self) -> str:
        if self.ended:
            return ""
        text = self._decode()
        self.context, self.pending = [], []
        return self._cut(text, final=True)

    def _decode(self) -> str:
        before = decode_tokens(self.tokenizer, self.context)
        text = decode_tokens(self.tokenizer, self.context + self.pending)
        return text[len(before):] if text.startswith(before) else decode_tokens(self.tokenizer, self.pending)

    def _cut(self, text: str, final: bool) -> str:
        from specrun.decoding.verify.stops import first_stop

        text, self.held = self.held + text, ""
        cut = first_stop(text, self.stop) if self.stop else None
        if cut is not None:
            text, self.ended = text[:cut], True
        elif not final and self.keep:
            split = max(0, len(text) - self.keep)
            text, self.held = text[:split], text[split:]
        return text
