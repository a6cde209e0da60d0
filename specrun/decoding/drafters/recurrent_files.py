"""Recurrent drafter directories (drafter.safetensors + drafter.json) and the drafters shipped with specrun.

A drafter records its model's signature (dims and a hash of LM head rows); loading checks it, so a drafter never
drafts for another model. "auto" picks the shipped drafter whose signature matches the model, if one does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from specrun.decoding.drafters.heads import model_dims
from specrun.decoding.drafters.recurrent import RecurrentDraft

FORMAT_VERSION = 1
WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter.json"
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "models" / "drafters"  # one directory per shipped drafter
SIGNATURE_ROWS = 64


def model_signature(lm) -> str:
    """Hex digest of (hidden size, output vocab, the first LM head rows rounded to bf16): the same for a model loaded
    in any dtype from any copy of its weights."""
    hidden, vocab = model_dims(lm)
    rows = lm.model.get_output_embeddings().weight.detach()[:SIGNATURE_ROWS]
    h = hashlib.sha256(f"{hidden}:{vocab}:".encode())
    h.update(rows.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def save_drafter(drafter: RecurrentDraft, out_dir, lm, metrics: dict | None = None, dtype=torch.bfloat16) -> Path:
    """Write out_dir/drafter.safetensors then drafter.json (atomically, JSON last) -> out_dir."""
    from safetensors.torch import save

    from specrun.storage.atomic import atomic_write_bytes, atomic_write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in drafter.state_dict().items()}
    atomic_write_bytes(out / WEIGHTS_FILE, save(tensors))
    meta = {"format_version": FORMAT_VERSION, "kind": "recurrent", "model_signature": model_signature(lm),
            "model_path": str(lm.path), **drafter.config()}
    if metrics:
        meta["metrics"] = metrics
    atomic_write_json(out / CONFIG_FILE, meta)
    return out


def _read_config(d: Path) -> dict:
    try:
        meta = json.loads((d / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"drafter config {str(d / CONFIG_FILE)!r} is unreadable: {e}") from e
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION or meta.get("kind") != "recurrent":
        raise ValueError(f"drafter config {str(d / CONFIG_FILE)!r} is not a recurrent drafter of format "
                         f"{FORMAT_VERSION}")
    return meta


def any_builtin_drafter() -> bool:
    """Whether a drafter ships for some model (builtin_drafter finds the one for a model)."""
    return BUILTIN_DIR.is_dir() and any((p / CONFIG_FILE).is_file() for p in BUILTIN_DIR.iterdir())


def builtin_drafter(lm) -> Path | None:
    """The shipped drafter directory made for this model, or None."""
    if not BUILTIN_DIR.is_dir():
        return None
    sig = model_signature(lm)
    for d in sorted(p for p in BUILTIN_DIR.iterdir() if (p / CONFIG_FILE).is_file()):
        try:
            if _read_config(d).get("model_signature") == sig:
                return d
        except ValueError:
            continue
    return None


def load_drafter(path, lm) -> RecurrentDraft:
    """RecurrentDraft from a drafter directory, in lm.dtype on lm.device, eval, no grad; ValueError on a mismatch."""
    from safetensors.torch import load_file

    d = Path(path).expanduser()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (d / name).is_file():
            raise ValueError(f"drafter directory {str(path)!r} has no {name}; was `specrun train-drafter` run into it?")
    meta = _read_config(d)
    if meta.get("model_signature") != model_signature(lm):
        raise ValueError(f"drafter at {str(d)!r} was trained for another model ({meta.get('model_path')!r}), not "
                         f"{str(lm.path)!r}: train one with `specrun train-drafter --model {lm.path}`")
    try:
        state = load_file(str(d / WEIGHTS_FILE))
        drafter = RecurrentDraft(int(meta["hidden_size"]), int(meta["ffn_size"]), state["vocab_ids"],
                                 eps=float(meta["eps"]))
        drafter.load_state_dict(state, strict=True)
    except Exception as e:  # header errors, missing keys, wrong shapes
        raise ValueError(f"drafter at {str(d)!r}: {WEIGHTS_FILE} does not match {CONFIG_FILE}: {e}") from e
    drafter.to(device=lm.device, dtype=lm.dtype)
    drafter.eval()
    drafter.requires_grad_(False)
    return drafter
