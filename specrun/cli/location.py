"""The click type of every job-directory argument and option: a local path (checked as click.Path checks it) or an
object-store URI (s3://bucket/prefix, gs://, abfs://; storage/objectfs.py), opened here so that a bad one is a usage
error naming it."""

from __future__ import annotations

import os
from pathlib import Path

import click

from specrun.storage.fs import ObjectPath, job_path


class JobLocation(click.Path):
    """-> a pathlib.Path (local, file://...) or a storage.fs.ObjectPath (an object-store URI)."""

    def __init__(self, exists: bool = False):
        super().__init__(exists=exists, file_okay=False, path_type=Path)

    def convert(self, value, param, ctx):
        if isinstance(value, ObjectPath):
            return value
        s = os.fspath(value)
        if s.startswith("file://"):
            s = s[len("file://"):]
        elif "://" in s:
            try:
                return job_path(s)
            except ValueError as e:
                self.fail(str(e), param, ctx)
        return super().convert(s, param, ctx)
