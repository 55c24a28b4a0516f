"""The quality bench's choice and tables, from hand-made run summaries (no training)."""
from __future__ import annotations

import argparse

import pytest

from benchmarks import quality_bench

NAMES = ("ndcg_at_10", "hr_at_10", "mrr")


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
    args = argparse.Namespace(dataset="beauty", local_batch_size=64, repeats=3, config="c.toml", overrides=[])
    quality_bench.report(results, {"hstu": [1.0], "sasrec": [2.0]}, args, quality_bench.REPO, 1.0)
    out = capsys.readouterr().out
    assert ("| full catalog less the history | hstu |" in out) == unseen
    assert "| 100 sampled negatives | hstu | 0.3510 [0.3500, 0.3520]" in out
    # HSTU's median is 0.010 ahead, the seed spread 0.002: ahead by more than the spread.
    assert "- full catalog: SASRec beats most-popular in every run: yes; HSTU - SASRec median NDCG@10 +0.0100" in out
    assert out.count("HSTU ahead by more than the spread: yes") == (3 if unseen else 2)
