"""Train the recurrent drafter with the model frozen: unrolled over `depth` tokens, each level distilled from the model.

Level j at position t reads the model's hidden state h_t and the true tokens x_{t+1..t+j}; its target is the model's
own next-token distribution at t+j (over the drafter's vocabulary), so it learns what AR samples, not one sample.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specrun.decoding.drafters.heads import model_dims
from specrun.decoding.drafters.recurrent import RecurrentDraft
from specrun.train.data import pack_sequences
from specrun.train.heads import _batches, _split, hidden_states, lr_factor

ProgressFn = Callable[[int, int, float, float], None]  # (step, total_steps, loss, lr)
FEATURE_BATCH = 4  # sequences per frozen-model forward when caching hidden states


def frequent_vocab(seqs: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """The n most frequent token ids of seqs (ties: lower id), sorted -> [min(n, vocab)] long."""
    counts = torch.bincount(seqs.flatten(), minlength=vocab)[:vocab].double()
    counts -= torch.arange(vocab, dtype=torch.float64) * 1e-9  # deterministic tie break
    return torch.topk(counts, min(n, vocab)).indices.sort().values


@torch.no_grad()
def cache_hidden(lm, seqs: torch.Tensor) -> torch.Tensor:
    """The frozen model's post-norm hidden states, in the model's dtype. # seqs: [S, T] -> [S, T, H]"""
    parts = [hidden_states(lm.model, seqs[i:i + FEATURE_BATCH].to(lm.device)).cpu()
             for i in range(0, seqs.shape[0], FEATURE_BATCH)]
    return torch.cat(parts)


def unrolled_loss(drafter: RecurrentDraft, h: torch.Tensor, ids: torch.Tensor, embed_w: torch.Tensor,
                  head_w: torch.Tensor, depth: int) -> tuple[torch.Tensor, list[float]]:
    """Mean over levels of the soft cross-entropy between the model's distribution and the drafter's, both over
    the drafter's vocabulary; also each level's top-1 agreement with the model.

    # h: [B, T, H] float32, ids: [B, T], embed_w: [V, H], head_w: [N, H] -> (loss, [depth] agreement)
    """
    B, T, _ = h.shape
    M = T - depth  # positions t with all of x_{t+1..t+depth} and h_{t+depth} inside the sequence
    with torch.no_grad():
        target = F.softmax(F.linear(h, head_w), dim=-1)  # [B, T, N] the model's own distribution per position
    s, total, agree = h[:, :M], 0.0, []
    for j in range(1, depth + 1):
        s = drafter(s, embed_w[ids[:, j:M + j]])  # [B, M, H] guesses the token after x_{t+j}
        logq = F.log_softmax(F.linear(s, head_w), dim=-1)
        p = target[:, j:M + j]
        total = total + (-(p * logq).sum(-1)).mean()
        agree.append(float((logq.argmax(-1) == p.argmax(-1)).float().mean()))
    return total / depth, agree


