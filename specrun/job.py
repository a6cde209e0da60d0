"""specrun.submit / resume / Job: what `specrun submit | resume | status | export` do, callable from code (the CLI is a
thin layer over these). A run blocks in this process; failed prompts are recorded in the job, errors are raised.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from specrun.decoding.engine import EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.errors import ConfigError, ModelError, PromptError, SpecrunError, describe_os_error
from specrun.jobs.jobdir import JobDir, JobError
from specrun.jobs.parquet_in import Columns
from specrun.jobs.runopts import RunOptions, RunSummary


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


class Job:
    """A job directory (a path or an object-store URI). `summary` is the RunSummary of the run this object made."""

    def __init__(self, job_dir, created: bool = False):
        self.dir = JobDir(job_dir)
        self.created = created  # submit: True when this call created it, False when it found it (and resumed)
        self.summary: RunSummary | None = None
        self.model_path: str | None = None

    @property
    def root(self):
        return self.dir.root

    def __repr__(self) -> str:
        return f"Job({self.dir.location!r})"

    def run(self, options: RunOptions | None = None, view=None, **run_options) -> RunSummary:
        """Run every prompt not done yet (failed ones again) on Ray workers, here, until the job ends or Ctrl-C / SIGTERM
        (running prompts are checkpointed; a second Ctrl-C raises KeyboardInterrupt). run_options: RunOptions fields
        (actors, address, concurrency, quiet...; default quiet). JobError when no worker can run."""
        from specrun.jobs.driver import run_job
        from specrun.jobs.progress import make_view

        opts = options if options is not None else RunOptions(**{"quiet": True, **run_options})
        self.summary = run_job(self.dir, opts, view if view is not None else make_view(opts.quiet))
        return self.summary

    def status(self) -> dict:
        """What `specrun status --json` prints: per prompt state (pending, running, done, failed, repair), totals, runs."""
        from specrun.jobs.status import job_status

        return job_status(self.dir)

    def wait(self, timeout: float | None = None, interval: float = 2.0) -> dict:
        """Block until no prompt is left to run (each is done, or failed with no driver running: a run elsewhere, such
        as a --detach one, or this process's own) and return the last status; JobError after `timeout` seconds."""
        from specrun.jobs.watch import finished

        end = None if timeout is None else time.monotonic() + timeout
        while not finished(st := self.status()):
            if end is not None and time.monotonic() >= end:
                raise JobError(f"job {self.root}: {st['totals']['done']}/{st['totals']['total']} prompts done after "
                               f"{timeout:g} s")
            time.sleep(interval)
        return st

    def outputs(self, rows: bool = False):
        """The finished prompts' output rows in input order: a pyarrow Table (id, token_ids, text, finish_reason,
        stats as JSON...), or with rows=True an iterator of dicts (stats parsed), read one row group at a time."""
        from specrun.jobs.export import finished_table, iter_finished

        if rows:
            return _rows(iter_finished(self.dir, batches=True))
        return finished_table(self.dir)[0]


def _rows(batches) -> Iterator[dict]:
    for _, table in batches:
        for r in table.to_pylist():
            r["stats"] = json.loads(r["stats"])
            yield r


def prepare(prompts, job_dir=None, *, model: str = "demo", sampling: SamplingParams | None = None,
            drafting: EngineConfig | str | None = None, dtype: str = "auto", device: str = "cpu",
            trust_remote_code: bool = False, checkpoint_every: int = 2048, checkpoint_seconds: float = 60.0,
            columns: Columns | None = None, notice: Callable[[str], None] = _warn,
            rope_scaling: str | None = None) -> Job:
    """Validate every prompt and create the job (nothing is written if any is bad), or find the same job already
    there (Job.created False). prompts: a prompts.jsonl or Parquet path (columns: which hold the prompt and id), or a
    list of prompts (text, messages, token ids or prompts-file line dicts). InputError lists the bad lines; JobError
    when job_dir holds a job with other settings; ModelError for the model. rope_scaling: 'TYPE:FACTOR' extends the
    model's context (models/rope.py), an output setting of the job."""
    from specrun.jobs.modelinfo import model_info
    from specrun.jobs.submit import JobSettings, default_job_dir, prepare_job
    from specrun.llm import DEMO_NOTICE, drafting_config
    from specrun.models.loader import resolve_dtype

    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise ConfigError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if not isinstance(prompts, (str, os.PathLike, list, tuple)):
        raise PromptError(f"prompts must be a prompts file's path or a list of prompts, got {type(prompts).__name__}")
    check_settings(job_dir, model, dtype, device, trust_remote_code, checkpoint_every, checkpoint_seconds)
    try:
        info = model_info(model, trust_remote_code, rope_scaling)
        dtype = resolve_dtype(dtype, model, device)  # stored resolved: a resume computes in the same dtype anywhere
    except (ValueError, OSError) as e:
        raise ModelError(f"cannot load model {model!r}: {e}") from e
    settings = JobSettings(dtype, device, trust_remote_code, checkpoint_every, checkpoint_seconds, rope_scaling)
    if info.is_demo:
        notice(DEMO_NOTICE)
    engine = drafting_config(drafting)
    with _prompts_file(prompts) as path:
        try:
            job, created = prepare_job(path, job_dir or default_job_dir(path), info, settings,
                                       sampling or SamplingParams(), engine, columns)
        except (ValueError, OSError) as e:
            if isinstance(e, SpecrunError):
                raise
            raise ConfigError(describe_os_error(e) if isinstance(e, OSError) else str(e)) from e
    if not created:
        check_remote_code(job.manifest(), trust_remote_code, job.root)
    out = Job(job.root, created)
    out.model_path = info.path  # where the model is now (the job may have been made with it elsewhere)
    return out


def check_settings(job_dir, model, dtype, device, trust_remote_code, checkpoint_every, checkpoint_seconds) -> None:
    """ConfigError naming the first of a job's own settings that no run could use, before anything is written."""
    from specrun.jobs.runopts import check_checkpoint
    from specrun.storage.jobfs import ObjectPath

    if job_dir is not None and not isinstance(job_dir, (str, os.PathLike, ObjectPath)):
        raise ConfigError(f"job_dir={job_dir!r} must be a path or an object-store URI (or None: the default)")
    check_model_settings(model, dtype, device)
    check_remote_code_flag(trust_remote_code)
    try:
        check_checkpoint(checkpoint_every, checkpoint_seconds)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_model_settings(model, dtype, device) -> None:
    """ConfigError naming a model argument, dtype or device no worker could load with (whether the model is there is
    the loader's to say)."""
    from specrun.jobs.runopts import check_device
    from specrun.models.loader import AUTO_DTYPE, DTYPES

    if not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model={model!r} must be a model directory, 'smollm2' or 'demo'")
    if not isinstance(dtype, str) or (dtype != AUTO_DTYPE and dtype not in DTYPES):
        raise ConfigError(f"dtype={dtype!r}; expected auto or one of {', '.join(DTYPES)}")
    if device is None:
        raise ConfigError("device=None; expected cpu or cuda")
    try:
        check_device(device)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_hot_start(locations) -> None:
    """A local hot-start folder without a job.json would warm nothing and say nothing (ConfigError naming it)."""
    for loc in locations:
        if isinstance(loc, (str, os.PathLike)) and "://" not in os.fspath(loc) \
                and not (Path(os.fspath(loc)) / "job.json").is_file():
            raise ConfigError(f"{os.fspath(loc)!r} is not a specrun job (no job.json)")


def check_remote_code_flag(trust_remote_code) -> None:
    """Only True allows a model's own Python code: a string such as 'no' must not (ConfigError)."""
    from specrun.models.loader import check_trust

    try:
        check_trust(trust_remote_code)
    except ValueError as e:
        raise ConfigError(str(e)) from None


class _prompts_file:
    """A path as it is; a list of prompts as a temporary JSON-lines file (hashed by its bytes like any input) named
    by those bytes, so that the same list names the same default job (specrun-jobs/prompts-HASH) and resumes it."""

    def __init__(self, prompts):
        self.prompts, self.tmp = prompts, None

    def __enter__(self) -> Path:
        if isinstance(self.prompts, (str, os.PathLike)):
            return Path(os.fspath(self.prompts))
        from specrun.jobs.inputs import check_unicode
        from specrun.models.prompts import kind_of

        lines = [p if isinstance(p, dict) else {kind_of(p): p} for p in self.prompts]
        for i, line in enumerate(lines):
            try:
                check_unicode(line)  # a file's lines are checked as read: UTF-8 cannot hold a lone surrogate
            except ValueError as e:
                raise PromptError(f"prompt {i}: {e}") from None
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        self.tmp = Path(tempfile.mkdtemp(prefix="specrun-prompts-"))
        path = self.tmp / f"prompts-{hashlib.sha256(text.encode()).hexdigest()[:12]}.jsonl"
        path.write_text(text, encoding="utf-8")
        return path

    def __exit__(self, *exc):
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def check_remote_code(manifest: dict, given: bool, job_root) -> bool:
    """The job's trust_remote_code, only when it is given again: a job.json is data, not consent (JobError)."""
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    wanted = model.get("trust_remote_code", False) is not False
    if wanted and not given:
        raise JobError(f"job {job_root} runs its model with --trust-remote-code (Python code shipped in "
                       f"{model.get('path')!r}); give --trust-remote-code again to allow it")
    return wanted


def submit(prompts, job_dir=None, *, model: str = "demo", sampling: SamplingParams | None = None,
           drafting: EngineConfig | str | None = None, dtype: str = "auto", device: str = "cpu",
           trust_remote_code: bool = False, checkpoint_every: int = 2048, checkpoint_seconds: float = 60.0,
           columns: Columns | None = None, rope_scaling: str | None = None, **run_options) -> Job:
    """prepare() the job, then run it here to the end (Job.run; run_options: actors, address, concurrency, quiet...).
    Returns the Job: job.summary says what finished or failed, job.outputs() reads the rows. Submitting the same
    prompts and settings again resumes the job."""
    from specrun.llm import drafting_config

    for name, own in (("model_path", "model="), ("engine", "drafting=")):  # submit sets them from its own arguments
        if name in run_options:
            raise ConfigError(f"submit() takes {name} as {own}, not as a run option ({name} is resume's)")
    try:  # the run's options checked before the job is written (Job.run's own keywords aside)
        check_hot_start(RunOptions(**{k: v for k, v in run_options.items() if k not in ("options", "view")}).hot_start)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    job = prepare(prompts, job_dir, model=model, sampling=sampling, drafting=drafting, dtype=dtype, device=device,
                  trust_remote_code=trust_remote_code, checkpoint_every=checkpoint_every,
                  checkpoint_seconds=checkpoint_seconds, columns=columns, rope_scaling=rope_scaling)
    job.run(model_path=job.model_path, device=device, engine=None if drafting is None else drafting_config(drafting),
            checkpoint_every=checkpoint_every, checkpoint_seconds=checkpoint_seconds, **run_options)
    return job


def reopen(job_dir, model_path: str | None = None, trust_remote_code: bool = False) -> tuple[Job, str | None]:
    """(the existing job, the model's path to run it with): model_path, a new location of the job's model, must have
    its fingerprint; trust_remote_code must be given again for a job that uses it."""
    check_remote_code_flag(trust_remote_code)
    job = Job(job_dir)
    manifest = job.dir.manifest()
    remote_code = check_remote_code(manifest, trust_remote_code, job.root)
    if model_path is None:
        return job, None
    from specrun.jobs.modelinfo import model_info

    try:
        info = model_info(model_path, remote_code, manifest["model"].get("rope_scaling"))
    except (ValueError, OSError) as e:
        raise ModelError(f"cannot load model {model_path!r}: {e}") from e
    m = manifest["model"]
    if info.fingerprint != m["fingerprint"]:
        raise JobError(f"model {model_path!r} (fingerprint {info.fingerprint}) is not the job's model {m['path']!r} "
                       f"(fingerprint {m['fingerprint']}); refusing to resume")
    return job, info.path


def resume(job_dir, *, model_path: str | None = None, trust_remote_code: bool = False, **run_options) -> Job:
    """Continue an interrupted job from its checkpoints (failed prompts are retried), here, to the end. run_options:
    RunOptions fields; device, engine (an EngineConfig), checkpoint_every/seconds replace the job's for this run."""
    job, path = reopen(job_dir, model_path, trust_remote_code)
    view, options = run_options.pop("view", None), run_options.pop("options", None)
    try:
        options = options or RunOptions(**{"quiet": True, **run_options, "model_path": path})
        check_hot_start(options.hot_start)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    job.run(options, view)
    return job
