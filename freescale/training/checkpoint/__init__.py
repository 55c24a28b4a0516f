"""Checkpoints: writing and checking them (`checkpointer`), resuming a run exactly (`resume`), and
loading rank files without unpickling code (`safe_load`).
"""
