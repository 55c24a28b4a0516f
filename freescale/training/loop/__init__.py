"""The training loop: `trainer` (a short `train()`), one `progress` per comm mode (`step`), the
learning-rate `schedule`, `seeding`, and the training's MLflow run (`mlflow_sink`).
"""
