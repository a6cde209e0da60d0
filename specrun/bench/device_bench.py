"""Speed of the decode path on random-weight models shaped like real ones, built on the device from a config (their
text is noise; their step costs are the real model's): AR steps against the memory roofline, verify widths, batches.

random_model(shape, dtype, device) -> LoadedModel; decode_rates, verify_costs, engine_rates, quant_draft_rates,
batch_rates -> dicts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from specrun.bench.clock import sync as _sync
from specrun.bench.neartie import check_divergence
from specrun.bench.roofline import read_bandwidth, step_weight_bytes
from specrun.decoding.engine import BatchConfig, Engine, EngineConfig
from specrun.decoding.forward.paged_runner import kv_bytes_per_token
from specrun.decoding.forward.runner import ModelRunner
from specrun.decoding.forward.static_step import StaticStep, bucket_of
from specrun.decoding.verify.params import SamplingParams
from specrun.models.loader import LoadedModel

_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
# the published configs' shapes (config.json of each model); "tiny-*" are the CPU dry run's stand-ins
SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                         rope_theta=500000.0, rope_scaling=dict(factor=8.0, **_LLAMA3_ROPE)),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, rope_scaling=dict(factor=32.0, **_LLAMA3_ROPE)),
    "tiny-a": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False),
    "tiny-b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, vocab_size=512, tie_word_embeddings=True),
}


def random_model(shape: str, dtype: torch.dtype, device: str | torch.device, cycle: int = 0) -> LoadedModel:
    """A Llama of `shape` with random weights (std 0.02), built directly on the device (no files, no tokenizer).

    cycle > 0 (untied shapes): the same shapes and step cost, but every layer's output projections are zero (a token's
    hidden state is its own embedding) and the LM head sends each of `cycle` tokens to the next: its greedy text is
    that cycle, which the n-gram drafter copies whole (speculation's upper bound; random text is accepted ~never)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    dev = torch.device(device)
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, rms_norm_eps=1e-5, initializer_range=0.02)
    torch.manual_seed(0)
    try:  # the library's own init is skipped where it can be (ours follows): 8B parameters are not drawn twice
        from transformers.initialization import no_init_weights
    except ImportError:
        no_init_weights = contextlib.nullcontext
    with torch.device(dev), no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model = model.to(dev).eval().requires_grad_(False)
    with torch.no_grad():  # whatever the library's init left (empty memory on some paths), weights are N(0, 0.02)
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)  # norms
    if cycle:
        _make_cycle(model, cycle)
    return LoadedModel(model=model, tokenizer=None, path=f"random:{shape}" + (f"+cycle{cycle}" if cycle else ""),
                       eos_ids=frozenset(),
                       vocab_size=cfg.vocab_size, max_context=cfg.max_position_embeddings,
                       fingerprint="0" * 16, is_demo=False, dtype=dtype, device=dev)


def _make_cycle(model, n: int) -> None:
    """Zero o_proj and down_proj; head row of token c[i+1] = embedding of c[i], scaled so its logit (~0.25 sqrt(H))
    clears random rows' (std 0.02 sqrt(H), ~4.5 sigma at most over the vocabulary) by a wide margin."""
    if model.config.tie_word_embeddings:
        raise ValueError("a cycle model needs an untied LM head")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        tokens = torch.randperm(emb.shape[0] - 3, generator=torch.Generator().manual_seed(2))[:n] + 3
        for i in range(n):
            e = emb[tokens[i]].float()
            head[tokens[(i + 1) % n]] = (0.25 * e / e.norm()).to(head.dtype)
    model._specrun_cycle = tokens.tolist()


def _timed(fn, steps: int, device) -> float:
    """Mean seconds of fn() over `steps` calls after one untimed call (each call ends in a host sync)."""
    fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / steps


def decode_rates(lm: LoadedModel, contexts: list[int], steps: int, bandwidth: float | None = None) -> list[dict]:
    """One AR step (forward, LM head, argmax read on the host) with `context` committed keys (the cache filled
    synthetically): eager torch ops and the static step (CUDA graphs on CUDA), each against the memory roofline."""
    dev = lm.device
    runner = ModelRunner(lm, max_rows=64)
    runner.reset(max(contexts) + 64)
    static = StaticStep(runner)
    bandwidth = bandwidth or read_bandwidth(dev)
    weights, per_token = step_weight_bytes(lm), kv_bytes_per_token(lm.model.config, lm.dtype)
    one = torch.ones((1, 1), dtype=torch.bool, device=dev)
    token = torch.ones(1, dtype=torch.long, device=dev)
    out = []
    for c in contexts:
        runner.cache.length = c  # the step writes slot c each time and never commits it
        pos = torch.tensor([c], device=dev)
        eager = _timed(lambda: int(runner.logits(runner.forward(token, pos, one)).argmax()), steps, dev)
        graph = _timed(lambda: int(runner.logits(static.forward(token, pos)).argmax()), steps, dev)
        floor = (weights + per_token * c) / bandwidth
        out.append({"context": c, "static_bucket": bucket_of(c + 1, runner.cache.capacity),  # slots it attends
                    "eager_ms": eager * 1e3, "static_ms": graph * 1e3,
                    "eager_tokens_per_s": 1 / eager, "static_tokens_per_s": 1 / graph, "roofline_ms": floor * 1e3,
                    "eager_roofline_share": floor / eager, "static_roofline_share": floor / graph,
                    "static_graphs": static.graphs})
    runner.cache = None  # free the long cache before the next measurement
    return out


