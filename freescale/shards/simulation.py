"""The plans `freescale simulate` predicts, for a ``SimulationSpec`` (freescale/balancing/simulation_spec.py):
a shard set's own plan, read from its manifest and files, or plans the real planner builds on a
prepared dataset's lengths or synthetic ones (freescale/balancing/simulation_run.py). Here rather than in
freescale/balancing/ because they read what `freescale prepare` and `freescale balance` wrote (Parquet,
with pyarrow, imported when read).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from freescale.balancing.simulation_run import Plans, built_plans, check_runs_cost_model, load_cost_model, plans_cost_model
from freescale.balancing.time_model import describe_cost_model
from freescale.runtime.errors import InputError, one_line

if TYPE_CHECKING:
    from freescale.balancing.simulation_spec import SimulationSpec
    from freescale.costs.cost_model import CostModel


def simulation_plans(spec: SimulationSpec, runs_model: CostModel | None) -> tuple[Plans, dict, CostModel]:
    """{K: {plan name: [steps, K] loads}}, what they are and the cost model they are costed with
    (its per-step constant is the time model's): --shards' own plan, else the contiguous and
    balanced plans at every K on --input's lengths or --lengths'."""
    if spec.shards:
        return shard_plan(spec, runs_model)
    model = plans_cost_model(spec, runs_model)
    return *built_plans(spec, model, prepared_lengths(spec.input) if spec.input else None), model


def shard_plan(spec: SimulationSpec, runs_model: CostModel | None) -> tuple[Plans, dict, CostModel]:
    """The shard set's own plan: {K: {plan name: [steps, K] loads}}, what it is, and the cost model
    it is costed with (--cost-model, else the manifest's)."""
    import pyarrow.parquet as pq

    from freescale.costs.cost_model import CostModel
    from freescale.runtime.json_files import read_json
    from freescale.shards.manifest import ShardError, load_manifest
    from freescale.shards.schema import MANIFEST_NAME

    raw = read_json(Path(spec.shards) / MANIFEST_NAME, "shard manifest (freescale balance output)")
    if not isinstance(raw, dict) or not isinstance(raw.get("world_size"), int):
        raise ShardError(f"{Path(spec.shards) / MANIFEST_NAME}: no world_size")
    manifest = load_manifest(spec.shards, raw["world_size"])
    k, b = manifest.world_size, manifest.local_batch_size
    if spec.world_sizes and spec.planned_world_sizes != [k]:
        raise InputError(f"--world-sizes {spec.world_sizes}: shard set {spec.shards} is planned for {k} ranks")
    if spec.local_batch_size not in (None, b):
        raise InputError(f"--local-batch-size {spec.local_batch_size}: shard set {spec.shards} has {b}")
    model = load_cost_model(spec.cost_model) if spec.cost_model else CostModel.from_json(
        manifest.cost_model, f"{spec.shards} manifest's cost model")
    check_runs_cost_model(model, runs_model, spec.calibrate_from)
    loads = np.zeros((manifest.num_steps, k))
    for rank in range(k):
        for path in manifest.rank_paths(rank):
            table = pq.read_table(path, columns=["step", "length"]).to_pydict()
            np.add.at(loads[:, rank], np.asarray(table["step"], dtype=np.int64),
                      model.predict(np.asarray(table["length"])))
    name = manifest.control or manifest.strategy
    return {k: {name: loads}}, {"source": "shards", "shards": spec.shards, "local_batch_size": b,
                                "plan": name, "cost_model": describe_cost_model(model)}, model


def prepared_lengths(path: str) -> np.ndarray:
    """Every sample's history length from a prepared dataset (local Parquet, read with pyarrow)."""
    import pyarrow.parquet as pq

    from freescale.prepare.prepared import sequences_path

    sequences = sequences_path(path)
    try:
        table = pq.read_table(sequences, columns=["length"])
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for unreadable input
        raise InputError(f"--input {sequences}: no readable Parquet with column 'length' ({one_line(exc)})") from None
    lengths = table.column("length").to_numpy(zero_copy_only=False)
    if lengths.size == 0:
        raise InputError(f"--input {sequences} holds no samples")
    return lengths.astype(np.int64)
