"""Raw interaction logs -> per-user sequences -> per-sample costs (PySpark).

The Spark transforms import pyspark; this package root and the modules that only
describe data stay import-light, usable without a JVM: `errors`, `layouts` (input
formats), `cost_model`, `calibration` (fitting), `rank_speeds`, `json_files`.
"""
