"""What the driver needs to know about a model without loading its weights: tokenizer, context, vocab, fingerprint.

Weights are loaded only by the workers; the fingerprint is the same function they check against.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    arg: str  # as given ("demo" or a path)
    path: str  # resolved directory
    fingerprint: str
    tokenizer: object
    max_context: int
    vocab_size: int  # output vocabulary (config.vocab_size)
    is_demo: bool


def model_info(model: str, trust_remote_code: bool = False, rope_scaling: str | None = None) -> ModelInfo:
    """Tokenizer + config of a local model directory (or 'demo'); ValueError naming the path when unusable.
    rope_scaling: 'TYPE:FACTOR' (models/rope.py): max_context is the extended one."""
    from transformers import AutoConfig, AutoTokenizer

    from specrun.decoding.forward.decoder import check_supported
    from specrun.models.loader import check_trust, model_fingerprint, resolve_model_dir
    from specrun.models.rope import apply_rope_scaling

    check_trust(trust_remote_code)
    model_dir, is_demo = resolve_model_dir(model)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    apply_rope_scaling(cfg, rope_scaling)
    check_supported(cfg)  # refused before anything starts, naming the architecture or feature
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return ModelInfo(model, str(model_dir), model_fingerprint(model_dir), tok, int(text_cfg.max_position_embeddings),
                     int(text_cfg.vocab_size), is_demo)
