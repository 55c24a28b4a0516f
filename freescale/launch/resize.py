"""A launch on another world size than the shards': the rest of the checkpoint's epoch is re-planned
for this launch's ranks before they start (``freescale.shards.replan``), and the ranks train that re-plan.

No torch here (the launcher's process): the checkpoint folder is read through its layout only.
"""
from __future__ import annotations

import sys
from pathlib import Path

from freescale.runtime.errors import InputError
from freescale.shards.manifest import ShardError, load_manifest
from freescale.training.checkpoint.layout import complete_steps, other_shards, saved_config, saved_shards, saved_world_size

REPLAN_KEY = "data.replan"


def replan_settings(shards: str, world_size: int, checkpoint_folder: str, resume: bool) -> list[str]:
    """The ranks' extra settings for a launch of ``world_size`` ranks: none where the shards were
    balanced for it and no resized run is continued; else ``--data.replan DIR``, re-planning the
    rest of the newest checkpoint's epoch first where that has not been done."""
    try:
        manifest = load_manifest(shards)
    except ShardError:
        return []  # the ranks name what is wrong with the shards, in their own words
    folder = Path(checkpoint_folder) if checkpoint_folder and resume else None
    step = max(complete_steps(folder), default=None)
    if step is None or folder is None:
        if manifest.world_size != world_size:
            raise InputError(f"{manifest.root} was balanced for {manifest.world_size} ranks, this launch has "
                             f"{world_size}: a launch on another world size resumes a checkpoint (checkpoint.folder "
                             f"with one complete) and re-plans the rest of its epoch; else balance for {world_size}")
        return []
    step_dir = folder / f"step_{step}"
    if (recorded := saved_shards(step_dir)) is not None and recorded != manifest.sha256:
        raise ShardError(other_shards(step_dir, recorded, manifest.sha256))
    continued = saved_config(step_dir).get(REPLAN_KEY) or ""
    if continued and not _epoch_done(continued, step, manifest.num_steps):
        if (saved_world := saved_world_size(step_dir)) != world_size:
            raise InputError(f"checkpoint {step_dir} is of a run resized to {saved_world} ranks, mid-way through "
                             f"its re-planned epoch: resume it on {saved_world} ranks")
        return ["--" + REPLAN_KEY, continued]
    if world_size == manifest.world_size:
        return []  # the plan's own steps (the ranks reshard a checkpoint of another size)
    return ["--" + REPLAN_KEY, str(_replan(manifest, step, folder, world_size))]


def _epoch_done(replan_folder: str, step: int, steps_per_epoch: int) -> bool:
    """Whether checkpoint ``step`` ends the epoch its run re-planned (the trainer counts from the epoch's end)."""
    from freescale.shards.replan import ReplanFiles

    return step >= (ReplanFiles(replan_folder).read().epoch + 1) * steps_per_epoch


def _replan(manifest, step: int, folder: Path, world_size: int) -> Path:
    """The re-plan of checkpoint ``step``'s epoch for ``world_size`` ranks, made once."""
    from freescale.shards.replan import ReplanFiles, replan

    files = ReplanFiles(folder / ReplanFiles.name(step, world_size))
    if files.exists():
        return files.folder
    meta, rows = replan(manifest, step, world_size, _order_seed(folder / f"step_{step}", step, manifest.num_steps))
    if meta.num_samples < world_size:
        raise InputError(f"checkpoint {folder / f'step_{step}'} leaves {meta.num_samples} samples of its epoch, "
                         f"fewer than the {world_size} ranks to re-plan them for")
    files.write(meta, rows)
    print(f"freescale train: re-planned the rest of epoch {meta.epoch} ({meta.num_samples} samples after step "
          f"{step}) from {meta.from_world_size} to {world_size} ranks in "
          f"{meta.read_seconds + meta.plan_seconds:.2f} s (reading {meta.read_seconds:.2f} s, planning "
          f"{meta.plan_seconds:.2f} s): "
          f"{meta.num_steps} steps of {meta.local_batch_size} samples a rank on average, strategy "
          f"{meta.strategy}, predicted bubble {meta.bubble:.1%}", file=sys.stderr, flush=True)
    return files.folder


def _order_seed(step_dir: Path, step: int, steps_per_epoch: int) -> int:
    """The seed that ordered the checkpoint's epochs: its run's training seed. A run from before epochs
    were ordered (its config has no ``checkpoint.keep_last``, which came with them) finishes a later
    epoch in plan order, which the re-plan cannot tell: refused mid-way through such an epoch."""
    config = saved_config(step_dir)
    if "checkpoint.keep_last" not in config and step >= steps_per_epoch and step % steps_per_epoch:
        raise InputError(f"checkpoint {step_dir} was written before epochs were ordered, mid-way through epoch "
                         f"{step // steps_per_epoch}: resume it on its own world size to the epoch's end first")
    return int(config.get("training.seed", 0))
