"""The quality bench's choice and tables, from hand-made run summaries (no training)."""
from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import quality_bench

NAMES = ("ndcg_at_10", "hr_at_10", "mrr")
ARGS = argparse.Namespace(dataset="beauty", local_batch_size=64, repeats=3, config="c.toml", overrides=[])


def summary(score: float, valid: float, unseen: bool) -> dict:
    row = {"best_epoch": 10.0, "best_valid_sampled_ndcg_at_10": valid, "eval_samples": 100.0}
    for prefix in ("", "sampled_") + (("unseen_",) if unseen else ()):
        for name in NAMES:
            row[f"{prefix}{name}"] = score + (0.3 if prefix == "sampled_" else 0.0)
            row[f"popular_{prefix}{name}"] = 0.01
    return row


def test_the_setting_is_chosen_by_the_median_validation_score():
    by_setting = {"a": [summary(0, v, False) for v in (0.30, 0.40, 0.41)],
                  "b": [summary(0, v, False) for v in (0.35, 0.36, 0.50)]}
    assert quality_bench.choose(by_setting) == "a"  # medians 0.40 against 0.36; b's best seed does not decide


@pytest.mark.parametrize("unseen", [False, True])
def test_the_tables_show_the_unseen_ranking_only_where_every_run_has_it(capsys, unseen):
    results = {"hstu": [summary(0.05 + i / 1000, 0.4, unseen) for i in range(3)],
               "sasrec": [summary(0.04 + i / 1000, 0.4, True) for i in range(3)]}
    quality_bench.report(results, {"hstu": [1.0], "sasrec": [2.0]}, ARGS, quality_bench.REPO, 1.0)
    out = capsys.readouterr().out
    assert ("| full catalog less the history | hstu |" in out) == unseen
    assert "| 0.4000 [0.4000, 0.4000] | 1.0 [1.0, 1.0] |" in out  # validation at the best epoch; minutes
    assert "| 100 sampled negatives | hstu | 0.3510 [0.3500, 0.3520]" in out
    # HSTU's median is 0.010 ahead, the seed spread 0.002: ahead by more than the spread.
    assert "- full catalog: SASRec beats most-popular in every run: yes; HSTU - SASRec median NDCG@10 +0.0100" in out
    assert out.count("HSTU ahead by more than the spread: yes; HSTU not below: yes") == (3 if unseen else 2)
    assert "the runs above took 3 min between them" in out


def test_the_verdicts_say_no_when_hstu_is_behind(capsys):
    results = {"hstu": [summary(0.040 + i / 10000, 0.4, False) for i in range(3)],
               "sasrec": [summary(0.042 + i / 10000, 0.4, False) for i in range(3)]}
    quality_bench.report(results, {"hstu": [], "sasrec": []}, ARGS, quality_bench.REPO, 1.0)
    out = capsys.readouterr().out
    assert "HSTU - SASRec median NDCG@10 -0.0020" in out
    assert out.count("HSTU ahead by more than the spread: NO; HSTU not below: NO") == 2


def test_a_recorded_run_is_put_back_for_resume_and_a_workdir_run_wins(tmp_path):
    """``--record``: a finished run's summary and minutes are kept small, and a resumed bench on a bare
    workdir finds the run as the bench wrote it; a run the workdir has is left alone."""
    work, record = tmp_path / "work", tmp_path / "record" / "beauty" / "hstu-0.json"
    work.mkdir()
    out, took = work / "hstu-0.json", work / "hstu-0.minutes"
    quality_bench.record_run(out, took, record)
    assert not record.exists()  # not finished: no minutes yet
    out.write_text(json.dumps({"summary": summary(0.05, 0.4, True), "losses": list(range(1000))}))
    took.write_text("7.5\n")
    quality_bench.record_run(out, took, record)
    assert json.loads(record.read_text()) == {"summary": summary(0.05, 0.4, True), "minutes": 7.5}
    assert record.stat().st_size < out.stat().st_size / 2
    out.unlink(), took.unlink()
    quality_bench.restore_run(record, out, took)
    assert json.loads(out.read_text())["summary"] == summary(0.05, 0.4, True) and float(took.read_text()) == 7.5
    took.write_text("9.0\n")
    quality_bench.restore_run(record, out, took)
    assert float(took.read_text()) == 9.0
