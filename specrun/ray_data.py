"""Ray Data: specrun.ray_data.processor(...)(ds) runs specrun over a ray.data.Dataset by Dataset.map_batches on an actor
pool, one LLM (engine) per actor; a row with an id samples as the same row of a job does, so the outputs are a job's.

Use a job (specrun.submit) for long generations: it checkpoints and resumes; a map_batches task that dies starts over.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from specrun.actors.pool import worker_env
from specrun.decoding.engine import EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.errors import ConfigError, is_number, is_whole
from specrun.jobs.parquet_in import Columns, row_object

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "finish_reason", "stats")


class _Generate:
    """The map_batches callable class: loads the model once per actor, then generates each batch's rows at once, all
    on one thread of its own (Ray Data calls a class's __init__ and its batches on different threads:
    actors/compute.py)."""

    def __init__(self, model: str, dtype: str, device: str, drafting, sampling: SamplingParams, columns: Columns):
        from specrun.actors.compute import ComputeThread
        from specrun.llm import LLM

        self.compute = ComputeThread("specrun-ray-data")
        # rows read as a job reads them
        self.llm = self.compute.run(LLM, model, dtype=dtype, device=device, drafting=drafting, chat=False)
        self.sampling, self.columns = sampling, columns

    def __call__(self, batch):
        """pyarrow Table -> the same rows with OUTPUT_COLUMNS added."""
        import pyarrow as pa

        mapping = self.columns.mapping(batch.column_names)
        lines = [row_object(r, mapping) for r in batch.select(list(dict.fromkeys(mapping.values()))).to_pylist()]
        # with an id, a row is a prompts-file line (its seed derived from the id as a job derives it); without, a bare
        # prompt sampled with `sampling` as is (a row's place in a batch is no identity)
        prompts = [line if "id" in line else next(v for k, v in line.items() if k != "id") for line in lines]
        outs = self.compute.run(self.llm.generate, prompts, self.sampling) if prompts else []
        columns = {"generated_text": pa.array([o.text for o in outs], pa.string()),
                   "generated_token_ids": pa.array([o.token_ids for o in outs], pa.list_(pa.int64())),
                   "finish_reason": pa.array([o.finish_reason for o in outs], pa.string()),
                   "stats": pa.array([json.dumps(o.stats) for o in outs], pa.string())}
        for name, values in columns.items():
            batch = batch.append_column(name, values)
        return batch


@dataclass(frozen=True)
class Processor:
    """processor(ds) -> ds with OUTPUT_COLUMNS added (lazy, as every Dataset transform); `map_batches_kwargs` are
    what it passes to Dataset.map_batches, to call it yourself."""

    map_batches_kwargs: dict = field(default_factory=dict)

    def __call__(self, ds):
        if not hasattr(ds, "map_batches"):
            raise ConfigError(f"a processor runs over a ray.data.Dataset, got {type(ds).__name__}")
        return ds.map_batches(_Generate, **self.map_batches_kwargs)


def processor(model: str = "demo", sampling: SamplingParams | None = None, *, drafting: EngineConfig | str | None = None,
              dtype: str = "auto", device: str = "cpu", prompt_column: str | None = None,
              messages_column: str | None = None, id_column: str | None = None, concurrency: int = 1,
              batch_size: int = 16, num_gpus: float | None = None, num_cpus: float | None = None) -> Processor:
    """A Processor for Dataset.map_batches: `concurrency` actors (one model and engine each; num_gpus each, default 1
    with device cuda; num_cpus each, default with device cpu this machine's cores split between them, else 1: Ray
    runs an actor's torch on that many threads), `batch_size` rows generated at once per actor (one step for all).
    Columns as for a Parquet job (prompt, messages or input_ids; id when present)."""
    for name, value in (("concurrency", concurrency), ("batch_size", batch_size)):
        if not is_whole(value) or value < 1:
            raise ConfigError(f"{name}={value!r}: give a whole number of 1 or more")
    _check_actor_settings(model, sampling, drafting, dtype, device, num_gpus, num_cpus)
    columns = Columns(prompt_column, messages_column, id_column)
    columns.mapping([c for c in (prompt_column, messages_column, id_column) if c] or ["prompt"])  # checks the choice
    return Processor({
        "fn_constructor_kwargs": {"model": model, "dtype": dtype, "device": device, "drafting": drafting,
                                  "sampling": sampling or SamplingParams(), "columns": columns},
        "concurrency": concurrency, "batch_size": batch_size, "batch_format": "pyarrow",
        "num_gpus": num_gpus if num_gpus is not None else (1 if device.startswith("cuda") else 0),
        "num_cpus": num_cpus if num_cpus is not None else (
            max(1, (os.cpu_count() or 1) // concurrency) if device == "cpu" else 1),
        "runtime_env": {"env_vars": worker_env()},  # the job workers' malloc arenas (actors/pool.py)
    })


def _check_actor_settings(model, sampling, drafting, dtype, device, num_gpus, num_cpus) -> None:
    """ConfigError naming what every actor would fail to load with, here rather than as Ray's ActorDiedError later."""
    from specrun.job import check_model_settings
    from specrun.llm import drafting_config

    check_model_settings(model, dtype, device)
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise ConfigError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    drafting_config(drafting)
    for name, value in (("num_gpus", num_gpus), ("num_cpus", num_cpus)):
        if value is not None and not (is_number(value) and 0 <= value < float("inf")):
            raise ConfigError(f"{name}={value!r} must be a finite number >= 0 (or None: the default)")
