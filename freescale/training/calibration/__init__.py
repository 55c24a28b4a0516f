"""`freescale calibrate`: timing the model over history lengths (`calibrate`), its options
(`calibrate_spec`), the run and its files (`run`), the tables (`report`), and rank speeds measured
in lock-step (`rank_speed_ranks`). The fit itself is `freescale.costs.calibration`'s.
"""
