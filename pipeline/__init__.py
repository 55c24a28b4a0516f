"""Raw interaction logs -> per-user sequences -> per-sample costs (PySpark).

Submodules import pyspark; this package root stays import-light so that
`pipeline.errors` and `pipeline.cost_model` can be used without a JVM.
"""
