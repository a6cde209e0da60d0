"""`specrun generate`: one prompt through the engine, streamed to the terminal or printed as one JSON object.

Thin: validates flags into SamplingParams/EngineConfig and calls specrun.LLM (stream, or generate for --json).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specrun.cli.options import (
    engine_config_from,
    engine_options,
    model_options,
    rope_option,
    sampling_options,
    sampling_params_from,
)

if TYPE_CHECKING:  # torch's modules load when a command runs, not for --help
    from specrun.llm import LLM


def load_for_cli(model: str, dtype: str, device: str, trust_remote_code: bool, rope_scaling: str | None = None):
    """LoadedModel (ModelError names a bad value); the demo model's notice on stderr."""
    from specrun.llm import DEMO_NOTICE, load_lm

    lm = load_lm(model, dtype, device, trust_remote_code, rope_scaling)
    if lm.is_demo:
        click.echo(DEMO_NOTICE, err=True)
    return lm


def open_llm(model: str, dtype: str, device: str, trust_remote_code: bool, config, rope_scaling=None) -> LLM:
    """specrun.LLM with its demo warning said as the CLI says it (one line on stderr)."""
    from specrun.llm import DEMO_NOTICE, LLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(model, dtype=dtype, device=device, drafting=config, trust_remote_code=trust_remote_code, chat=False,
                  rope_scaling=rope_scaling)
    if llm.lm.is_demo:
        click.echo(DEMO_NOTICE, err=True)
    return llm


def chat_prompt(tokenizer, text: str, chat: bool):
    """--chat: the text as one user message (for the chat template); else the text itself."""
    if not chat:
        return text
    from specrun.models.prompts import user_message

    if not getattr(tokenizer, "chat_template", None):
        raise click.UsageError("--chat: this model's tokenizer has no chat template")
    try:
        return user_message(text)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def encode_prompt(lm, text: str, chat: bool) -> list[int]:
    """Token ids of the prompt; with chat, the text is one user message under the model's chat template."""
    from specrun.models.prompts import encode

    prompt = chat_prompt(lm.tokenizer, text, chat)
    try:
        return encode(lm.tokenizer, lm.vocab_size, "messages" if chat else "prompt", prompt)[1]
    except ValueError as e:
        raise click.ClickException(str(e)) from e


def read_prompt(path: Path) -> str:
    """--prompt-file's text; BadParameter naming the file and line where it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")  # universal newlines, as ever: a CRLF file's tokens unchanged
    except UnicodeDecodeError as e:
        data = path.read_bytes()
        line = data.count(b"\n", 0, e.start) + 1
        raise click.BadParameter(f"{str(path)!r} is not valid UTF-8 (byte 0x{data[e.start]:02x} on line {line})",
                                 param_hint="--prompt-file") from None


chat_option = click.option("--chat", is_flag=True,
                           help="Send the prompt as a user message through the model's chat template (instruct models).")


@click.command()
@click.option("--prompt", help="Prompt text.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Read the prompt text from this file.")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="Most new tokens to generate.")
@chat_option
@model_options
@rope_option
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
    text = prompt if prompt is not None else read_prompt(prompt_file)
    params = sampling_params_from(kw, max_tokens)
    llm = open_llm(model, dtype, device, trust_remote_code, engine_config_from(kw), kw.get("rope_scaling"))
    request = chat_prompt(llm.tokenizer, text, chat)
    if as_json:
        click.echo(json.dumps(llm.generate([request], params)[0].to_json()))
        return
    stream = llm.stream(request, params)
    for delta in stream:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    out = stream.output
    s = out.stats
    click.echo(f"[{len(out.token_ids)} tokens, {s['tokens_per_s']:.1f} tok/s, {s['mean_accepted']:.2f} accepted/step, "
               f"finish: {out.finish_reason}]", err=True)