def verify_costs(lm: LoadedModel, context: int, widths: list[int], steps: int) -> list[dict]:
    """A verify forward of `width` rows (causal among themselves) after `context` keys, eager and by the static step
    (CUDA graphs on CUDA), and each one's cost over its own width 1."""
    dev = lm.device
    runner = ModelRunner(lm, max_rows=max(widths))
    runner.reset(context + max(widths))
    runner.cache.length = context
    static = StaticStep(runner)
    out = []
    for w in widths:
        tokens = torch.ones(w, dtype=torch.long, device=dev)
        pos = torch.arange(context, context + w, device=dev)
        mask = torch.ones((w, w), dtype=torch.bool, device=dev).tril_()
        s = _timed(lambda: int(runner.logits(runner.forward(tokens, pos, mask)).argmax(dim=-1)[-1]), steps, dev)
        g = _timed(lambda: int(runner.logits(static.forward(tokens, pos, mask)).argmax(dim=-1)[-1]), steps, dev)
        out.append({"context": context, "width": w, "ms": s * 1e3, "static_ms": g * 1e3})
    for row in out:
        row["vs_width_1"] = row["ms"] / out[0]["ms"]
        row["static_vs_width_1"] = row["static_ms"] / out[0]["static_ms"]
    runner.cache = None
    return out


