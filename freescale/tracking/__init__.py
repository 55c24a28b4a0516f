"""Every job's MLflow run: where runs go (`store`), the datasets a run read or wrote (`datasets`),
and the run itself with the tags that line up a comparison's runs (`runs`). Below the trainer and
the jobs: no mlflow import until a run opens, nothing of `freescale/training/`.
"""
