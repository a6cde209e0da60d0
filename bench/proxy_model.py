"""Train a small Llama-style proxy model + byte-level BPE tokenizer on the Python standard library's own sources.

python bench/proxy_model.py [--minutes 20 | --steps N] [--seed 0] [--out DIR] -> an HF model dir loadable by load_model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

NAME = "proxy-v1"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
HELDOUT_EVERY = 20  # every 20th file (sorted order) is held out
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def default_out() -> Path:
    env = os.environ.get("SPECRUN_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "specrun"
    return root / NAME


def stdlib_files(limit: int = 0) -> list[Path]:
    """Every .py file of the standard library (no site-packages), sorted by relative path; first `limit` if > 0."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    rel: list[str] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip]  # pruned: site-packages can hold far more than the stdlib
        base = Path(d).relative_to(root)
        rel.extend((base / n).as_posix() for n in names if n.endswith(".py"))
    files = [root / r for r in sorted(rel)]
    return files[:limit] if limit > 0 else files


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, heldout): every HELDOUT_EVERY-th file is held out."""
    held = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    train = [f for i, f in enumerate(files) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    return train, held


def read_text(f: Path) -> str:
    return f.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int, out_dir: Path, max_len: int):
    """Byte-level BPE (GPT-2 style pre-tokenization) trained on `files`; saved as tokenizer.json + configs."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer, length=len(files))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
           "unk_token": None, "model_max_length": max_len, "clean_up_tokenization_spaces": False,
           "split_special_tokens": True, "chat_template": CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}) + "\n")
    return tok


