"""Train TokenSwift draft heads with the model frozen: loss = sum_i CE(l_i at t, token t+i+1), AdamW + warmup/cosine.

train_heads(lm, data_files, out_dir, ...) -> metrics (held-out loss before/after, top-1 of l_0..l_gamma); fit_heads.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specrun.decoding.drafters.heads import DraftHeads, model_dims, save_heads
from specrun.train.data import pack_sequences

ProgressFn = Callable[[int, int, float, float], None]  # (step, total_steps, loss, lr)


def _validate(lm, seq_len, steps, lr, batch_size, grad_accum, warmup, weight_decay, heldout_fraction, gamma,
              logit_chunk) -> None:
    checks = (("--seq-len", seq_len, seq_len >= gamma + 2, f"an integer >= {gamma + 2} (gamma + 2)"),
              ("--steps", steps, steps >= 1, "an integer >= 1"),
              ("--lr", lr, lr > 0, "> 0"),
              ("--batch-size", batch_size, batch_size >= 1, "an integer >= 1"),
              ("--grad-accum", grad_accum, grad_accum >= 1, "an integer >= 1"),
              ("--warmup", warmup, warmup >= 0, "an integer >= 0"),
              ("--weight-decay", weight_decay, weight_decay >= 0, ">= 0"),
              ("--heldout-fraction", heldout_fraction, 0 < heldout_fraction < 1, "in (0, 1)"),
              ("logit_chunk", logit_chunk, logit_chunk >= 1, "an integer >= 1"))
    for name, value, ok, want in checks:
        if not ok:
            raise ValueError(f"{name} {value!r} is invalid: expected {want}")
    if seq_len > lm.max_context:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's context length {lm.max_context}")


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, then cosine down to 0."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def hidden_states(model, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> h0 [B, T, H]: the base model's post-final-norm last hidden state (what the LM head reads)."""
    with torch.no_grad():
        base = model.base_model
        if base is not model:
            return base(input_ids=ids).last_hidden_state
        return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> float32 for the softmax; float32/float64 unchanged."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _chunks(n: int, batch: int, logit_chunk: int):
    step = max(1, logit_chunk // batch)
    for s in range(0, n, step):
        yield s, min(n, s + step)


def loss_and_backward(heads: DraftHeads, h0: torch.Tensor, ids: torch.Tensor, lm_head, scale: float,
                      logit_chunk: int) -> float:
    """h0 [B, T, H], ids [B, T]: backprop scale * sum_i mean CE(l_i[t], ids[t+i+1]) into the heads; returns the loss.

    Logits are built logit_chunk tokens at a time (the [gamma, B, T, V] tensor never exists at once).
    """
    B, T = ids.shape
    hs = heads(h0)  # [G, B, T, H]
    leaf = hs.detach().requires_grad_(True)
    wdtype = lm_head.weight.dtype
    total = 0.0
    for j in range(heads.gamma):
        shift, n = j + 2, T - (j + 2)  # head j+1 at t predicts token t + j + 2
        for s, e in _chunks(n, B, logit_chunk):
            logits = _upcast(lm_head(leaf[j, :, s:e].to(wdtype)))  # [B, c, V]
            ce = F.cross_entropy(logits.flatten(0, 1), ids[:, s + shift:e + shift].flatten(), reduction="sum") / (B * n)
            (ce * scale).backward()
            total += float(ce.detach())
    hs.backward(leaf.grad)
    return total


@torch.no_grad()
def evaluate(lm, heads: DraftHeads, seqs: torch.Tensor, batch_size: int, logit_chunk: int) -> dict:
    """Held-out seqs [N, T] -> {"loss": sum of head mean CEs, "loss_per_head": [...], "top1": {"l0", "head1", ...}}."""
    model, lm_head = lm.model, lm.model.get_output_embeddings()
    wdtype = lm_head.weight.dtype
    G = heads.gamma
    correct = torch.zeros(G + 1, dtype=torch.float64)
    counts = torch.zeros(G + 1, dtype=torch.float64)
    ce_sum = torch.zeros(G + 1, dtype=torch.float64)
    for b in range(0, seqs.shape[0], batch_size):
        ids = seqs[b:b + batch_size].to(lm.device)
        B, T = ids.shape
        h0 = hidden_states(model, ids)
        hs = heads(h0.to(heads.linears[0].weight.dtype))  # [G, B, T, H]
        for j in range(G + 1):
            shift, n = j + 1, T - (j + 1)
            src = h0 if j == 0 else hs[j - 1]  # j = 0: the model's own head
            for s, e in _chunks(n, B, logit_chunk):
                logits = _upcast(lm_head(src[:, s:e].to(wdtype)))  # [B, c, V]
                tgt = ids[:, s + shift:e + shift]
                correct[j] += float((logits.argmax(-1) == tgt).sum())
                ce_sum[j] += float(F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum"))
                counts[j] += tgt.numel()
    mean_ce = (ce_sum / counts).tolist()
    top1 = {("l0" if j == 0 else f"head{j}"): float(correct[j] / counts[j]) for j in range(G + 1)}
    return {"loss": float(sum(mean_ce[1:])), "loss_per_head": mean_ce[1:], "loss_l0": mean_ce[0], "top1": top1}


def _split(n: int, heldout_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, held-out indices) of n sequences; at least one of each; deterministic in seed."""
    n_held = min(n - 1, max(1, round(n * heldout_fraction)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[n_held:].sort().values, perm[:n_held].sort().values


def _batches(train_idx: torch.Tensor, per_step: int, steps: int, seed: int) -> torch.Tensor:
    """[steps, per_step] training-sequence indices: seeded epoch permutations laid end to end."""
    g = torch.Generator().manual_seed(seed + 1)
    need = steps * per_step
    epochs = [train_idx[torch.randperm(train_idx.numel(), generator=g)] for _ in range(-(-need // train_idx.numel()))]
    return torch.cat(epochs)[:need].view(steps, per_step)


def train_heads(lm, data_files: Sequence, out_dir, **kw) -> dict:
    """fit_heads(lm, data_files, **kw) (same keywords), then save_heads to out_dir (heads.safetensors + heads.json).

    Returns the metrics, which heads.json also holds. out_dir is checked before training starts.
    """
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ValueError(f"--out {str(out_dir)!r} exists and is not a directory")
    heads, metrics = fit_heads(lm, data_files, **kw)
    save_heads(heads, out_dir, lm, metrics)
    return metrics


def fit_heads(lm, data_files: Sequence, *, seq_len: int = 8192, steps: int = 200, lr: float = 5e-3,
              batch_size: int = 1, grad_accum: int = 1, warmup: int = 50, weight_decay: float = 0.1,
              heldout_fraction: float = 0.05, gamma: int = 3, branch_norm: bool = False, seed: int = 0,
              logit_chunk: int = 2048, progress: ProgressFn | None = None) -> tuple[DraftHeads, dict]:
    """Train gamma draft heads on the frozen lm -> (heads in float32, eval mode, metrics). Deterministic in seed.

    Heads train in float32 whatever lm.dtype is; the metrics hold held-out loss before/after and each head's
    top-1 accuracy on the held-out sequences (l0 = the model's own next-token head).
    """
    _validate(lm, seq_len, steps, lr, batch_size, grad_accum, warmup, weight_decay, heldout_fraction, gamma,
              logit_chunk)
    t0 = time.monotonic()
    model = lm.model
    model.eval()
    model.requires_grad_(False)
    lm_head = model.get_output_embeddings()
    hidden, _ = model_dims(lm)
    eos = lm.tokenizer.eos_token_id if lm.tokenizer.eos_token_id is not None else min(lm.eos_ids, default=None)
    seqs = pack_sequences(lm.tokenizer, data_files, seq_len, eos, min_sequences=2)
    train_idx, held_idx = _split(seqs.shape[0], heldout_fraction, seed)
    held = seqs[held_idx]

    torch.manual_seed(seed)
    heads = DraftHeads(hidden, gamma=gamma, branch_norm=branch_norm).to(device=lm.device, dtype=torch.float32)
    before = evaluate(lm, heads, held, batch_size, logit_chunk)
    heads.train()
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup))
    order = _batches(train_idx, batch_size * grad_accum, steps, seed)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        cur_lr = opt.param_groups[0]["lr"]
        loss = 0.0
        for micro in order[step].view(grad_accum, batch_size):
            ids = seqs[micro].to(lm.device)
            h0 = hidden_states(model, ids).float()
            loss += loss_and_backward(heads, h0, ids, lm_head, 1.0 / grad_accum, logit_chunk) / grad_accum
        opt.step()
        sched.step()
        losses.append(loss)
        if progress is not None:
            progress(step + 1, steps, loss, cur_lr)
    heads.eval()
    after = evaluate(lm, heads, held, batch_size, logit_chunk)
    metrics = {
        "steps": steps, "seq_len": seq_len, "batch_size": batch_size, "grad_accum": grad_accum, "lr": lr,
        "warmup": warmup, "weight_decay": weight_decay, "seed": seed,
        "train_sequences": int(train_idx.numel()), "heldout_sequences": int(held_idx.numel()),
        "train_tokens": int(train_idx.numel() * seq_len), "heldout_tokens": int(held_idx.numel() * seq_len),
        "final_train_loss": losses[-1], "heldout_loss_untrained": before["loss"], "heldout_loss": after["loss"],
        "heldout_loss_per_head": after["loss_per_head"], "heldout_loss_l0": after["loss_l0"],
        "top1_accuracy_untrained": before["top1"], "top1_accuracy": after["top1"],
        "seconds": round(time.monotonic() - t0, 3),
    }
    heads.requires_grad_(False)
    return heads, metrics
