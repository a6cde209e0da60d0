"""Turn a prompts file + settings into a job directory: validate everything first (writing nothing on error), then
create the job, or reuse an existing one with identical input/model/params, or refuse saying what differs.

The prompts are read once, validated and hashed in the same pass, so a pipe or FIFO is hashed by what it held.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from specrun import __version__
from specrun.decoding.drafters.heads import read_heads_config
from specrun.decoding.drafters.recurrent_files import any_builtin_drafter
from specrun.decoding.engine import EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.errors import describe_os_error
from specrun.jobs.inputs import read_prompts
from specrun.jobs.jobdir import JobDir, JobError, engine_json, manifest_differences
from specrun.jobs.modelinfo import ModelInfo
from specrun.jobs.runopts import check_checkpoint
from specrun.storage.schemas import SCHEMA_VERSION


def default_job_dir(prompts_path: str | Path) -> Path:
    """specrun-jobs/STEM of a prompts file; a pipe's name (/dev/fd/63) says nothing of what it held: ValueError."""
    path = Path(prompts_path)
    if path.exists() and not path.is_file():
        raise ValueError(f"{str(path)!r} is not a file (a pipe?): its name does not name its job, give --job-dir")
    return Path("specrun-jobs") / path.stem


def check_names(*paths: str | Path) -> None:
    """Paths that Ray and the job files take as text: a name of undecodable bytes (surrogate escapes) cannot go."""
    for path in paths:
        try:
            str(path).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{str(path)!r} is not valid UTF-8 (a name in another encoding): rename it") from None


def check_drafting(engine: EngineConfig) -> None:
    """What a worker would refuse of the drafting settings whatever the model, refused before the job is written:
    heads asked without --heads, heads without their files, a recurrent drafter asked where none is given or ships."""
    have_heads = engine.heads_path is not None
    if have_heads:
        read_heads_config(engine.heads_path)  # ValueError naming the missing file
    have_drafter = engine.drafter_path is not None and (engine.drafter_path != "auto" or any_builtin_drafter())
    engine.active_drafters(have_heads, have_drafter, can_quantize=True)  # the 4-bit copy: the model decides


@dataclasses.dataclass(frozen=True)
class JobSettings:
    dtype: str = "float32"
    device: str = "cpu"
    trust_remote_code: bool = False
    checkpoint_every: int = 2048
    checkpoint_seconds: float = 60.0
    rope_scaling: str | None = None  # 'TYPE:FACTOR' (models/rope.py): an output setting

    def __post_init__(self):
        check_checkpoint(self.checkpoint_every, self.checkpoint_seconds)


def build_manifest(prompts_path: Path, input_sha: str, n_prompts: int, info: ModelInfo, settings: JobSettings,
                   params: SamplingParams, engine: EngineConfig) -> dict:
    return {
        "specrun_version": __version__, "schema_version": SCHEMA_VERSION, "created_at": time.time(),
        "input": {"path": str(prompts_path.resolve()), "sha256": input_sha, "n_prompts": n_prompts},
        "model": {"arg": info.arg, "path": info.path, "fingerprint": info.fingerprint, "dtype": settings.dtype,
                  "device": settings.device, "trust_remote_code": settings.trust_remote_code,
                  "rope_scaling": settings.rope_scaling},
        "params": json.loads(json.dumps(dataclasses.asdict(params))),  # stop tuples -> lists, as read back
        "engine": engine_json(engine),
        "checkpoint": {"every": settings.checkpoint_every, "seconds": settings.checkpoint_seconds},
    }


def prepare_job(prompts_path: str | Path, job_dir: str | Path, info: ModelInfo, settings: JobSettings,
                params: SamplingParams, engine: EngineConfig, columns=None) -> tuple[JobDir, bool]:
    """-> (job, created). Raises InputError (bad lines) or JobError (existing job differs) before writing anything.
    columns: a Parquet input's (parquet_in.Columns)."""
    prompts_path = Path(prompts_path)
    check_names(prompts_path, job_dir)
    check_drafting(engine)
    records, input_sha = read_prompts(prompts_path, info.tokenizer, info.max_context, info.vocab_size, params,
                                      columns=columns)
    manifest = build_manifest(prompts_path, input_sha, len(records), info, settings, params, engine)
    job = JobDir(job_dir)
    if not job.exists():
        try:
            _check_ours(job)
            job.acquire_lock()  # before any file: a second submit names this one, a half-created job is ours to redo
            try:
                if not job.exists():
                    job.remove_leftovers(_check_ours(job))
                    job.create(manifest, records)
                    return job, True
            finally:
                job.release_lock()
        except OSError as e:  # a path under a file, a read-only or virtual file system, no space
            raise JobError(f"cannot create the job in {job.root}: {_creation_problem(job.root, e)}") from None
    diffs = manifest_differences(job.manifest(), manifest)
    if diffs:
        raise JobError(f"job {job.root} exists with different settings, refusing to mix them:\n  "
                       + "\n  ".join(diffs) + "\nuse another --job-dir, or `specrun resume " + str(job.root)
                       + "` to continue it as it was")
    return job, False


def _creation_problem(root, e: OSError) -> str:
    """What stopped a job's creation, naming the file that a local path runs through where that is it."""
    if isinstance(e, NotADirectoryError) and isinstance(root, Path):
        blocker = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            return f"{blocker} is a file, not a folder"
    return describe_os_error(e)


def _check_ours(job: JobDir) -> list[str]:
    """The leftovers of an interrupted creation in the job directory; JobError when it holds anything else."""
    leftovers = job.creation_leftovers()
    if leftovers is None:
        raise JobError(f"{job.root} exists, is not empty and is not a specrun job; choose another --job-dir")
    return leftovers
