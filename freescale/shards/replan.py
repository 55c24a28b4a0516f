"""A resume on another world size: the rest of an interrupted epoch, planned again for K' ranks.

A checkpoint of a K-rank run records its step t; the epoch it was in has trained the plan steps
``epoch_order(...)[:t % num_steps]`` on every rank. The samples of every other plan step, all ranks
together, are the rest of the epoch. ``replan`` balances them for K' ranks with the manifest's
strategy, cost model (each row's ``cost``, which that model computed), window, token cap and seed,
keeping the global batch in the steps the epoch has left (each of the K' ranks gets about ``G / K'``
samples a step; the last step may be short, so no sample is left out). The result is written beside the checkpoint
(``ReplanFiles``): ``replan.json`` and ``rows.parquet``, one row per remaining sample naming where
it lives in the shards (``source_rank``, ``source_row``: its row in that rank's files, read in
manifest order), where it goes (``step``, ``rank``) and its new step's ``step_targets``.

The remaining samples are fed to the planner in the order the epoch would have visited them, so a
new step draws on one or two old steps and a rank reads few row groups at a time. NumPy, pyarrow
and the planner only: the launcher runs it before any rank starts (no torch, no Spark).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from freescale.runtime.errors import InputError
from freescale.shards.manifest import Manifest
from freescale.shards.step_order import epoch_order

REPLAN_JSON = "replan.json"
REPLAN_ROWS = "rows.parquet"
PLAN_COLUMNS = ("step", "cost", "length")


@dataclass(frozen=True)
class Replan:
    """What ``replan.json`` holds: the plan of the rest of one epoch for ``world_size`` ranks."""

    world_size: int
    local_batch_size: int
    num_steps: int
    num_samples: int
    from_world_size: int
    from_step: int
    """The checkpoint's step: the run's step count where the re-planned steps begin."""
    epoch: int
    position: int
    """Plan steps of ``epoch`` already trained when the checkpoint was written."""
    strategy: str
    shards_sha256: str
    read_seconds: float
    """Reading the plan's step, cost and length columns of every rank."""
    plan_seconds: float
    bubble: float
    """The planner's predicted bubble of the re-planned steps."""


@dataclass(frozen=True)
class Remaining:
    """The samples of the plan steps an epoch has not trained yet, in the order it would have."""

    source_rank: np.ndarray
    source_row: np.ndarray
    cost: np.ndarray
    length: np.ndarray


def remaining_samples(manifest: Manifest, done_steps: np.ndarray, order: np.ndarray) -> Remaining:
    """Every row of every rank whose plan step is not in ``done_steps``, sorted by that step's
    position in ``order``, then rank, then row. Reads only the ``step``, ``cost`` and ``length``
    columns."""
    position_of = np.empty(manifest.num_steps, dtype=np.int64)
    position_of[order] = np.arange(order.size)
    done = np.zeros(manifest.num_steps, dtype=bool)
    done[done_steps] = True
    parts = []
    for rank in range(manifest.world_size):
        table = pa.concat_tables(pq.read_table(path, columns=list(PLAN_COLUMNS))
                                 for path in manifest.rank_paths(rank))
        steps = table["step"].to_numpy().astype(np.int64)
        keep = np.flatnonzero(~done[steps])
        parts.append((position_of[steps[keep]], np.full(keep.size, rank, np.int64), keep,
                      table["cost"].to_numpy().astype(np.float64)[keep],
                      table["length"].to_numpy().astype(np.int64)[keep]))
    position, rank, row, cost, length = (np.concatenate(column) for column in zip(*parts))
    ordered = np.lexsort((row, rank, position))
    return Remaining(rank[ordered], row[ordered], cost[ordered], length[ordered])


