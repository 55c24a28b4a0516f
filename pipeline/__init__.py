"""Raw interaction logs -> per-user sequences -> per-sample costs (PySpark).

The Spark transforms import pyspark; this package root and the modules that only describe data
stay import-light, usable without a JVM: `layouts` (input formats), `preflight`, `prepared` and
`run_summary` (formats), `cost_model`, `calibration` (fitting), `rank_speeds`. What every job runs
on (errors, options, paths, logs, the Spark session) is `runtime/`'s.
"""
