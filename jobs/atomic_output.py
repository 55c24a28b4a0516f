"""All-or-nothing job outputs: write under a temporary sibling, then rename into place.

A job that fails half-way leaves nothing at the output path, so a scheduler can
rerun it; a finished output is never replaced unless the caller asked for it.
"""
from __future__ import annotations

import uuid
from contextlib import contextmanager
from typing import Iterator

from jobs.hadoop_fs import HadoopFS
from pipeline.errors import InputError


def check_output_free(fs: HadoopFS, output: str, overwrite: bool) -> None:
    """Fail before any work when the output exists and replacing it was not asked for."""
    if fs.exists(output) and not overwrite:
        raise InputError(f"output {output} already exists (pass --overwrite to replace it)")


@contextmanager
def atomic_output(fs: HadoopFS, output: str, overwrite: bool) -> Iterator[str]:
    """Yield a temporary directory; on success it becomes `output`, on error it is removed."""
    check_output_free(fs, output, overwrite)
    output = output.rstrip("/")
    tag = uuid.uuid4().hex[:12]
    staging = f"{output}.tmp-{tag}"
    try:
        yield staging
    except BaseException:
        fs.delete(staging)
        raise
    # Swap: the old output is moved aside first so a crash between the two renames
    # leaves either the old or the new output findable, never a mix.
    retired = f"{output}.old-{tag}"
    if fs.exists(output):
        fs.rename(output, retired)
    fs.rename(staging, output)
    fs.delete(retired)
