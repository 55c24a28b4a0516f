"""Running a list of stages so that a rerun does only what changed: the stage-fingerprint engine
behind `freescale pipeline` (freescale/jobs/workflow/table.py says which stages there are).

A stage that finishes leaves a record next to its output in the working directory,
``<workdir>/<stage>.fingerprint.json``: the fingerprint of everything its arguments are built from
(``Stage.params``, derived from its job's arguments by ``stage_params``: its settings and the
identity of its input files) and of its upstream stages' fingerprints, and those values themselves,
so a rerun can say what changed. A rerun skips a stage whose fingerprint matches and whose output is
intact; it runs a stage whose parameters or inputs changed or whose output is damaged, and every
stage downstream of a stage that ran. Before a stage runs, its downstream records are marked stale,
so a run killed in between still reruns them.
Standard library only.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from freescale.runtime.errors import InputError
from freescale.runtime.json_files import read_json, write_json
from freescale.runtime.paths import local_path

RECORD = "{stage}.fingerprint.json"
"""A finished (or started) stage's record, in the working directory next to its output."""
LOCK = "LOCK"
"""The working directory's lock: one run at a time."""
CONTINUABLE = ("running", "killed", "done")
"""The record statuses a stage may continue from (``Stage.before_run``): started and not finished
(``running``: the process died with it, kill -9; ``killed``: a stop signal ended it, freescale/jobs/workflow/run.py)
or finished."""


@dataclass
class Stage:
    name: str
    run: Callable[[], int]
    """Runs the stage's job; its exit status."""
    params: dict[str, Any]
    """Every value the arguments are built from (tracking excepted) and the inputs' identities: the
    fingerprint's content (``stage_params``)."""
    output: Path
    damage: Callable[[], str | None]
    """What is wrong with the output (None: intact)."""
    off: str | None = None
    """Why the stage is not part of this pipeline (None: it is)."""
    upstream: tuple[str, ...] = ()
    """The stages whose output this one reads: when one of them runs, this one runs too."""
    before_run: Callable[[bool], str] | None = None
    """Called just before the stage runs with whether it may continue its last run (same
    fingerprint, no upstream stage ran since, not --fresh); returns a note for its line."""


@dataclass
class Failure:
    stage: str
    code: int
    error: str
    """The stage's own error message (empty when it printed none)."""
    details: bool
    """Whether the log holds details (a trace)."""


def file_identity(path: str) -> str:
    """A local file's or directory's identity (its files' relative paths, sizes and modification
    times); a remote path's is its URI (its content cannot be checked from here)."""
    local = local_path(path)
    if local is None:
        return f"remote {path}"
    p = Path(local)
    if p.is_file():
        stat = p.stat()
        return f"{stat.st_size} bytes, mtime_ns {stat.st_mtime_ns}"
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        digest = hashlib.sha256("\n".join(f"{f.relative_to(p)} {f.stat().st_size} {f.stat().st_mtime_ns}"
                                          for f in files).encode()).hexdigest()
        return f"{len(files)} files, sha256 {digest[:16]}"
    return "missing"


def json_damage(path: Path, what: str) -> Callable[[], str | None]:
    """An output check: the JSON file at ``path`` is missing or unreadable."""
    def damage() -> str | None:
        try:
            read_json(path, what)
        except InputError as exc:
            return str(exc)
        return None
    return damage


TRACKING_KEYS = ("tracking_uri", "run_name", "master")
"""Arguments that say only where a run is logged (with the ``tracking.*`` overrides) or which Spark
master computes it: in no fingerprint, so changing them reruns nothing."""
WORKDIR = "<workdir>"
"""A path under the working directory, in ``Stage.params``: a copied working directory stays current."""


def stage_params(values: dict[str, Any], overrides: dict[str, Any], workdir: Path,
                 inputs: tuple[str, ...]) -> dict[str, Any]:
    """What a stage's fingerprint covers, derived from its job's arguments: every spec value (a nested
    table by dotted keys) and training-config override, tracking excepted; a path under ``workdir`` as
    ``<workdir>/...`` (an upstream output, which the upstream fingerprint covers); each of ``inputs``
    (the values naming input files) outside it as ``"<key> identity"``, its file_identity (a copy
    with the same modification time is the same input)."""
    params: dict[str, Any] = {}
    for key, value in [*_dotted(values), *overrides.items()]:
        if key in TRACKING_KEYS or key.startswith("tracking."):
            continue
        shown = _in_workdir(value, workdir)
        if key in inputs and isinstance(value, str) and value and shown == value:
            params[f"{key} identity"] = file_identity(value)  # a file outside the workdir: what it holds, not where
        else:
            params[key] = shown
    return params


