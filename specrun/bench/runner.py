"""Side-by-side benchmark: HF generate (AR, prompt lookup) and specrun configurations, interleaved and repeated.
By default the specrun configurations of a repeat run in lockstep, a step each in turn, so they share the host's load.

run_bench(lm, hf_lm, prompt_ids, params, base, settings) -> raw per-run measurements (report.summarize aggregates them).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from specrun.bench.clock import LengthClock, sync
from specrun.bench.hf import run_hf
from specrun.bench.llama_cpp import run_llama_cpp
from specrun.decoding.config import resolve_drafting
from specrun.decoding.drafters.quant_draft import compilable
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify.params import SamplingParams

HF_PROMPT_LOOKUP_TOKENS = 10


@dataclass(frozen=True)
class RunSpec:
    """One benchmarked configuration: HF generate kwargs (kind "hf") or EngineConfig overrides (kind "specrun")."""

    name: str
    kind: str  # "hf" | "llama_cpp" | "specrun"
    overrides: tuple[tuple[str, object], ...] = ()
    needs_heads: bool = False  # gets heads_path=--heads; skipped without heads or engine support
    by_name: bool = False  # runs only where --runs names it


# The table of configurations; ablations are rows. specrun_spec = the engine flags as given (default drafters).
DEFAULT_RUNS: tuple[RunSpec, ...] = (
    RunSpec("hf_ar", "hf"),
    RunSpec("hf_prompt_lookup", "hf", (("prompt_lookup_num_tokens", HF_PROMPT_LOOKUP_TOKENS),)),
    RunSpec("llama_cpp", "llama_cpp"),  # where llama-cpp-python and a GGUF file of the model are at hand
    RunSpec("specrun_ar", "specrun", (("drafters", ()),)),
    RunSpec("specrun_spec", "specrun"),
    RunSpec("ngram_only", "specrun", (("drafters", ("ngram",)),)),
    RunSpec("recycling_only", "specrun", (("drafters", ("recycling",)),)),
    RunSpec("recurrent_only", "specrun", (("drafters", ("recurrent",)),)),  # skipped without a recurrent drafter
    RunSpec("heads_partial", "specrun", (("drafters", ("heads",)), ("kv_mode", "partial")), needs_heads=True),
    # fused drafting in place of the self-draft forward, beside the other drafters
    RunSpec("fused_spec", "specrun", (("drafters", ("fused", "ngram", "recycling")),), needs_heads=True),
    # the layers compiled by inductor (decoding/forward/compiled.py; specrun_* may run them too, where compile_layers
    # auto finds them cached): about a minute a package the first time on a machine, a second or two after
    RunSpec("compiled_ar", "specrun", (("drafters", ()), ("compile_layers", "on")), by_name=True),
    RunSpec("compiled_spec", "specrun", (("compile_layers", "on"),), by_name=True),
    # specrun_spec with the 4-bit draft never compiled: what compile_draft auto changes on long runs
    RunSpec("eager_draft_spec", "specrun", (("compile_draft", "off"),), by_name=True),
)


def select_runs(only: str | None) -> tuple[RunSpec, ...]:
    """--runs: the rows named in a comma list (ValueError naming one that is not a row), else every row but those that
    run only by name."""
    if not only:
        return tuple(r for r in DEFAULT_RUNS if not r.by_name)
    keep = {r.strip() for r in only.split(",") if r.strip()}
    unknown = sorted(keep - {r.name for r in DEFAULT_RUNS})
    if unknown:
        raise ValueError(f"unknown run {unknown[0]!r}; choose from {', '.join(r.name for r in DEFAULT_RUNS)}")
    return tuple(r for r in DEFAULT_RUNS if r.name in keep)


@dataclass(frozen=True)
class BenchSettings:
    max_tokens: int  # tokens generated per run (max(lengths) when lengths are given)
    repeat: int = 3
    lengths: tuple[int, ...] = ()  # report throughput when each of these generated lengths is reached
    warmup: int = 16  # untimed tokens generated once per configuration first (0 = none)
    heads_path: str | None = None
    lockstep: bool = True  # a repeat's specrun runs take turns a step at a time (each timed by its own steps only);
    # False: one whole run after another (each engine alone in memory)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.repeat < 1:
            raise ValueError(f"repeat={self.repeat} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")
        bad = [n for n in self.lengths if not 1 <= n <= self.max_tokens]
        if bad:
            raise ValueError(f"length {bad[0]} must be in [1, max_tokens={self.max_tokens}]")


@dataclass
class Measurement:
    """One timed generation."""

    name: str
    repeat: int
    token_ids: list[int]
    seconds: float  # the run's own time, prefill included (in lockstep: the sum of its own steps)
    at_length: dict[int, float] = field(default_factory=dict)  # generated length -> seconds when first reached
    stats: dict = field(default_factory=dict)  # specrun GenerationResult.stats ({} for HF)


def plan(base: EngineConfig, heads_path: str | None, runs=DEFAULT_RUNS) -> tuple[list[tuple[RunSpec, object]], list[str]]:
    """Resolve each row to an EngineConfig (specrun) or kwargs dict (hf); rows that cannot run are dropped with a note.

    With heads_path (and an engine that knows it) every specrun row gets it, so specrun_spec drafts with heads too.
    """
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    planned, notes = [], []
    if heads_path and "heads_path" in names:
        base = dataclasses.replace(base, heads_path=heads_path)  # specrun_spec: every drafter, heads included
    elif base.drafters and "heads" in base.drafters and not getattr(base, "heads_path", None):
        base = dataclasses.replace(base, drafters=tuple(d for d in base.drafters if d != "heads"))
        notes.append("specrun_spec drafts without 'heads': no --heads given")
    for spec in runs:
        over = dict(spec.overrides)
        if spec.kind != "specrun":
            planned.append((spec, over))
            continue
        if spec.needs_heads:
            if not heads_path:
                notes.append(f"{spec.name} skipped: no --heads given")
                continue
            over["heads_path"] = heads_path
        missing = sorted(set(over) - names)
        if missing:
            notes.append(f"{spec.name} skipped: this engine's EngineConfig has no field {', '.join(missing)}")
            continue
        try:
            config = dataclasses.replace(base, **over)
            check = getattr(config, "active_drafters", None)  # engines with optional heads validate names here
            if check is not None:  # (a recurrent drafter is only known once the model is loaded: drop_unrunnable)
                check(bool(config.heads_path) if "heads_path" in names else False, True, True)
        except (ValueError, TypeError) as e:
            notes.append(f"{spec.name} skipped: {e}")
            continue
        planned.append((spec, config))
    return planned, notes


def drop_unrunnable(planned: list, lm, notes: list[str]) -> list:
    """The planned rows whose drafters can run on lm (a recurrent drafter needs one made for it)."""
    keep = []
    for spec, config in planned:
        if spec.kind == "specrun":
            try:
                resolve_drafting(config, lm, None)
            except ValueError as e:
                notes.append(f"{spec.name} skipped: {e}")
                continue
        keep.append((spec, config))
    return keep


EAGER_DRAFT_NOTE = ("the quantized self-draft ran uncompiled: no package of it is cached for this model, specrun and "
                    "CPU, and runs asking under 4,096 tokens do not build one; --compile-draft on builds it once (about "
                    "a minute) and later runs load it in about a second")


class _Stepped:
    """One specrun run driven a step at a time (Engine.steps), timed by its own steps only."""

    def __init__(self, lm, config: EngineConfig, prompt_ids: list[int], params: SamplingParams, lengths=()):
        self.device = lm.device
        engine = Engine(lm, config)
        engine.prepare(params)  # construction and compiling are not timed
        draft = engine.quant
        self.draft_compile_s = getattr(draft, "compile_seconds", None)  # loading (or building) its packages
        self.draft_built = getattr(draft, "built", None)  # packages built here (0: every one loaded from the cache)
        self.draft_eager = compilable(draft)  # torch's 4-bit draft left uncompiled (a failed compile warned already)
        layers = engine.runner.decoder.compiled if engine.runner.compiled else None
        rows = {1: "1 row", 0: "n rows"}  # its packages: built here, or loaded from the cache (seconds)
        self.layers = None if layers is None else {"built": {rows[k]: s for k, s in layers.compile_seconds.items()},
                                                   "loaded": {rows[k]: s for k, s in layers.load_seconds.items()}}
        self.steps = engine.steps(prompt_ids, params)
        self.clock = LengthClock(tuple(lengths))
        self.seconds, self.result = 0.0, None

    def advance(self) -> bool:
        """One step (the first also prefills); False once the run has ended."""
        sync(self.device)
        t = time.perf_counter()
        try:
            emitted = next(self.steps)  # = send(None): go on
        except StopIteration as end:
            self.result = end.value
            emitted = []
        sync(self.device)
        self.seconds += time.perf_counter() - t
        self.clock.add(len(emitted), self.seconds)
        return self.result is None

    def outcome(self) -> tuple[list[int], float, dict, dict]:
        n = self.result.stats.get("new_tokens", len(self.result.token_ids))
        # the engine's own seconds are wall time since its start: in lockstep they include the other runs' steps
        stats = {**self.result.stats, "seconds": self.seconds, "tokens_per_s": n / self.seconds if self.seconds else 0.0,
                 "draft_compile_seconds": self.draft_compile_s,  # loading or building the draft's packages, untimed
                 "draft_packages_built": self.draft_built,  # (both summed over the runs sharing its decoder)
                 "draft_eager": self.draft_eager, "layers_packages": self.layers}
        return self.result.token_ids, self.seconds, self.clock.at, stats


def run_specrun(lm, config: EngineConfig, prompt_ids: list[int], params: SamplingParams, lengths=()):
    """A fresh Engine (cold drafters: no recycling state from earlier runs) -> (tokens, seconds, {length: s}, stats)."""
    return run_lockstep(lm, [config], prompt_ids, params, lengths)[0]


def run_lockstep(lm, configs: list[EngineConfig], prompt_ids: list[int], params: SamplingParams, lengths=()
                 ) -> list[tuple[list[int], float, dict, dict]]:
    """Several configurations side by side: each takes a step in turn, in order, until all have ended; each is timed
    by its own steps, so a slow spell of a shared host falls on all of them alike. -> per config as run_specrun"""
    runs = [_Stepped(lm, c, prompt_ids, params, lengths) for c in configs]
    live = list(runs)
    while live:
        live = [r for r in live if r.advance()]
    return [r.outcome() for r in runs]


def bench_params(params: SamplingParams, n: int) -> SamplingParams:
    """What every run generates with: exactly n tokens (EOS ignored, no stop strings or stop token ids)."""
    return dataclasses.replace(params, max_tokens=n, ignore_eos=True, stop=(), stop_token_ids=())


def run_bench(lm, hf_lm, prompt_ids: list[int], params: SamplingParams, planned, settings: BenchSettings,
              log: Callable[[str], None] = lambda m: None, between: Callable[[], None] = lambda: None,
              llama=None) -> list[Measurement]:
    """Every planned configuration `repeat` times, interleaved (the order rotates each repeat); warm-up untimed. With
    settings.lockstep a repeat's specrun runs go first, in lockstep (run_lockstep), then its HF runs one by one.
    `between` runs before the first repeat and after each (untimed: the bench's bandwidth probes). llama: the
    llama_cpp row's model (bench/llama_cpp.py).

    params.max_tokens is overridden by settings.max_tokens and stop rules are off so every run has the same length.
    """
    params = bench_params(params, settings.max_tokens)
    warm = dataclasses.replace(params, max_tokens=min(settings.warmup, settings.max_tokens)) if settings.warmup else None

    def once(spec: RunSpec, target, p: SamplingParams, lengths) -> tuple[list[int], float, dict, dict]:
        if spec.kind == "hf":
            toks, s, at = run_hf(hf_lm, prompt_ids, p, p.max_tokens, target, lengths)
            return toks, s, at, {}
        if spec.kind == "llama_cpp":
            clock = LengthClock(tuple(lengths))
            toks, s = run_llama_cpp(llama, prompt_ids, p, p.max_tokens, clock)
            return toks, s, clock.at, {}
        return run_specrun(lm, target, prompt_ids, p, lengths)

    if warm is not None:
        for spec, target in planned:
            once(spec, target, warm, ())
    out: list[Measurement] = []
    between()
    for r in range(settings.repeat):
        k = r % len(planned)
        order = planned[k:] + planned[:k]
        together = [(spec, t) for spec, t in order if spec.kind == "specrun"] if settings.lockstep else []
        done = {}
        if together:
            outcomes = run_lockstep(lm, [t for _, t in together], prompt_ids, params, settings.lengths)
            done = {spec.name: o for (spec, _), o in zip(together, outcomes)}
        for spec, target in order:
            toks, seconds, at, stats = done.get(spec.name) or once(spec, target, params, settings.lengths)
            out.append(Measurement(spec.name, r, toks, seconds, at, stats))
            log(f"repeat {r + 1}/{settings.repeat} {spec.name}: {len(toks)} tokens, {len(toks) / seconds:.1f} tok/s")
        between()
    return out
