"""The cost contracts: what `freescale calibrate` writes and balance, simulate and the trainer read.
NumPy only, no Spark and no torch: `cost_model` (per-sample cost of a history length), `calibration`
(fitting it to measured times), `rank_speeds` (relative rank capacities), `run_summary` (the
training's summary file).
"""
