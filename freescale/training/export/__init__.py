"""`freescale export`: the checkpoint into one unsharded model folder (`exporter`, `spec`), the model
that loads it without TorchRec (`exported_model`), and its MLflow pyfunc (`model_pyfunc`).
"""
