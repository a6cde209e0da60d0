"""Token ids -> text, the one decoder of generated tokens (stop matching, text deltas, the returned text).

decode_tokens(tokenizer, ids, skip_special_tokens=True) -> str; ids the tokenizer lacks are skipped. Imports nothing.
"""


def decode_tokens(tokenizer, ids, skip_special_tokens: bool = True) -> str:
    """Text of token ids; ids outside the tokenizer (the model's output vocab may be larger) are skipped."""
    n = len(tokenizer)
    kept = [int(i) for i in ids if 0 <= int(i) < n]
    return tokenizer.decode(kept, skip_special_tokens=skip_special_tokens) if kept else ""