def replan(manifest: Manifest, from_step: int, world_size: int, order_seed: int) -> tuple[Replan, pa.Table]:
    """The rest of the epoch that step ``from_step`` is in, planned for ``world_size`` ranks.
    ``order_seed`` is the training seed that ordered the epoch's steps."""
    from freescale.balancing import plan

    _check_replannable(manifest, world_size)
    epoch, position = divmod(from_step, manifest.num_steps)
    order = epoch_order(manifest.num_steps, manifest.window_steps, order_seed, epoch)
    started = time.perf_counter()
    rest = remaining_samples(manifest, order[:position], order)
    read_seconds, started = time.perf_counter() - started, time.perf_counter()
    if rest.cost.size == 0:
        raise InputError(f"step {from_step} ends an epoch of {manifest.num_steps} steps: nothing of it is left to "
                         f"re-plan for {world_size} ranks")
    # About the plan's global batch, in at most the epoch's steps left, so the run's step count
    # still ends the epoch where the plan's does (the trainer skips to it if fewer are needed).
    local_batch = -(-rest.cost.size // (world_size * (manifest.num_steps - position)))
    result = plan(rest.cost, world_size, local_batch, window_steps=_window(manifest), strategy=manifest.strategy,
                  lengths=rest.length, token_cap=manifest.token_cap, equal_counts=manifest.equal_counts,
                  seed=manifest.seed)
    # A step's loss is normalised by its targets over all ranks (the shards' step_targets column).
    targets = np.bincount(result.step, weights=rest.length - 1, minlength=result.num_steps).astype(np.int64)
    rows = pa.table({"source_rank": rest.source_rank.astype(np.int32), "source_row": rest.source_row,
                     "step": result.step.astype(np.int32), "rank": result.rank.astype(np.int32),
                     "step_targets": targets[result.step]})
    rows = rows.take(np.lexsort((np.arange(rows.num_rows), result.step, result.rank)))
    meta = Replan(world_size=world_size, local_batch_size=local_batch, num_steps=result.num_steps,
                  num_samples=int(rest.cost.size), from_world_size=manifest.world_size, from_step=from_step,
                  epoch=epoch, position=position, strategy=result.strategy, shards_sha256=manifest.sha256,
                  read_seconds=read_seconds, plan_seconds=time.perf_counter() - started, bubble=float(result.bubble))
    return meta, rows


def _check_replannable(manifest: Manifest, world_size: int) -> None:
    if world_size < 1:
        raise InputError(f"cannot re-plan for {world_size} ranks")
    if manifest.control is not None:
        raise InputError(f"shards {manifest.root} are the {manifest.control} control (every rank the same "
                         "samples): a control cannot be re-planned for another world size")
    if manifest.capacities is not None and len(set(manifest.capacities)) > 1:
        raise InputError(f"shards {manifest.root} were planned for unequal rank speeds (--capacities): "
                         f"{world_size} ranks' speeds are unknown, balance again for them")


def _window(manifest: Manifest) -> int:
    from freescale.balancing.strategies import PER_BATCH

    return 1 if manifest.strategy in PER_BATCH else manifest.window_steps


class ReplanFiles:
    """A re-plan's folder: ``replan.json`` and ``rows.parquet``, written atomically."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.folder = Path(folder)

    @staticmethod
    def name(from_step: int, world_size: int) -> str:
        return f"replan_step_{from_step}_ranks_{world_size}"

    def exists(self) -> bool:
        return (self.folder / REPLAN_JSON).is_file()

    def write(self, meta: Replan, rows: pa.Table) -> None:
        """Every node of a job computes the same re-plan; each writes it whole and renames it in place."""
        staging = self.folder.with_name(f"{self.folder.name}.tmp-{os.getpid()}")
        staging.mkdir(parents=True)
        pq.write_table(rows, staging / REPLAN_ROWS)
        (staging / REPLAN_JSON).write_text(json.dumps(asdict(meta), indent=1) + "\n")
        try:
            staging.rename(self.folder)
        except OSError:  # another node's identical re-plan got there first
            import shutil

            shutil.rmtree(staging, ignore_errors=True)

    def read(self) -> Replan:
        try:
            return Replan(**json.loads((self.folder / REPLAN_JSON).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise InputError(f"re-plan {self.folder / REPLAN_JSON} cannot be read: {exc}") from None

    def rows_of(self, rank: int) -> pa.Table:
        """``rank``'s rows, in step order."""
        rows = pq.read_table(self.folder / REPLAN_ROWS, filters=[("rank", "=", rank)])
        return rows.take(np.argsort(rows["step"].to_numpy(), kind="stable"))