def encode_files(tok, files: list[Path]) -> torch.Tensor:
    """One stream '<s> file </s> <s> file </s> ...' of token ids -> [N] long."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([read_text(f) for f in files]):
        ids.extend(enc.ids)  # the post-processor adds <s>
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def make_model(args, vocab: int, special: dict[str, int]):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.max_position, tie_word_embeddings=False,
        bos_token_id=special[BOS], eos_token_id=special[EOS], pad_token_id=special[PAD], rms_norm_eps=1e-6,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=special[BOS], eos_token_id=special[EOS],
                                               pad_token_id=special[PAD])
    return model


def batch_at(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """stream [N], starts [B] -> windows [B, seq_len + 1]"""
    return stream[starts[:, None] + torch.arange(seq_len + 1)[None, :]]


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, windows: int) -> float:
    """Mean next-token loss over `windows` evenly spaced windows of the held-out stream."""
    model.eval()
    n = max(1, min(windows, (len(stream) - 1) // (seq_len + 1)))
    starts = torch.linspace(0, len(stream) - seq_len - 2, n).long()
    total = 0.0
    for chunk in starts.split(16):
        x = batch_at(stream, chunk, seq_len)
        total += float(_loss(model, x)) * len(chunk)
    model.train()
    return total / n


def _loss(model, x: torch.Tensor) -> torch.Tensor:
    """x [B, S+1] -> mean cross-entropy of predicting x[:, 1:] from x[:, :-1]."""
    logits = model(input_ids=x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


def lr_at(progress: float, args) -> float:
    """Linear warm-up over the first 3%, then cosine decay to 10% of --lr."""
    if progress < 0.03:
        return args.lr * max(progress / 0.03, 0.01)
    p = min(1.0, (progress - 0.03) / 0.97)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def train(model, stream: torch.Tensor, args, log) -> int:
    """Train until --steps steps (exact, deterministic) or --minutes of wall clock; returns the step count."""
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = args.minutes * 60.0
    t0, step, ema = time.perf_counter(), 0, None
    model.train()
    while True:
        elapsed = time.perf_counter() - t0
        progress = step / args.steps if args.steps else elapsed / budget
        if progress >= 1.0:
            return step
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, args)
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
        loss = _loss(model, batch_at(stream, starts, args.seq_len))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        value = loss.item()
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        if step % args.log_every == 0 or step == 1:
            log(f"step {step} loss {ema:.3f} lr {opt.param_groups[0]['lr']:.2e} {time.perf_counter() - t0:.0f}s")


def maybe_train_heads(model_dir: Path, train_files: list[Path], args, log) -> str:
    """Train draft heads into <model_dir>/heads (atomically) with specrun.train.heads when that module exists."""
    if args.heads_steps <= 0:
        return "skipped (--heads-steps 0)"
    try:
        from specrun.train.heads import train_heads
    except ImportError:
        log("specrun.train.heads is not available: draft heads not trained (run `specrun train-heads` later)")
        return "skipped (specrun.train.heads not available)"
    from specrun.models.loader import load_model

    lm = load_model(str(model_dir), dtype="float32", device="cpu")
    final = model_dir / "heads"
    log(f"training draft heads ({args.heads_steps} steps) into {final}")
    work = Path(tempfile.mkdtemp(prefix=".heads.tmp-", dir=model_dir))
    try:
        data = work / "stdlib.jsonl"  # train-heads reads .txt/.jsonl/.parquet: one {"text": file} line per source file
        with open(data, "w", encoding="utf-8") as fh:
            for f in train_files:
                fh.write(json.dumps({"text": read_text(f)}) + "\n")
        metrics = train_heads(lm, [str(data)], str(work / "heads"), seq_len=args.seq_len, steps=args.heads_steps,
                              lr=args.heads_lr, batch_size=args.batch_size, grad_accum=1,
                              warmup=max(1, args.heads_steps // 10), seed=args.seed,
                              heldout_fraction=0.01)  # evaluation of every held-out sequence dominates otherwise
        if final.exists():
            shutil.rmtree(final)
        os.rename(work / "heads", final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"draft heads: held-out loss {metrics.get('heldout_loss')}, top-1 accuracy {metrics.get('top1_accuracy')}")
    return str(final)


def build(args, log) -> Path:
    from specrun.models.tiny import quiet_progress_bars

    final = Path(args.out).expanduser() if args.out else default_out()
    if (final / "config.json").is_file() and not args.force:
        log(f"proxy model already at {final} (use --force to rebuild)")
        if not (final / "heads").exists():
            _finish_heads(final, split_files(stdlib_files(args.max_files))[0], args, log)
        return final
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    random.seed(args.seed)
    files = stdlib_files(args.max_files)
    train_files, held_files = split_files(files)
    if not held_files:
        held_files = train_files[-1:]
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        t0 = time.perf_counter()
        tok = train_tokenizer(train_files, args.vocab, tmp, args.max_position)
        special = {t: tok.token_to_id(t) for t in (BOS, EOS, PAD)}
        train_stream, held_stream = encode_files(tok, train_files), encode_files(tok, held_files)
        log(f"{len(train_files)} train / {len(held_files)} held-out files, {len(train_stream)} / {len(held_stream)} "
            f"tokens, vocab {tok.get_vocab_size()} ({time.perf_counter() - t0:.0f}s)")
        model = make_model(args, tok.get_vocab_size(), special)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"model: {n_params / 1e6:.2f}M params, hidden {args.hidden}, {args.layers} layers, seq {args.seq_len}")
        t1 = time.perf_counter()
        steps = train(model, train_stream, args, log)
        train_s = time.perf_counter() - t1
        loss = heldout_loss(model, held_stream, args.seq_len, args.eval_windows)
        log(f"held-out loss {loss:.4f} (ppl {math.exp(loss):.2f}) after {steps} steps, {train_s:.0f}s")
        model.eval()
        with quiet_progress_bars():
            model.save_pretrained(tmp)
        info = {"name": NAME, "seed": args.seed, "steps": steps, "train_seconds": round(train_s, 1),
                "heldout_loss": round(loss, 4), "train_tokens": len(train_stream), "heldout_tokens": len(held_stream),
                "params": n_params, "args": vars(args), "python": sys.version.split()[0]}
        (tmp / "proxy_info.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
        os.chmod(tmp, 0o755)
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _finish_heads(final, train_files, args, log)
    log(f"proxy model ready: {final}")
    return final


def _finish_heads(final: Path, train_files: list[Path], args, log) -> None:
    heads = maybe_train_heads(final, train_files, args, log)
    info_file = final / "proxy_info.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    info["heads"] = heads
    tmp = info_file.with_name(f".{info_file.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=2, default=str) + "\n")
    os.replace(tmp, info_file)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help=f"model directory (default $SPECRUN_CACHE/{NAME} or ~/.cache/specrun/{NAME})")
    p.add_argument("--force", action="store_true", help="rebuild even if the output directory exists")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget (step count depends on the machine)")
    p.add_argument("--steps", type=int, default=0, help="train exactly this many steps instead (fully deterministic)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (default hidden*8/3)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-position", type=int, default=32768, help="config.max_position_embeddings (generation limit)")
    p.add_argument("--max-files", type=int, default=0, help="use only the first N stdlib files (tests)")
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--heads-steps", type=int, default=300, help="draft-head training steps (0 = skip)")
    p.add_argument("--heads-lr", type=float, default=5e-3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)
    for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "seq_len", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error(f"--hidden {args.hidden} must divide by --heads {args.heads}, and --heads by --kv-heads {args.kv_heads}")
    if args.steps <= 0 and args.minutes <= 0:
        p.error(f"--minutes must be > 0 when --steps is not given, got {args.minutes}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    build(args, lambda m: print(m, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