def _prompts(lm: LoadedModel, n: int, length: int) -> list[list[int]]:
    """n different prompts: a cycle model's cycle from n starting points, else each a random phrase of 16 tokens
    repeated (repetitive, though a random model does not go on repeating it)."""
    cycle = getattr(lm.model, "_specrun_cycle", None)
    g = torch.Generator().manual_seed(1)
    phrases = [cycle[i % len(cycle):] + cycle[: i % len(cycle)] if cycle else
               torch.randint(3, lm.vocab_size, (16,), generator=g).tolist() for i in range(n)]
    return [(p * (length // len(p) + 1))[:length] for p in phrases]


def engine_rates(lm: LoadedModel, prompt_len: int, new_tokens: int) -> list[dict]:
    """The engine of one sequence end to end (greedy, EOS ignored; the prompt's prefill inside the timed run): AR and
    n-gram + recycling drafts, each with eager forwards and with the static step's (CUDA graphs on CUDA)."""
    prompt = _prompts(lm, 1, prompt_len)[0]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    runs = {"ar_eager": EngineConfig(drafters=(), step_graphs="off"),
            "ar_static": EngineConfig(drafters=(), step_graphs="on"),
            "spec_eager": EngineConfig(drafters=("ngram", "recycling"), step_graphs="off"),
            "spec": EngineConfig(drafters=("ngram", "recycling"), step_graphs="on")}
    timed = _generations(lm, prompt, params, runs)
    return [{"name": name, "tokens_per_s": len(res.token_ids) / s, "mean_accepted": res.stats["mean_accepted"],
             "equal_to_ar_eager": equal, "divergence": div} for name, res, s, equal, div in timed]


def _generations(lm: LoadedModel, prompt: list[int], params: SamplingParams, runs: dict[str, EngineConfig],
                 ref: list[int] | None = None) -> list[tuple]:
    """Each run's second generation of the prompt, timed (the first warms: the cache at its size, the graphs of its
    buckets), against ref (default: the first run's tokens). -> (name, result, seconds, equal, divergence as a dict or
    None: reduced precision parts at a near tie, else a fault)"""
    out = []
    for name, cfg in runs.items():
        engine = Engine(lm, cfg)
        engine.generate(prompt, params)
        _sync(lm.device)
        t = time.perf_counter()
        res = engine.generate(prompt, params)
        _sync(lm.device)
        s = time.perf_counter() - t
        ref = res.token_ids if ref is None else ref
        div = check_divergence(lm, prompt, params, ref, res.token_ids)
        out.append((name, res, s, res.token_ids == ref, None if div is None else div.as_dict()))
    return out


def quant_draft_rates(lm: LoadedModel, prompt_len: int, new_tokens: int, width: int = 4) -> list[dict]:
    """The 4-bit self-draft on the device (torch's int4 kernels: tinygemm on CUDA), one sequence at a fixed width
    against AR, both with the static step (greedy, EOS ignored): its cost a drafted token against an AR step with its
    depth a CUDA graph (spec_quant; its eager twin off CUDA) and eager (spec_quant_eager), and that the output is AR's
    (reduced precision: a near tie may part them). Random weights: acceptance means nothing."""
    from specrun.decoding.drafters.quant_draft import quantized
    from specrun.decoding.drafters.quant_static import StaticDraft
    from specrun.decoding.drafters.quant_torch import TorchForward
    from specrun.decoding.forward.decoder import FusedDecoder

    fwd = quantized(FusedDecoder.of(lm.model))
    if fwd is None:
        return [{"name": "spec_quant", "skipped": "no int4 kernel takes this model on this device"}]
    prompt = _prompts(lm, 1, prompt_len)[0]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    spec = EngineConfig(drafters=("quant",), trie_budget=width, adaptive_budget=False, step_graphs="on",
                        compile_draft="off")
    # the depth's CUDA graph (quant_static.py), elsewhere its eager twin (a dry run runs it), then the eager draft
    own = getattr(fwd, "static", None)
    graph = own or (StaticDraft(fwd) if isinstance(fwd, TorchForward) else None)
    drafts = {"spec_quant": graph, "spec_quant_eager": None} if graph is not None else {"spec_quant": None}
    gens = _generations(lm, prompt, params, {"ar_static": EngineConfig(drafters=(), step_graphs="on")})
    try:
        for name, static in drafts.items():
            if isinstance(fwd, TorchForward):
                fwd.static = static
            gens += _generations(lm, prompt, params, {name: spec}, ref=gens[0][1].token_ids)
    finally:
        if isinstance(fwd, TorchForward):
            fwd.static = own
    out = []
    for name, res, s, equal, div in gens:
        st = res.stats
        drafted = (st["mean_trie_nodes"] - 1) * st["steps"]
        out.append({"name": name, "tokens_per_s": len(res.token_ids) / s, "mean_accepted": st["mean_accepted"],
                    "step_ms": 1e3 * s / st["steps"], "bits": getattr(fwd, "bits", 4),
                    "draft_ms_per_node": 1e3 * st["phase_seconds"].get("draft", 0.0) / drafted if drafted else None,
                    "graphs": bool(drafts.get(name) is not None and drafts[name].graphs),
                    "equal_to_ar": equal, "divergence": div})
    return out


def batch_rates(lm: LoadedModel, levels: list[int], prompt_len: int, new_tokens: int,
                backends: list[str]) -> list[dict]:
    """Aggregate tok/s of the engine with several sequences, AR and n-gram speculation, at each concurrency and
    attention backend; per level, how many sequences' speculative tokens equal their AR tokens (reduced precision: near
    ties may part)."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    page = 16 if lm.device.type == "cuda" else prompt_len + new_tokens + 65
    out = []
    for backend in backends:  # untimed first: the backend's lazy set-up (the first batched run on an H200 ran at 1/3)
        Engine(lm, EngineConfig(drafters=("ngram",)), BatchConfig(concurrency=2, kv_tokens=2 * (prompt_len + 80),
                                                                  page_size=page, backend=backend)
               ).run([(i, p, dataclasses.replace(params, max_tokens=8), []) for i, p in
                     enumerate(_prompts(lm, 2, prompt_len))])
    for backend in backends:
        for c in levels:
            prompts = _prompts(lm, c, prompt_len)
            tokens = {}
            for name, drafters in (("ar", ()), ("spec", ("ngram",))):
                engine = Engine(lm, EngineConfig(drafters=drafters),
                                BatchConfig(concurrency=c, kv_tokens=c * (prompt_len + new_tokens + 65),
                                            page_size=page, backend=backend))
                _sync(lm.device)
                t = time.perf_counter()
                res = engine.run([(i, p, params, []) for i, p in enumerate(prompts)])
                _sync(lm.device)
                s = time.perf_counter() - t
                tokens[name] = {i: r.token_ids for i, r in res.items()}
                out.append({"backend": backend, "concurrency": c, "name": name,
                            "tokens_per_s": sum(len(r.token_ids) for r in res.values()) / s,
                            "mean_accepted": sum(r.stats["mean_accepted"] for r in res.values()) / c})
            out[-1]["equal_to_ar"] = sum(tokens["spec"][i] == tokens["ar"][i] for i in range(c))
    return out
