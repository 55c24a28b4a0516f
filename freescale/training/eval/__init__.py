"""Scoring held-out items: the evaluator, its ranking metrics, and validation with early stopping."""
