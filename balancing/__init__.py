"""Cost-balanced assignment of samples to (step, rank). NumPy + OR-Tools; never imports Spark."""
