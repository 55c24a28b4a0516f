"""`freescale prepare`: raw interaction logs -> per-user sequences, the prepared-data format (PySpark).

The Spark transforms import pyspark; this package root and the modules that only describe data
stay import-light, usable without a JVM: `layouts` (input formats), `preflight`, `prepared` (the
format) and `prepare_spec`. What every job runs on (errors, options, paths, logs, the Spark
session) is `freescale.runtime`'s; the cost contracts are `freescale.costs`'.
"""
