"""`freescale demo`'s last line: the trained model's HR@10 and NDCG@10 against most-popular (jobs/cli.py)."""
from __future__ import annotations

import json


def test_the_line_says_by_how_much_the_model_beats_or_trails_most_popular(tmp_path):
    from jobs.cli import quality_line

    summary = tmp_path / "train_summary.json"
    summary.write_text(json.dumps({"summary": {"hr_at_10": 0.4, "popular_hr_at_10": 0.32, "ndcg_at_10": 0.2,
                                               "popular_ndcg_at_10": 0.25}}))
    assert quality_line(summary) == ("freescale demo: the trained model does not beat most-popular on its test users: "
                                     "HR@10 0.400 vs most-popular 0.320 (+25%); NDCG@10 0.200 vs most-popular "
                                     "0.250 (-20%)")
    summary.write_text(json.dumps({"summary": {"hr_at_10": 0.4, "popular_hr_at_10": 0.32, "ndcg_at_10": 0.3,
                                               "popular_ndcg_at_10": 0.25}}))
    assert quality_line(summary).startswith("freescale demo: the trained model beats most-popular")
    assert "not in" in quality_line(tmp_path / "missing.json")
