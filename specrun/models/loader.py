"""Load a local HF causal-LM directory (or the built-in demo or smollm2) into a LoadedModel: model, tokenizer, eos ids.

load_model(path="demo", dtype, device) -> LoadedModel; decode_tokens (models/detokenize.py) re-exported;
output_text(tokenizer, ids, finish_reason, params) -> the text a generation returns (cut before its stop).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specrun.decoding.kernels.kernel_build import cpu_flags
from specrun.decoding.verify.stops import first_stop
from specrun.models.cache import is_cached
from specrun.models.detokenize import decode_tokens  # also imported from here (the loader's public API)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEMO = "demo"
AUTO_DTYPE = "auto"
FINGERPRINT_CHUNK = 1 << 20  # bytes read from the start and the end of each weight file
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# Small files that change what the model outputs (eos ids, tokenization): hashed whole.
FINGERPRINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class LoadedModel:
    model: "torch.nn.Module"  # PreTrainedModel: eval(), requires_grad off, on device/dtype; attn impl set by the engine
    tokenizer: object  # PreTrainedTokenizerBase
    path: str  # resolved model directory ("demo" resolves to the cached demo directory)
    eos_ids: frozenset  # frozenset[int]: generation_config.eos_token_id (int or list) ∪ tokenizer.eos_token_id
    vocab_size: int  # model OUTPUT vocabulary (lm_head rows); may exceed len(tokenizer)
    max_context: int  # config.max_position_embeddings
    fingerprint: str  # 16 hex chars identifying config + weights (see model_fingerprint)
    is_demo: bool
    dtype: torch.dtype
    device: torch.device


def parse_dtype(dtype: str) -> torch.dtype:
    """'float32' | 'float64' | 'bfloat16' | 'float16' -> torch dtype; ValueError naming the bad value otherwise."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def cpu_has_bf16() -> bool:
    """Native bfloat16 dot products (AVX512-BF16 or AMX): there bf16 matmuls beat float32 (~3x measured on EPYC)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype a model directory declares (config.json `dtype`, or `torch_dtype`); float32 when it declares none."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    declared = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return declared if declared in DTYPES else "float32"


def default_dtype(model_dir: Path, device: str) -> str:
    """What `--dtype auto` means: the checkpoint's own dtype, where this device computes it natively.

    A bfloat16/float16 checkpoint runs in bfloat16 on CPUs with native bf16 (else float32) and as declared on CUDA;
    float32 checkpoints (tiny test models, the proxy) stay float32. Reduced precision is lossless up to numerical near
    ties only (docs/design.md section 2; `specrun bench` reports them).
    """
    declared = checkpoint_dtype(model_dir)
    if declared not in ("bfloat16", "float16") or device.startswith("cuda"):
        return declared
    return "bfloat16" if cpu_has_bf16() else "float32"


def resolve_dtype(dtype: str, model: str, device: str) -> str:
    """`--dtype` value -> a concrete dtype name; ValueError (from resolve_model_dir) naming a bad model argument."""
    return default_dtype(resolve_model_dir(model)[0], device) if dtype == AUTO_DTYPE else dtype


def check_trust(trust_remote_code) -> None:
    """Only True runs a model's own Python code: a truthy string such as 'no' must not (ValueError)."""
    if not isinstance(trust_remote_code, bool):
        raise ValueError(f"trust_remote_code={trust_remote_code!r} must be True or False")