def _dotted(values: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _dotted(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _in_workdir(value: Any, workdir: Path) -> Any:
    """``value`` with a leading path under ``workdir`` (or ``@`` and one: a file the job reads) as ``<workdir>/...``."""
    if not isinstance(value, str):
        return value
    at, root = value.startswith("@"), str(workdir)
    path = value[1:] if at else value
    if path != root and not path.startswith(root + os.sep):
        return value
    return "@" * at + WORKDIR + path[len(root):]


def fingerprint(params: dict[str, Any], upstream: dict[str, str]) -> str:
    text = json.dumps({"params": params, "upstream": upstream}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprints(stages: list[Stage]) -> dict[str, tuple[str, dict[str, str]]]:
    """Each stage's fingerprint (that is not off) and the fingerprints of its upstream stages it covers, in order."""
    found: dict[str, tuple[str, dict[str, str]]] = {}
    for stage in stages:
        if stage.off is None:
            upstream = {name: found[name][0] for name in stage.upstream if name in found}
            found[stage.name] = (fingerprint(stage.params, upstream), upstream)
    return found


def record_path(work: Path, stage: str) -> Path:
    return work / RECORD.format(stage=stage)


def read_record(work: Path, stage: str) -> dict[str, Any] | None:
    try:
        record = read_json(record_path(work, stage), "stage record")
    except InputError:
        return None  # none, or unreadable: the stage runs
    return record if isinstance(record, dict) else None


def write_record(work: Path, stage: Stage, status: str, fp: str, upstream: dict[str, str], why: str = "") -> None:
    write_json(record_path(work, stage.name),
               {"stage": stage.name, "status": status, "fingerprint": fp, "params": stage.params,
                "upstream": upstream, "output": str(stage.output), "why": why, "updated_unix_s": int(time.time())})


def _changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    keys = [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
    return [f"{k} {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}" for k in keys]


def why_run(stage: Stage, record: dict[str, Any] | None, fp: str, upstream: dict[str, str],
            ran: list[str], fresh: bool) -> str | None:
    """Why `stage` must run; None when its record matches and its output is intact (skip)."""
    if fresh:
        return "--fresh"
    reran = [name for name in stage.upstream if name in ran]
    if reran:
        return f"upstream {', '.join(reran)} ran"
    if record is None:
        return "no earlier run"
    if record.get("status") == "stale":
        return record.get("why") or "an upstream stage reran"
    if record.get("fingerprint") != fp:
        changed = _changes(record.get("params") or {}, stage.params)
        if changed:
            more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
            return "parameters changed: " + ", ".join(changed[:3]) + more
        moved = [name for name in upstream if (record.get("upstream") or {}).get(name) != upstream[name]]
        return f"upstream {', '.join(moved)} changed" if moved else "fingerprint changed"
    if record.get("status") != "done":
        return "the last run stopped before finishing"
    damage = stage.damage()
    return f"output damaged: {damage}" if damage else None


def all_upstream(stage: str, graph: dict[str, tuple[str, ...]]) -> set[str]:
    """Every stage ``stage`` reads from, directly or through others."""
    found: set[str] = set()
    for name in graph.get(stage, ()):
        found |= {name} | all_upstream(name, graph)
    return found


def line(name: str, status: str, why: str) -> str:
    return f"freescale pipeline: {name:<9} {status:<8} ({why})"


def run_stages(stages: list[Stage], work: Path, fresh: bool,
               run_stage: Callable[[Stage], tuple[int, str, bool]],
               say: Callable[[str], None]) -> tuple[list[str], Failure | None]:
    """Run, skip or leave out each stage in order; ``say`` gets one line per stage. ``run_stage``
    runs one and returns its exit status, its error message and whether the log holds details.
    Returns the stages that ran and the failure that stopped the run (None: none did)."""
    graph = {stage.name: stage.upstream for stage in stages}
    derived = fingerprints(stages)
    ran: list[str] = []
    failed: Failure | None = None
    for stage in stages:
        if stage.off is not None:
            say(line(stage.name, "off", stage.off))
            continue
        if failed is not None:
            say(line(stage.name, "not run", f"{failed.stage} failed"))
            continue
        fp, upstream = derived[stage.name]
        record = read_record(work, stage.name)
        why = why_run(stage, record, fp, upstream, ran, fresh)
        if why is None:
            say(line(stage.name, "skipped", f"fingerprint matches {stage.output}"))
            continue
        if stage.before_run is not None:
            # Continue only the same work: same fingerprint, no upstream rerun since (the record
            # would be stale), not --fresh.
            continuable = (not fresh and not any(name in ran for name in all_upstream(stage.name, graph))
                           and record is not None and record.get("status") in CONTINUABLE
                           and record.get("fingerprint") == fp)
            why += stage.before_run(continuable)
        # Downstream records go stale before this stage changes their input: a run killed in between
        # must not leave them looking current.
        for later in stages:
            if stage.name in all_upstream(later.name, graph) and (old := read_record(work, later.name)) is not None:
                write_json(record_path(work, later.name), {**old, "status": "stale", "why": f"upstream {stage.name} reran"})
        print(f"freescale pipeline: {stage.name}: running ({why})", flush=True)
        write_record(work, stage, "running", fp, upstream, why)
        rc, error, details = run_stage(stage)
        ran.append(stage.name)
        if rc:
            failed = Failure(stage.name, rc, error, details)
            say(line(stage.name, "failed", f"exit {rc}: {error}" if error else f"exit {rc}"))
            continue
        write_record(work, stage, "done", fp, upstream, why)
        say(line(stage.name, "ran", why))
    return ran, failed
