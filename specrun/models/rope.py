"""--rope-scaling TYPE:FACTOR: context extension applied to a model's config as it is loaded (its files never change):
the context becomes the original length x FACTOR. Only position-pure types (a position's rotary never depends on the
forward) may be set; a job records it as an output setting (job.json model.rope_scaling), so a resume keeps it.
"""

from __future__ import annotations

TYPES = ("linear", "yarn")  # set by a run; a model's own config may declare others (decoder.check_supported)


def parse_rope_scaling(spec: str) -> tuple[str, float]:
    """'yarn:16' -> ('yarn', 16.0); ValueError naming the fault."""
    kind, sep, factor = str(spec).partition(":")
    if not sep or kind not in TYPES:
        raise ValueError(f"--rope-scaling {spec!r}: expected TYPE:FACTOR with TYPE one of {', '.join(TYPES)} "
                         f"(e.g. yarn:16)")
    try:
        f = float(factor)
    except ValueError:
        f = float("nan")
    if not 1.0 < f <= 1024:  # NaN fails too
        raise ValueError(f"--rope-scaling {spec!r}: FACTOR must be a number above 1 and at most 1024")
    return kind, f


def apply_rope_scaling(config, spec: str | None) -> None:
    """Set the rope of `config` (a transformers config, changed in place) to `spec`; nothing for None. The original
    length is the config's own original_max_position_embeddings where it declares one, else its context."""
    if not spec:
        return
    kind, factor = parse_rope_scaling(spec)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    old = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    original = int(old.get("original_max_position_embeddings") or text.max_position_embeddings)
    theta = old.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    params = {"rope_type": kind, "factor": factor, "rope_theta": theta}
    if kind == "yarn":
        params["original_max_position_embeddings"] = original
    text.rope_parameters = params
    text.max_position_embeddings = int(original * factor)