def parse_device(device: str) -> torch.device:
    """'cpu' | 'cuda' | 'cuda:N' -> torch.device; ValueError naming the value if unknown or CUDA is unavailable."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unsupported device {device!r}; expected cpu or cuda") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; expected cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


def resolve_model_dir(path: str) -> tuple[Path, bool]:
    """(directory, is_demo) for a model argument; builds the demo (or converts smollm2) on first use.

    ValueError naming a bad path, or the pip command when smollm2's package is missing.
    """
    from specrun.models.smollm2 import NAME as SMOLLM2
    from specrun.models.smollm2 import smollm2_dir
    from specrun.models.tiny import DEMO_NAME, demo_model_dir

    if path == DEMO:
        return demo_model_dir(), True
    if path == SMOLLM2:
        return smollm2_dir(), False
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"model path {path!r} does not exist (give a local HF model directory, 'smollm2' or 'demo')")
    if not p.is_dir():
        raise ValueError(f"model path {path!r} is not a directory (give a local HF model directory, 'smollm2' or "
                         f"'demo')")
    if not (p / "config.json").is_file():
        raise ValueError(f"model path {path!r} has no config.json; is it a Hugging Face model directory?")
    p = p.resolve()
    return p, is_cached(p, DEMO_NAME)


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over the small config/tokenizer files plus each weight file's name, size, first and last MiB -> hex[:16].

    Cheap for multi-GB checkpoints (reads at most 2 MiB per weight file).
    """
    h = hashlib.sha256()
    for name in FINGERPRINT_FILES:
        f = model_dir / name
        if f.is_file():
            h.update(f"{name}\0".encode())
            h.update(f.read_bytes())
    weights = sorted(f for f in model_dir.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    for f in weights:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(FINGERPRINT_CHUNK))
            if size > FINGERPRINT_CHUNK:
                fh.seek(max(FINGERPRINT_CHUNK, size - FINGERPRINT_CHUNK))
                h.update(fh.read(FINGERPRINT_CHUNK))
    return h.hexdigest()[:16]


def _eos_ids(model, tokenizer) -> frozenset:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def load_model(path: str = DEMO, dtype: str = "float32", device: str = "cpu",
               trust_remote_code: bool = False, rope_scaling: str | None = None) -> LoadedModel:
    """Load a local HF causal LM directory (local files only; no hub access) or the demo model ("demo").

    The model comes back in eval mode with gradients off, with attn_implementation="sdpa" (the engine swaps in its own).
    rope_scaling: 'TYPE:FACTOR' extends its context (models/rope.py).
    """
    check_trust(trust_remote_code)
    torch_dtype = parse_dtype(dtype)
    dev = parse_device(device)
    model_dir, is_demo = resolve_model_dir(path)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specrun.decoding.forward.decoder import check_supported
    from specrun.models.rope import apply_rope_scaling
    from specrun.models.tiny import quiet_progress_bars

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    apply_rope_scaling(config, rope_scaling)
    check_supported(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    try:
        with quiet_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, config=config, dtype=torch_dtype, local_files_only=True,
                trust_remote_code=trust_remote_code, attn_implementation="sdpa",
            )
    except (OSError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 - the weights are the model directory's: e.g. a pickled checkpoint that
        # torch's weights-only loader refuses (it could run code) is this directory's fault, named as such
        raise ValueError(f"{model_dir}: its weights cannot be loaded ({type(e).__name__}: {str(e)[:300]})") from None
    model.to(dev)
    model.eval()
    model.requires_grad_(False)
    out_emb = model.get_output_embeddings()
    vocab = int(out_emb.weight.shape[0]) if out_emb is not None else int(model.config.vocab_size)
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=str(model_dir),
        eos_ids=_eos_ids(model, tokenizer),
        vocab_size=vocab,
        max_context=int(text_config.max_position_embeddings),
        fingerprint=model_fingerprint(model_dir),
        is_demo=is_demo,
        dtype=torch_dtype,
        device=dev,
    )


def output_text(tokenizer, ids, finish_reason: str, params) -> str:
    """The text of a generation as returned (OpenAI semantics): when it finished on a stop ("stop"), without the stop
    token, or without the stop string and anything after it. token_ids keep the token that completed the stop."""
    ids = list(ids)
    stopped = finish_reason == "stop" and bool(ids)
    if stopped and ids[-1] in params.stop_token_ids:
        return decode_tokens(tokenizer, ids[:-1])
    text = decode_tokens(tokenizer, ids)
    cut = first_stop(text, params.stop) if stopped and params.stop else None
    return text if cut is None else text[:cut]
