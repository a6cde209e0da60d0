"""`specrun generate`: one prompt through the engine, streamed to the terminal or printed as one JSON object.

Thin: validates flags into SamplingParams/EngineConfig, loads the model, calls Engine.generate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specrun.cli.options import engine_config_from, engine_options, model_options, sampling_options, sampling_params_from

DEMO_NOTICE = "note: --model demo is a tiny RANDOM-WEIGHT model built offline; its text is noise, not language."


def load_for_cli(model: str, dtype: str, device: str, trust_remote_code: bool):
    """Load a model or raise a ClickException naming the bad value; warns on stderr for the demo model."""
    from specrun.models.loader import load_model, resolve_dtype

    try:
        lm = load_model(model, dtype=resolve_dtype(dtype, model, device), device=device,
                        trust_remote_code=trust_remote_code)
    except (ValueError, OSError) as e:
        raise click.ClickException(f"cannot load model {model!r}: {e}") from e
    if lm.is_demo:
        click.echo(DEMO_NOTICE, err=True)
    return lm


def encode_prompt(lm, text: str, chat: bool) -> list[int]:
    """Token ids of the prompt; with chat, the text is one user message under the model's chat template."""
    if chat:
        if not getattr(lm.tokenizer, "chat_template", None):
            raise click.UsageError("--chat: this model's tokenizer has no chat template")
        try:
            text = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template is the model's code (a sandbox refusal, a raise)
            raise click.ClickException(f"the model's chat template refused the prompt: {type(e).__name__}: "
                                       f"{str(e)[:300]}") from None
    ids = lm.tokenizer.encode(text, add_special_tokens=not chat)  # the template already holds the special tokens
    if not ids:
        raise click.ClickException("the prompt encodes to no tokens")
    return ids


chat_option = click.option("--chat", is_flag=True,
                           help="Send the prompt as a user message through the model's chat template (instruct models).")


@click.command()
@click.option("--prompt", help="Prompt text.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Read the prompt text from this file.")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="Most new tokens to generate.")
@chat_option
@model_options
@sampling_options
@engine_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (token_ids, text, finish_reason, stats).")
def generate(prompt, prompt_file, max_tokens, chat, model, dtype, device, trust_remote_code, as_json, **kw):
    """Generate a continuation of one prompt with lossless speculative decoding.

    The tokens are exactly those plain autoregressive decoding would produce for the same model, prompt, sampling
    flags and seed; drafting only makes it faster.

    \b
    Examples:
      specrun generate --model smollm2 --chat --prompt "Write a story about a dragon." --max-tokens 400
      specrun generate --model /models/Llama-3.1-8B --prompt-file p.txt --max-tokens 4096 --temperature 0.7 --seed 1
      specrun generate --prompt "abcabc" --draft none --json
    """
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt or --prompt-file")
    text = prompt if prompt is not None else prompt_file.read_text(encoding="utf-8")
    params = sampling_params_from(kw, max_tokens)
    config = engine_config_from(kw)
    lm = load_for_cli(model, dtype, device, trust_remote_code)

    from specrun.decoding.engine import Engine
    from specrun.models.loader import output_text

    prompt_ids = encode_prompt(lm, text, chat)
    try:
        engine = Engine(lm, config)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    stream = _Streamer(lm.tokenizer, params, enabled=not as_json)
    try:
        result = engine.generate(prompt_ids, params, on_step=stream)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    stream.finish()
    s = result.stats
    if as_json:
        text_out = output_text(lm.tokenizer, result.token_ids, result.finish_reason, params)
        click.echo(json.dumps({"token_ids": result.token_ids, "text": text_out,
                               "finish_reason": result.finish_reason, "stats": s}))
    else:
        click.echo(
            f"[{len(result.token_ids)} tokens, {s['tokens_per_s']:.1f} tok/s, "
            f"{s['mean_accepted']:.2f} accepted/step, finish: {result.finish_reason}]",
            err=True,
        )


class _Streamer:
    """Prints the decoded text as it grows, holding back incomplete UTF-8 (decode of the suffix only) and, with stop
    strings, the last characters a stop string may start in: as in the returned text, nothing from a stop on is
    printed (a stop token ends the generation, so it is never printed either)."""

    def __init__(self, tokenizer, params, enabled: bool):
        self.tokenizer, self.enabled = tokenizer, enabled
        self.stop, self.stop_ids = params.stop, frozenset(params.stop_token_ids)
        self.keep = max(map(len, self.stop), default=1) - 1
        self.pending: list[int] = []
        self.held = ""  # decoded, not printed yet: it may be the start of a stop string
        self.ended = False  # a stop string was printed up to

    def __call__(self, tokens: list[int]) -> bool:
        if self.enabled and not self.ended:
            from specrun.models.loader import decode_tokens

            self.pending.extend(t for t in tokens if t not in self.stop_ids)
            text = decode_tokens(self.tokenizer, self.pending)
            if not text.endswith("\ufffd"):
                self.pending.clear()
                self._write(text, final=False)
        return False

    def finish(self) -> None:
        if self.enabled:
            from specrun.models.loader import decode_tokens

            if not self.ended:
                self._write(decode_tokens(self.tokenizer, self.pending), final=True)
            sys.stdout.write("\n")
            sys.stdout.flush()

    def _write(self, text: str, final: bool) -> None:
        from specrun.decoding.stops import first_stop

        text, self.held = self.held + text, ""
        cut = first_stop(text, self.stop) if self.stop else None
        if cut is not None:
            text, self.ended = text[:cut], True
        elif not final and self.keep:
            split = max(0, len(text) - self.keep)
            text, self.held = text[:split], text[split:]
        sys.stdout.write(text)
        sys.stdout.flush()
