"""The run's timing file (freescale/costs/run_timings.py): windows appended as the run goes read back
as the table they came from, field by field, and the run summary's readers find it beside the summary."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from freescale.costs.run_summary import timing_table, timings_beside, write_run_summary
from freescale.costs.run_timings import TableColumns, TimingColumns, TimingFile, artifact_name
from freescale.runtime.errors import InputError
from freescale.training.timing.bubbles import TIMING_FIELDS
from freescale.training.timing.step_report import run_summary


def random_run(steps: int, ranks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.gamma(2.0, 0.01, (steps, ranks, len(TIMING_FIELDS)))


def write_windows(path, table: np.ndarray, window: int, first_step: int = 0, group_steps: int = 10) -> TimingFile:
    file = TimingFile(path, TIMING_FIELDS, table.shape[1], group_steps=group_steps)
    for start in range(0, len(table), window):
        stop = min(start + window, len(table))
        file.append(list(range(first_step + start, first_step + stop)), table[start:stop])
    file.close()
    return file


def test_windows_read_back_as_the_table_they_came_from(tmp_path):
    table = random_run(23, 3)
    file = write_windows(tmp_path / "t.parquet", table, window=5, first_step=40)
    assert file.steps == 23 and file.first_step == 40 and file.close() == tmp_path / "t.parquet"
    # a row group once 10 steps are held: windows 0-9, 10-19, then the rest at the close
    groups = pq.ParquetFile(tmp_path / "t.parquet").metadata
    assert [groups.row_group(i).num_rows for i in range(groups.num_row_groups)] == [30, 30, 9]
    columns = TimingColumns(tmp_path / "t.parquet")
    assert (len(columns), columns.ranks, columns.fields) == (23, 3, list(TIMING_FIELDS))
    assert columns.steps().tolist() == list(range(40, 63))
    np.testing.assert_array_equal(columns.table(), table)
    np.testing.assert_array_equal(columns.column("cost"), table[..., TIMING_FIELDS.index("cost")])
    with pytest.raises(KeyError):
        columns.column("nope")
    with pytest.raises(ValueError, match="closed"):
        file.append([99], table[:1])


def test_the_summary_read_column_by_column_is_the_tables_to_the_bit(tmp_path):
    """What c32ca2f's trainer computed from its in-memory table, the trainer now computes from the file."""
    for steps, ranks, window in ((1, 1, 1), (3, 2, 2), (50, 4, 7), (257, 8, 64)):
        table = random_run(steps, ranks, seed=steps)
        write_windows(tmp_path / f"{steps}.parquet", table, window)
        from_file = run_summary(TimingColumns(tmp_path / f"{steps}.parquet"))
        assert from_file == run_summary(table), (steps, ranks)
        assert from_file["measured_steps"] == max(1, steps - 2)


def test_summary_readers_find_the_file_beside_the_summary_or_a_table_in_it(tmp_path):
    table = random_run(6, 2)
    summary_path = tmp_path / "run.json"
    write_windows(timings_beside(summary_path), table, window=4)
    write_run_summary(summary_path, summary={"measured_steps": 4.0}, run_id=None, losses=[], steps=[], comm=None,
                      comm_issue_order=[], cost_model=None, fields=list(TIMING_FIELDS),
                      timings_file=timings_beside(summary_path))
    data = json.loads(summary_path.read_text())
    assert data["timings"] == {"fields": list(TIMING_FIELDS), "file": "run.timings.parquet"}
    np.testing.assert_array_equal(timing_table(data, summary_path).table(), table)
    embedded = {"timings": {"fields": list(TIMING_FIELDS), "steps_ranks_fields": table.tolist()}}
    assert isinstance(timing_table(embedded, summary_path), TableColumns)
    np.testing.assert_array_equal(timing_table(embedded, summary_path).column("step_s"),
                                  timing_table(data, summary_path).column("step_s"))
    from freescale.balancing.time_model import read_run

    run = read_run(str(summary_path))
    np.testing.assert_array_equal(run.compute, table[2:, :, TIMING_FIELDS.index("dense_compute_s")])
    timings_beside(summary_path).unlink()
    with pytest.raises(InputError, match="run.json: its timings cannot be read"):
        timing_table(data, summary_path)


def test_a_resumed_process_names_its_artifact_apart():
    assert artifact_name(0) == "timings.parquet"
    assert artifact_name(12) == "timings-from-step-12.parquet"
