"""TokenSwift draft heads: gamma chained residual linear heads h_i = f_i(h_{i-1}) + h_{i-1} on the model's h0.

DraftHeads(H, gamma).logits(h0, lm_head) -> [gamma, ..., V] (l_1..l_gamma); save_heads / load_heads check the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

FORMAT_VERSION = 1
WEIGHTS_FILE = "heads.safetensors"
CONFIG_FILE = "heads.json"


class DraftHeads(nn.Module):
    """gamma residual heads; f_i = Linear(H, H) (after an RMSNorm when branch_norm), zero-initialised.

    Untrained (zero) heads give h_i = h0, so every l_i equals the model's own l_0.
    """

    def __init__(self, hidden_size: int, gamma: int = 3, branch_norm: bool = False, eps: float = 1e-6):
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.hidden_size, self.gamma, self.branch_norm, self.eps = int(hidden_size), int(gamma), bool(branch_norm), eps
        self.linears = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(gamma))
        self.norms = nn.ModuleList(nn.RMSNorm(hidden_size, eps=eps) for _ in range(gamma)) if branch_norm else None
        for lin in self.linears:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, h0: torch.Tensor) -> torch.Tensor:
        """h0 [..., H] (post-final-norm last hidden state) -> hs [gamma, ..., H] = h_1..h_gamma."""
        out, h = [], h0
        for i, lin in enumerate(self.linears):
            branch = self.norms[i](h) if self.norms is not None else h
            h = lin(branch) + h
            out.append(h)
        return torch.stack(out)

    def logits(self, h0: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """h0 [..., H], the model's own LM head -> [gamma, ..., V] = lm_head(h_i) (l_0 = lm_head(h0) not included)."""
        hs = self(h0.to(self.linears[0].weight.dtype))
        return lm_head(hs.to(_head_dtype(lm_head, hs.dtype)))

    def config(self) -> dict:
        return {"gamma": self.gamma, "hidden_size": self.hidden_size, "branch_norm": self.branch_norm, "eps": self.eps}


def _head_dtype(lm_head: nn.Module, default: torch.dtype) -> torch.dtype:
    w = getattr(lm_head, "weight", None)
    return w.dtype if isinstance(w, torch.Tensor) else default


def model_dims(lm) -> tuple[int, int]:
    """(hidden size H, output vocab V) of a LoadedModel, read from its LM head (falls back to the config)."""
    head = lm.model.get_output_embeddings()
    w = getattr(head, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return int(w.shape[1]), int(w.shape[0])
    cfg = lm.model.config.get_text_config() if hasattr(lm.model.config, "get_text_config") else lm.model.config
    return int(cfg.hidden_size), int(lm.vocab_size)


def save_heads(heads: DraftHeads, out_dir, lm, metrics: dict | None = None) -> Path:
    """Write out_dir/heads.safetensors then out_dir/heads.json (atomically, JSON last) -> out_dir."""
    from safetensors.torch import save

    from specrun.storage.atomic import atomic_write_bytes, atomic_write_json

    hidden, vocab = model_dims(lm)
    if heads.hidden_size != hidden:
        raise ValueError(f"heads have hidden size {heads.hidden_size} but the model has {hidden}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    atomic_write_bytes(out / WEIGHTS_FILE, save(tensors))
    meta = {"format_version": FORMAT_VERSION, "model_fingerprint": lm.fingerprint, "model_path": str(lm.path),
            **heads.config(), "vocab_size": vocab}
    if metrics:
        meta["metrics"] = metrics
    atomic_write_json(out / CONFIG_FILE, meta)
    return out


def read_heads_config(path) -> dict:
    """heads.json of a heads directory (or of the directory holding a given heads.json / heads.safetensors)."""
    d = _heads_dir(path)
    try:
        meta = json.loads((d / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"heads config {str(d / CONFIG_FILE)!r} is unreadable: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"heads config {str(d / CONFIG_FILE)!r} is not a JSON object")
    return meta


def _heads_dir(path) -> Path:
    p = Path(path).expanduser()
    if p.is_file() and p.name in (CONFIG_FILE, WEIGHTS_FILE):
        p = p.parent
    if not p.exists():
        raise ValueError(f"heads path {str(path)!r} does not exist (give the --out directory of `specrun train-heads`)")
    if not p.is_dir():
        raise ValueError(f"heads path {str(path)!r} is not a directory (give the --out directory of `specrun train-heads`)")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (p / name).is_file():
            raise ValueError(f"heads directory {str(path)!r} has no {name}; was `specrun train-heads` run into it?")
    return p


def load_heads(path, lm) -> DraftHeads:
    """DraftHeads from a heads directory, on lm.device / lm.dtype, eval, no grad; ValueError on any model mismatch."""
    from safetensors.torch import load_file

    d = _heads_dir(path)
    meta = read_heads_config(d)
    where = f"heads at {str(d)!r}"
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{where}: unsupported format_version {meta.get('format_version')!r} (expected {FORMAT_VERSION})")
    hidden, vocab = model_dims(lm)
    checks = (("model fingerprint", lm.fingerprint, meta.get("model_fingerprint")),
              ("hidden size", hidden, meta.get("hidden_size")),
              ("vocab size", vocab, meta.get("vocab_size")))
    for what, expected, got in checks:
        if expected != got:
            raise ValueError(f"{where} do not match model {str(lm.path)!r}: {what} mismatch, the model has {expected!r} "
                             f"but the heads were trained for {got!r} (train heads for this model with "
                             f"`specrun train-heads --model {lm.path}`)")
    try:
        gamma = int(meta["gamma"])
        heads = DraftHeads(hidden, gamma=gamma, branch_norm=bool(meta.get("branch_norm", False)),
                           eps=float(meta.get("eps", 1e-6)))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: bad heads.json ({e})") from e
    heads.to(device=lm.device, dtype=lm.dtype)  # before loading: load_state_dict casts into the existing dtype
    try:
        state = load_file(str(d / WEIGHTS_FILE))
        heads.load_state_dict(state, strict=True)
    except Exception as e:  # safetensors header errors, missing/unexpected keys, wrong shapes
        raise ValueError(f"{where}: {WEIGHTS_FILE} does not match heads.json (gamma={gamma}, hidden={hidden}): {e}") from e
    heads.eval()
    heads.requires_grad_(False)
    return heads