def fit_recurrent(lm, data_files: Sequence, *, seq_len: int = 512, steps: int = 1000, lr: float = 2e-3,
                  batch_size: int = 8, warmup: int = 50, weight_decay: float = 0.0, heldout_fraction: float = 0.05,
                  depth: int = 4, ffn_size: int = 1152, n_vocab: int = 8192, seed: int = 0,
                  progress: ProgressFn | None = None) -> tuple[RecurrentDraft, dict]:
    """Train a RecurrentDraft on the frozen lm -> (drafter in float32, metrics). Deterministic in seed (same threads)."""
    for name, value, ok, want in (
            ("--seq-len", seq_len, seq_len > depth + 1, f"an integer > {depth + 1} (--depth + 1)"),
            ("--steps", steps, steps >= 1, "an integer >= 1"), ("--lr", lr, lr > 0, "> 0"),
            ("--batch-size", batch_size, batch_size >= 1, "an integer >= 1"),
            ("--depth", depth, depth >= 1, "an integer >= 1"), ("--ffn-size", ffn_size, ffn_size >= 1, "an integer >= 1"),
            ("--vocab", n_vocab, n_vocab >= 1, "an integer >= 1"), ("--warmup", warmup, warmup >= 0, "an integer >= 0"),
            ("--heldout-fraction", heldout_fraction, 0 < heldout_fraction < 1, "in (0, 1)")):
        if not ok:
            raise ValueError(f"{name} {value!r} is invalid: expected {want}")
    if seq_len > lm.max_context:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's context length {lm.max_context}")
    t0 = time.monotonic()
    hidden, vocab = model_dims(lm)
    eos = lm.tokenizer.eos_token_id if lm.tokenizer.eos_token_id is not None else min(lm.eos_ids, default=None)
    seqs = pack_sequences(lm.tokenizer, data_files, seq_len, eos, min_sequences=2)
    train_idx, held_idx = _split(seqs.shape[0], heldout_fraction, seed)
    vocab_ids = frequent_vocab(seqs[train_idx], n_vocab, vocab)
    coverage = float(torch.isin(seqs[held_idx], vocab_ids).float().mean())
    feats = cache_hidden(lm, seqs)  # [S, T, H] on the CPU: batches move to the model's device as they are used
    dev = lm.device
    embed_w = lm.model.get_input_embeddings().weight.detach().float()
    head_w = lm.model.get_output_embeddings().weight.detach()[vocab_ids.to(dev)].float()
    torch.manual_seed(seed)
    drafter = RecurrentDraft(hidden, ffn_size, vocab_ids).to(dev)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup))
    order = _batches(train_idx, batch_size, steps, seed)
    held = _evaluate(drafter, feats[held_idx], seqs[held_idx], embed_w, head_w, depth, batch_size)
    loss = float("nan")
    for step in range(steps):
        idx = order[step]
        cur_lr = opt.param_groups[0]["lr"]
        opt.zero_grad(set_to_none=True)
        with _amp(lm):
            out, _ = unrolled_loss(drafter, feats[idx].to(dev).float(), seqs[idx].to(dev), embed_w, head_w, depth)
        out.backward()
        opt.step()
        sched.step()
        loss = float(out.detach())
        if progress is not None:
            progress(step + 1, steps, loss, cur_lr)
    after = _evaluate(drafter, feats[held_idx], seqs[held_idx], embed_w, head_w, depth, batch_size)
    drafter.eval()
    drafter.requires_grad_(False)
    metrics = {"steps": steps, "seq_len": seq_len, "batch_size": batch_size, "lr": lr, "depth": depth, "seed": seed,
               "train_tokens": int(train_idx.numel() * seq_len), "heldout_tokens": int(held_idx.numel() * seq_len),
               "vocab_coverage_heldout": coverage, "final_train_loss": loss,
               "heldout_loss_untrained": held["loss"], "heldout_loss": after["loss"],
               "heldout_top1_agreement_per_level": after["agree"], "seconds": round(time.monotonic() - t0, 1)}
    return drafter, metrics


def _amp(lm):
    """bf16 matmuls (float32 weights and optimizer) when the model itself runs in a 16-bit dtype: ~3x faster on CPUs
    with bf16 dot products and on GPUs; float32/float64 models train in their own precision."""
    if lm.dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(device_type=lm.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def _evaluate(drafter, feats, seqs, embed_w, head_w, depth, batch_size) -> dict:
    """Held-out loss and per-level top-1 agreement, in float32."""
    losses, agrees = [], []
    for i in range(0, seqs.shape[0], batch_size):
        dev = head_w.device
        loss, agree = unrolled_loss(drafter, feats[i:i + batch_size].to(dev).float(), seqs[i:i + batch_size].to(dev),
                                    embed_w, head_w, depth)
        losses.append(float(loss))
        agrees.append(agree)
    return {"loss": sum(losses) / len(losses), "agree": [sum(a[j] for a in agrees) / len(agrees) for j in range(depth)]}
