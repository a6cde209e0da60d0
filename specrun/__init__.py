"""specrun: lossless speculative decoding for ultra-long generations, run as resumable Ray jobs.

Packages: decoding (engine, no Ray, no files), storage (Parquet, atomic files), jobs (driver), actors (Ray).
Python API (imported on first use, so `import specrun` stays cheap): LLM, Output, SamplingParams, EngineConfig
(specrun/llm.py); submit, resume, Job (specrun/job.py); ray_data.processor; errors: SpecrunError and its family.
"""

from __future__ import annotations

import importlib

from specrun.errors import ConfigError, InputError, ModelError, PromptError, SpecrunError

__version__ = "0.1.0"

_LAZY = {  # name -> module that defines it (torch, transformers and Ray load only when one is used)
    "LLM": "specrun.llm", "Output": "specrun.llm", "Delta": "specrun.llm", "Stream": "specrun.llm",
    "SamplingParams": "specrun.decoding.verify.params", "EngineConfig": "specrun.decoding.engine",
    "submit": "specrun.job", "resume": "specrun.job", "Job": "specrun.job", "RunOptions": "specrun.jobs.runopts",
    "JobError": "specrun.jobs.jobdir", "Columns": "specrun.jobs.parquet_in",
}
__all__ = [
    "LLM",
    "Columns",
    "ConfigError",
    "Delta",
    "EngineConfig",
    "InputError",
    "Job",
    "JobError",
    "ModelError",
    "Output",
    "PromptError",
    "RunOptions",
    "SamplingParams",
    "SpecrunError",
    "Stream",
    "ray_data",
    "resume",
    "submit",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name == "ray_data":
        return importlib.import_module("specrun.ray_data")
    raise AttributeError(f"module 'specrun' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
